#include "src/rendezvous/etcd/etcd_rendezvous.h"

#include <json/json.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/base/sync.h"
#include "src/base/thread_util.h"
#include "src/core/auth.h"
#include "src/core/peer_event_thread.h"
#include "src/core/protocol.h"
#include "src/rendezvous/etcd/etcd_client.h"
#include "stepmesh/status.h"

namespace stepmesh::etcd {
namespace {

using core::kNoNode;
using core::MembershipEvent;
using core::NodeId;

// How long a member may be unreachable before the watch gives up on the
// cluster (the data plane carries on; no more membership events).
constexpr absl::Duration kWatchReconnectWindow = absl::Seconds(30);
// An orderly leave's two writes, each.
constexpr absl::Duration kLeaveBound = absl::Seconds(2);

// The start shape, and the capacity where it is above it (a joiner of
// another capacity is another mesh).
std::string ShapeOf(int workers, int servers, int max_workers, int max_servers,
                    const std::string& mesh) {
  std::string out = absl::StrCat("workers=", workers, " servers=", servers);
  if (max_workers > workers || max_servers > servers) {
    absl::StrAppend(&out, " max_workers=", std::max(max_workers, workers),
                    " max_servers=", std::max(max_servers, servers));
  }
  absl::StrAppend(&out, " mesh=", mesh);
  return out;
}

std::string Shape(const MeshOptions& o) {
  return ShapeOf(o.num_workers, o.num_servers, o.WorkerCapacity(), o.ServerCapacity(), o.mesh_id);
}

const char* CapacityOption(Role role) {
  return role == Role::kWorker ? "max_workers, STEPMESH_MAX_WORKERS"
                               : "max_servers, STEPMESH_MAX_SERVERS";
}

std::string RoleDir(Role role) { return role == Role::kWorker ? "worker" : "server"; }

std::string MemberKey(const std::string& prefix, Role role, int rank) {
  return absl::StrFormat("%s/members/%s/%05d", prefix, RoleDir(role), rank);
}

std::string Hex(absl::string_view bytes) { return absl::BytesToHexString(bytes); }

// A lease ID as etcdctl prints (and an operator pastes) it: 16 hex digits.
std::string LeaseId(int64_t lease) { return absl::StrCat(absl::Hex(lease, absl::kZeroPad16)); }

// The member value's signature with the mesh token: binds key, endpoint and shape.
std::string Proof(const std::string& token, const std::string& key, const std::string& endpoint,
                  const std::string& shape) {
  if (token.empty()) return "";
  return Hex(core::AsText(core::HmacSha256(
      token, absl::StrCat("stepmesh etcd member\n", key, "\n", endpoint, "\n", shape))));
}

struct Member {
  std::string endpoint;
  std::string shape;
  std::string proof;
  bool left = false;
  uint64_t barriers = 0;  // the newest barrier it entered
};

absl::StatusOr<Member> ParseMember(const KeyValue& kv) {
  Json::CharReaderBuilder builder;
  std::unique_ptr<Json::CharReader> reader(builder.newCharReader());
  Json::Value v;
  std::string errors;
  if (!reader->parse(kv.value.data(), kv.value.data() + kv.value.size(), &v, &errors) ||
      !v.isObject()) {
    return absl::FailedPreconditionError(
        absl::StrCat("key ", kv.key, " does not hold a stepmesh member (", errors, ")"));
  }
  Member m;
  m.endpoint = v["endpoint"].asString();
  // A value without max_workers/max_servers is one of a fixed shape.
  m.shape = ShapeOf(v["workers"].asInt(), v["servers"].asInt(), v["max_workers"].asInt(),
                    v["max_servers"].asInt(), v["mesh"].asString());
  m.proof = v["proof"].asString();
  m.left = v["left"].asBool();
  m.barriers = v["barriers"].asUInt64();
  return m;
}

// `barriers`: the newest barrier this member entered (a joiner counts its
// barriers from the mesh's, even when that barrier's counter is gone with
// the lease of its last writer).
std::string MemberValue(const MeshOptions& o, const std::string& endpoint, const std::string& proof,
                        bool left, uint64_t barriers = 0) {
  Json::Value v;
  v["endpoint"] = endpoint;
  v["workers"] = o.num_workers;
  v["servers"] = o.num_servers;
  if (o.WorkerCapacity() > o.num_workers || o.ServerCapacity() > o.num_servers) {
    v["max_workers"] = o.WorkerCapacity();
    v["max_servers"] = o.ServerCapacity();
  }
  v["mesh"] = o.mesh_id;
  v["proof"] = proof;
  v["left"] = left;
  if (barriers > 0) v["barriers"] = static_cast<Json::UInt64>(barriers);
  Json::StreamWriterBuilder w;
  w["indentation"] = "";
  return Json::writeString(w, v);
}

// PREFIX/members/worker/00003 -> the node; kNoNode for other keys.
NodeId NodeOfKey(absl::string_view key, absl::string_view members_dir) {
  if (!absl::ConsumePrefix(&key, members_dir)) return kNoNode;
  Role role;
  if (absl::ConsumePrefix(&key, "worker/")) {
    role = Role::kWorker;
  } else if (absl::ConsumePrefix(&key, "server/")) {
    role = Role::kServer;
  } else {
    return kNoNode;
  }
  uint32_t rank = 0;
  if (!absl::SimpleAtoi(key, &rank)) return kNoNode;
  return core::MakeNodeId(role, rank);
}

// txn: create `key` = `value` under `lease` if it does not exist; the
// failure branch reads the holder, the success branch (with `also_read`, a
// directory) what that directory held at the same revision.
Json::Value CreateIfAbsent(const std::string& key, const std::string& value, int64_t lease,
                           const std::string& also_read = "") {
  Json::Value txn;
  Json::Value compare;
  compare["target"] = "CREATE";
  compare["key"] = EtcdClient::Encode(key);
  compare["create_revision"] = "0";
  txn["compare"].append(compare);
  Json::Value put;
  put["request_put"]["key"] = EtcdClient::Encode(key);
  put["request_put"]["value"] = EtcdClient::Encode(value);
  put["request_put"]["lease"] = std::to_string(lease);
  txn["success"].append(put);
  if (!also_read.empty()) {
    Json::Value dir;
    dir["request_range"]["key"] = EtcdClient::Encode(also_read);
    dir["request_range"]["range_end"] = EtcdClient::Encode(PrefixEnd(also_read));
    txn["success"].append(dir);
  }
  Json::Value range;
  range["request_range"]["key"] = EtcdClient::Encode(key);
  txn["failure"].append(range);
  return txn;
}

class EtcdRendezvous final : public core::Rendezvous {
 public:
  EtcdRendezvous(const MeshOptions& options, std::string endpoint, std::string prefix,
                 std::unique_ptr<EtcdClient> client)
      : options_(options),
        endpoint_(std::move(endpoint)),
        prefix_(std::move(prefix)),
        members_dir_(prefix_ + "/members/"),
        barriers_dir_(prefix_ + "/barriers/"),
        formed_key_(prefix_ + "/formed"),
        client_(std::move(client)),
        ttl_s_(std::max<int64_t>(
            2, static_cast<int64_t>(std::ceil(absl::ToDoubleSeconds(options.timeout))))) {}

  ~EtcdRendezvous() override {
    Leave();
    stop_.store(true);
    client_->Cancel();
    {
      base::MutexLock lock(&mu_);  // wakes the waits below
    }
    if (watcher_.joinable()) watcher_.join();
    if (keeper_.joinable()) keeper_.join();
    peer_events_.Stop();
    if (lease_ != 0 && !revoked_) {
      (void)client_->Revoke(lease_, absl::Now() + kLeaveBound);  // a failed join's keys
    }
  }

  absl::Status Join(absl::Time deadline) {
    STEPMESH_ASSIGN_OR_RETURN(lease_, client_->GrantLease(ttl_s_, deadline));
    STEPMESH_RETURN_IF_ERROR(CheckShape(deadline));
    STEPMESH_RETURN_IF_ERROR(TakeRank(deadline));
    return AwaitRoster(deadline);
  }

  void StartMonitor(core::RendezvousEvents events) override {
    events_ = std::move(events);
    peer_events_.Start();
    keeper_ = base::StartNamedThread("sm-etcd-lease", {}, [this] { KeepAliveLoop(); });
    watcher_ = base::StartNamedThread("sm-etcd-watch", {}, [this] { WatchLoop(); });
  }

  absl::Status Barrier(absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    uint64_t seq;
    {
      base::MutexLock lock(&mu_);
      if (!fatal_.ok()) return fatal_;
      seq = ++barrier_sent_;
    }
    const std::string key = absl::StrCat(prefix_, "/barriers/", seq);
    // Compare-and-swap on the counter's mod_revision: a txn that loses the
    // race returns the counter as it is now (its failure branch reads it), so
    // the next attempt needs no separate read.
    int64_t count = 0;
    int64_t mod = 0;
    int64_t created = 0;
    for (;;) {
      Json::Value txn;
      Json::Value compare;
      compare["target"] = "MOD";
      compare["key"] = EtcdClient::Encode(key);
      compare["mod_revision"] = std::to_string(mod);
      txn["compare"].append(compare);
      Json::Value put;
      put["request_put"]["key"] = EtcdClient::Encode(key);
      put["request_put"]["value"] = EtcdClient::Encode(std::to_string(count + 1));
      put["request_put"]["lease"] = std::to_string(lease_);
      txn["success"].append(put);
      Json::Value read;
      read["request_range"]["key"] = EtcdClient::Encode(key);
      txn["failure"].append(read);
      absl::StatusOr<TxnResult> done = client_->Txn(txn, deadline);
      if (!done.ok()) return Named(done.status(), key);
      if (done->succeeded) {
        {
          base::MutexLock lock(&mu_);
          int64_t& seen = barrier_count_[seq];
          seen = std::max(seen, count + 1);
          if (mod == 0) created = done->revision;  // this txn created the counter
          if (created != 0) barrier_created_.emplace(seq, created);
        }
        // The member key says so too (no event: the endpoint is the same),
        // keeping "left" if a drain began.
        const std::string member = MemberKey(prefix_, options_.role, rank_);
        base::MutexLock lock(&put_mu_);
        if (!left_.load()) {
          absl::Status noted =
              client_->Put(member, MemberValue(options_, endpoint_, proof_, announced_.load(), seq),
                           lease_, deadline);
          if (!noted.ok()) return Named(noted, member);
        }
        break;
      }
      count = 0;
      mod = 0;
      if (!done->range.empty()) {
        (void)absl::SimpleAtoi(done->range[0].value, &count);
        mod = done->range[0].mod_revision;
        created = done->range[0].create_revision;
      }
      if (absl::Now() >= deadline) break;
    }
    base::MutexLock lock(&mu_);
    auto released = [this, seq]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      auto it = barrier_count_.find(seq);
      return !fatal_.ok() || stop_.load() ||
             (it != barrier_count_.end() && it->second >= LiveCountAt(seq));
    };
    if (!mu_.AwaitWithDeadline(released, deadline)) {
      auto it = barrier_count_.find(seq);
      return absl::DeadlineExceededError(
          absl::StrCat("barrier ", seq, " (etcd key ", key,
                       "): ", it == barrier_count_.end() ? 0 : it->second, " of ", LiveCountAt(seq),
                       " live members entered within ", absl::FormatDuration(timeout)));
    }
    if (!fatal_.ok()) return fatal_;
    if (stop_.load()) return absl::CancelledError("the participant is shutting down");
    return absl::OkStatus();
  }

  void Leave() override {
    if (left_.exchange(true) || lease_ == 0 || !joined_) return;
    const std::string key = MemberKey(prefix_, options_.role, rank_);
    const absl::Time deadline = absl::Now() + kLeaveBound;
    // Marked left first (unless a drain did), so peers see a goodbye and not
    // a loss when the revoke deletes the key.
    base::MutexLock lock(&put_mu_);
    if (!announced_.load()) {
      (void)client_->Put(key, MemberValue(options_, endpoint_, proof_, /*left=*/true, Entered()),
                         lease_, deadline);
    }
    if (client_->Revoke(lease_, absl::Now() + kLeaveBound).ok()) revoked_ = true;
  }

  // The drain's first step: the member key says "left" (a new revision, the
  // epoch the others count this node out at) while the lease, and so the
  // key, stays until Leave() revokes it.
  absl::Status AnnounceLeaving() override {
    if (!joined_ || left_.load()) {
      return absl::FailedPreconditionError("this participant already left the mesh");
    }
    {
      base::MutexLock lock(&mu_);
      if (!fatal_.ok()) return fatal_;
    }
    base::MutexLock lock(&put_mu_);
    if (announced_.exchange(true)) return absl::OkStatus();
    const std::string key = MemberKey(prefix_, options_.role, rank_);
    absl::Status put =
        client_->Put(key, MemberValue(options_, endpoint_, proof_, /*left=*/true, Entered()),
                     lease_, absl::Now() + kLeaveBound);
    if (!put.ok()) {
      announced_.store(false);
      return Named(put, key);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<ClockSync> EstimateClock(int samples, absl::Duration) override {
    ClockSync best = core::WallClockAgainstMonotonic();
    for (int i = 1; i < samples; ++i) {
      const ClockSync s = core::WallClockAgainstMonotonic();
      if (s.round_trip_ns < best.round_trip_ns) best = s;
    }
    return best;
  }

 private:
  absl::Status Named(const absl::Status& s, const std::string& key) const {
    return absl::Status(s.code(), absl::StrCat("etcd key ", key, ": ", s.message()));
  }

  absl::Status CheckShape(absl::Time deadline) {
    const std::string key = prefix_ + "/shape";
    const std::string shape = Shape(options_);
    absl::StatusOr<TxnResult> r = client_->Txn(CreateIfAbsent(key, shape, lease_), deadline);
    if (!r.ok()) return Named(r.status(), key);
    if (!r->succeeded && !r->range.empty() && r->range[0].value != shape) {
      return absl::FailedPreconditionError(absl::StrCat(
          "etcd key ", key, " at ", client_->url().Endpoints(), " holds another mesh's shape (",
          r->range[0].value, "); this participant has ", shape,
          ": use another prefix (etcd://.../PREFIX) or mesh id"));
    }
    return absl::OkStatus();
  }

  uint64_t Entered() {
    base::MutexLock lock(&mu_);
    return barrier_sent_;
  }

  // Whether the mesh formed already: its start shape was complete once
  // (PREFIX/formed, written by each member whose roster completed).
  absl::StatusOr<bool> Formed(absl::Time deadline) {
    absl::StatusOr<RangeResult> r = client_->Range(formed_key_, "", deadline);
    if (!r.ok()) return Named(r.status(), formed_key_);
    return !r->kvs.empty();
  }

  // The rank asked for; else the lowest free one: of the start shape while
  // the mesh forms, of the capacity once it formed (docs/elastic.md). Each
  // claim is a transaction that creates the member key only if absent, so no
  // two processes ever hold one rank.
  absl::Status TakeRank(absl::Time deadline) {
    const Role role = options_.role;
    const int start = role == Role::kWorker ? options_.num_workers : options_.num_servers;
    const int capacity =
        role == Role::kWorker ? options_.WorkerCapacity() : options_.ServerCapacity();
    const std::string dir = absl::StrCat(members_dir_, RoleDir(role), "/");
    for (;;) {
      KeyValue holder;
      int64_t seen_revision = 0;
      // Read before the claim: formed then, this node joins a running mesh;
      // else it is of the start shape (the mesh cannot form without it).
      STEPMESH_ASSIGN_OR_RETURN(const bool formed, Formed(deadline));
      std::vector<int> ranks;
      if (options_.rank >= 0) {
        ranks.push_back(options_.rank);
      } else {
        absl::StatusOr<RangeResult> held = client_->Range(dir, PrefixEnd(dir), deadline);
        if (!held.ok()) return Named(held.status(), dir);
        std::vector<bool> taken(static_cast<size_t>(capacity), false);
        for (const KeyValue& kv : held->kvs) {
          const NodeId node = NodeOfKey(kv.key, members_dir_);
          if (node == kNoNode || core::NodeRank(node) >= static_cast<uint32_t>(capacity)) continue;
          taken[core::NodeRank(node)] = true;
          holder = kv;
        }
        seen_revision = held->revision;
        for (int r = 0; r < (formed ? capacity : start); ++r) {
          if (!taken[static_cast<size_t>(r)]) ranks.push_back(r);
        }
      }
      for (int r : ranks) {
        const std::string key = MemberKey(prefix_, role, r);
        const std::string proof = Proof(options_.auth_token, key, endpoint_, Shape(options_));
        absl::StatusOr<TxnResult> t =
            client_->Txn(CreateIfAbsent(key, MemberValue(options_, endpoint_, proof, false), lease_,
                                        prefix_ + "/"),
                         deadline);
        if (!t.ok()) return Named(t.status(), key);
        if (t->succeeded) {
          rank_ = r;
          self_ = core::MakeNodeId(role, static_cast<uint32_t>(r));
          proof_ = proof;
          joined_ = true;
          joined_running_ = formed;
          // Barriers begun before this join pass without it (the others do
          // not count it for them): this node's barriers count from the
          // newest, as its counter or a member's key (read at the claim's
          // revision) says.
          base::MutexLock lock(&mu_);
          for (const KeyValue& kv : t->range) {
            absl::string_view seq = kv.key;
            uint64_t n = 0;
            if (absl::ConsumePrefix(&seq, barriers_dir_) && absl::SimpleAtoi(seq, &n)) {
              barrier_sent_ = std::max(barrier_sent_, n);
            } else if (NodeOfKey(kv.key, members_dir_) != kNoNode) {
              absl::StatusOr<Member> m = ParseMember(kv);
              if (m.ok()) barrier_sent_ = std::max(barrier_sent_, m->barriers);
            }
          }
          return absl::OkStatus();
        }
        if (!t->range.empty()) holder = t->range[0];
        seen_revision = t->revision;
      }
      if (options_.rank < 0 && formed) {
        if (!ranks.empty() && absl::Now() < deadline) continue;  // lost a race: read again
        return absl::ResourceExhaustedError(absl::StrCat(
            "no free ", RoleDir(role), " rank: all ", capacity, " of the mesh's capacity (",
            CapacityOption(role), ") are members (etcd keys ", dir, " at ",
            client_->url().Endpoints(), ")"));
      }
      // Taken: wait for a delete among them (a crashed run's lease expiring).
      const std::string range_key =
          options_.rank >= 0 ? MemberKey(prefix_, role, options_.rank) : dir;
      const std::string range_end = options_.rank >= 0 ? std::string() : PrefixEnd(range_key);
      // Without a rank, a short watch and a fresh read: the mesh may have
      // formed meanwhile (the start shape is complete), opening the capacity.
      const absl::Time until =
          options_.rank >= 0 ? deadline : std::min(deadline, absl::Now() + absl::Milliseconds(250));
      absl::Status w =
          client_->Watch(range_key, range_end, seen_revision + 1, kWatchReconnectWindow, until,
                         [](int64_t, const std::vector<WatchEvent>& events) {
                           return std::none_of(events.begin(), events.end(),
                                               [](const WatchEvent& e) { return e.deleted; });
                         });
      if (w.ok()) continue;  // one went away: try again
      if (!absl::IsDeadlineExceeded(w)) return Named(w, range_key);
      if (absl::Now() < deadline) continue;
      absl::StatusOr<int64_t> ttl = client_->TimeToLive(holder.lease, absl::Now() + kLeaveBound);
      absl::StatusOr<Member> m = ParseMember(holder);
      return absl::AlreadyExistsError(absl::StrCat(
          options_.rank >= 0 ? "" : absl::StrCat("every ", RoleDir(role), " rank is taken; "),
          "etcd key ", holder.key, " at ", client_->url().Endpoints(), " is held by lease ",
          LeaseId(holder.lease), m.ok() ? absl::StrCat(" (endpoint ", m->endpoint, ")") : "",
          ", still alive after ", absl::FormatDuration(options_.timeout),
          ": another participant of this rank, or a crashed run's lease",
          ttl.ok() && *ttl >= 0 ? absl::StrCat(" that expires in ", *ttl, " s") : std::string(),
          " (etcdctl lease revoke ", LeaseId(holder.lease), " clears it)"));
    }
  }

  // Applies one member key's put or delete to the view; returns the event
  // for the others (nullopt: no change, or this node's own key).
  std::optional<MembershipEvent> Apply(const WatchEvent& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const NodeId node = NodeOfKey(e.kv.key, members_dir_);
    if (node == kNoNode) return std::nullopt;
    MembershipEvent out;
    out.node = node;
    out.epoch = static_cast<uint64_t>(e.kv.mod_revision);
    State& st = state_[node];
    if (node == self_) {
      if (e.deleted && !left_.load() && fatal_.ok()) {
        fatal_ = absl::UnavailableError(absl::StrCat("this participant's etcd key ", e.kv.key,
                                                     " was deleted (its lease expired: no "
                                                     "keep-alive reached ",
                                                     client_->url().Endpoints(), " within ", ttl_s_,
                                                     " s)"));
        STEPMESH_LOG(kError, fatal_.message(), "; no more barriers or membership events");
      }
      return std::nullopt;
    }
    if (e.deleted) {
      if (st != State::kLive) return std::nullopt;
      st = State::kLost;
      out.kind = MembershipEvent::Kind::kLost;
      out.why = absl::UnavailableError(absl::StrCat(
          "etcd key ", e.kv.key, " expired (its lease had no keep-alive within the TTL)"));
      return out;
    }
    absl::StatusOr<Member> m = ParseMember(e.kv);
    if (!m.ok() || !Verified(e.kv.key, *m).ok()) {
      STEPMESH_LOG(kWarning, "ignoring etcd key ", e.kv.key, ": ",
                   m.ok() ? Verified(e.kv.key, *m).message() : m.status().message());
      return std::nullopt;
    }
    if (m->left) {
      if (st != State::kLive) return std::nullopt;
      st = State::kLeft;
      out.kind = MembershipEvent::Kind::kLeft;
      return out;
    }
    std::string& endpoint = endpoints_[node];
    if (st == State::kLive && endpoint == m->endpoint) return std::nullopt;
    st = State::kLive;
    endpoint = m->endpoint;
    since_[node] = e.kv.create_revision;
    out.kind = MembershipEvent::Kind::kJoined;
    out.endpoint = m->endpoint;
    return out;
  }

  absl::Status Verified(const std::string& key, const Member& m) const {
    if (m.shape != Shape(options_)) {
      return absl::FailedPreconditionError(
          absl::StrCat("etcd key ", key, " holds a member of another mesh shape (", m.shape,
                       "); this participant has ", Shape(options_)));
    }
    if (!options_.auth_token.empty() &&
        m.proof != Proof(options_.auth_token, key, m.endpoint, m.shape)) {
      return absl::PermissionDeniedError(absl::StrCat(
          "etcd key ", key, " was not written with this mesh's auth token (STEPMESH_AUTH_TOKEN)"));
    }
    return absl::OkStatus();
  }

  // Every role's live members reach the start shape.
  bool StartShapeLive() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    int workers = 0, servers = 0;
    for (const auto& [node, st] : state_) {
      if (st != State::kLive) continue;
      (core::NodeRole(node) == Role::kWorker ? workers : servers) += 1;
    }
    return workers >= options_.num_workers && servers >= options_.num_servers;
  }

  // The roster: at once when the mesh formed already (a join into the
  // running mesh: its members as of the read), else once the start shape is
  // complete. Then this node marks the mesh formed.
  absl::Status AwaitRoster(absl::Time deadline) {
    const bool formed = joined_running_;
    absl::StatusOr<RangeResult> all =
        client_->Range(members_dir_, PrefixEnd(members_dir_), deadline);
    if (!all.ok()) return Named(all.status(), members_dir_);
    {
      base::MutexLock lock(&mu_);
      for (const KeyValue& kv : all->kvs) {
        const NodeId node = NodeOfKey(kv.key, members_dir_);
        if (node == kNoNode) continue;
        STEPMESH_ASSIGN_OR_RETURN(Member m, ParseMember(kv));
        STEPMESH_RETURN_IF_ERROR(Verified(kv.key, m));
        if (m.left) continue;
        state_[node] = State::kLive;
        endpoints_[node] = m.endpoint;
        since_[node] = kv.create_revision;
      }
    }
    int64_t revision = all->revision;
    const int total = options_.num_workers + options_.num_servers;
    auto complete = [&]() {
      base::MutexLock lock(&mu_);
      return formed || StartShapeLive();
    };
    absl::Status problem;
    if (!complete()) {
      absl::Status w =
          client_->Watch(members_dir_, PrefixEnd(members_dir_), revision + 1, kWatchReconnectWindow,
                         deadline, [&](int64_t rev, const std::vector<WatchEvent>& events) {
                           base::MutexLock lock(&mu_);
                           for (const WatchEvent& e : events) {
                             const NodeId node = NodeOfKey(e.kv.key, members_dir_);
                             if (node == kNoNode) continue;
                             if (!e.deleted) {
                               absl::StatusOr<Member> m = ParseMember(e.kv);
                               absl::Status v = m.ok() ? Verified(e.kv.key, *m) : m.status();
                               if (!v.ok()) {
                                 problem = v;
                                 return false;
                               }
                             }
                             (void)Apply(e);
                             revision = std::max(revision, e.kv.mod_revision);
                           }
                           revision = std::max(revision, rev);
                           return !StartShapeLive();
                         });
      if (!problem.ok()) return problem;
      if (!w.ok() && !absl::IsDeadlineExceeded(w)) return Named(w, members_dir_);
      if (!complete()) {
        std::string missing;
        base::MutexLock lock(&mu_);
        for (int r = 0; r < options_.num_workers + options_.num_servers; ++r) {
          const Role role = r < options_.num_workers ? Role::kWorker : Role::kServer;
          const int rank = r < options_.num_workers ? r : r - options_.num_workers;
          auto it = state_.find(core::MakeNodeId(role, static_cast<uint32_t>(rank)));
          if (it == state_.end() || it->second != State::kLive) {
            absl::StrAppend(&missing, missing.empty() ? "" : ", ", RoleDir(role), " ", rank);
          }
        }
        return absl::DeadlineExceededError(absl::StrCat(
            "waiting for the roster under etcd key ", members_dir_, " at ",
            client_->url().Endpoints(), ": ", LiveCount(), " of ", total, " joined within ",
            absl::FormatDuration(options_.timeout), " (missing: ", missing, ")"));
      }
    }
    {
      base::MutexLock lock(&mu_);
      for (const auto& [node, st] : state_) {
        if (st == State::kLive) roster_.push_back({node, endpoints_[node]});
      }
      roster_epoch_ = static_cast<uint64_t>(revision);
      watch_from_ = revision + 1;
    }
    return MarkFormed(deadline);
  }

  // PREFIX/formed under this node's lease, unless another member's holds it
  // (when that one goes, the watch of the others writes it again).
  absl::Status MarkFormed(absl::Time deadline) {
    absl::StatusOr<TxnResult> t = client_->Txn(CreateIfAbsent(formed_key_, "1", lease_), deadline);
    return t.ok() ? absl::OkStatus() : Named(t.status(), formed_key_);
  }

  // Live members whose key existed when barrier `seq` began (all live ones
  // while that is not known yet).
  int LiveCountAt(uint64_t seq) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto began = barrier_created_.find(seq);
    if (began == barrier_created_.end()) return LiveCount();
    int live = 0;
    for (const auto& [node, st] : state_) {
      if (st != State::kLive) continue;
      auto since = since_.find(node);
      live += since == since_.end() || since->second < began->second ? 1 : 0;
    }
    return live;
  }

  int LiveCount() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    int live = 0;
    for (const auto& [node, st] : state_) live += st == State::kLive ? 1 : 0;
    return live;
  }

  void WatchLoop() {
    int64_t from;
    {
      base::MutexLock lock(&mu_);
      from = watch_from_;
    }
    const std::string barriers = prefix_ + "/barriers/";
    absl::Status s = client_->Watch(
        prefix_ + "/", PrefixEnd(prefix_ + "/"), from, kWatchReconnectWindow,
        absl::InfiniteFuture(), [&](int64_t, const std::vector<WatchEvent>& events) {
          base::MutexLock lock(&mu_);
          for (const WatchEvent& e : events) {
            absl::string_view key = e.kv.key;
            if (absl::ConsumePrefix(&key, barriers)) {
              uint64_t seq = 0;
              int64_t count = 0;
              if (!e.deleted && absl::SimpleAtoi(key, &seq) &&
                  absl::SimpleAtoi(e.kv.value, &count)) {
                int64_t& seen = barrier_count_[seq];
                seen = std::max(seen, count);
                barrier_created_.emplace(seq, e.kv.create_revision);
              }
              continue;
            }
            if (e.kv.key == formed_key_) {
              if (e.deleted && !announced_.load() && !left_.load()) {
                peer_events_.Post([this] {
                  if (stop_.load() || left_.load() || announced_.load()) return;
                  if (absl::Status s = MarkFormed(absl::Now() + kLeaveBound); !s.ok()) {
                    STEPMESH_LOG(kWarning, s.message());
                  }
                });
              }
              continue;
            }
            if (std::optional<MembershipEvent> event = Apply(e)) {
              peer_events_.Post(
                  [this, event = *std::move(event)] { core::Dispatch(events_, event); });
            }
          }
          return !stop_.load();
        });
    if (!s.ok() && !stop_.load()) {
      base::MutexLock lock(&mu_);
      if (fatal_.ok()) fatal_ = s;
      STEPMESH_LOG(kWarning, "etcd membership watch ended: ", s.message(),
                   "; the data plane carries on, no more membership events or barriers");
    }
  }

  void KeepAliveLoop() {
    const absl::Duration every = absl::Seconds(ttl_s_) / 3;
    absl::Time next = absl::Now() + every;
    bool warned = false;
    while (!stop_.load() && !left_.load()) {
      if (absl::Now() < next) {
        absl::SleepFor(std::min(absl::Milliseconds(20), next - absl::Now()));
        continue;
      }
      absl::StatusOr<int64_t> ttl = client_->KeepAlive(lease_, absl::Now() + every);
      next = absl::Now() + every;
      if (ttl.ok() && *ttl > 0) {
        if (warned)
          STEPMESH_LOG(kInfo, "etcd keep-alive of lease ", LeaseId(lease_), " works again");
        warned = false;
        continue;
      }
      if (ttl.ok()) {
        base::MutexLock lock(&mu_);
        if (fatal_.ok()) {
          fatal_ = absl::UnavailableError(
              absl::StrCat("this participant's etcd lease ", LeaseId(lease_), " expired"));
          STEPMESH_LOG(kError, fatal_.message(), "; the mesh counts it as lost");
        }
        return;
      }
      if (!warned && !stop_.load() && !left_.load()) {
        STEPMESH_LOG(kWarning, "etcd keep-alive of lease ", LeaseId(lease_), ": ",
                     ttl.status().message(), " (retrying; the data plane carries on)");
      }
      warned = true;
    }
  }

  enum class State : uint8_t { kLive, kLeft, kLost };

  const MeshOptions options_;
  const std::string endpoint_;
  const std::string prefix_;
  const std::string members_dir_;
  const std::string barriers_dir_;
  const std::string formed_key_;
  std::unique_ptr<EtcdClient> client_;
  const int64_t ttl_s_;
  int64_t lease_ = 0;
  bool joined_ = false;
  bool revoked_ = false;
  std::string proof_;
  core::RendezvousEvents events_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> left_{false};
  // AnnounceLeaving wrote "left": the others count this node out (a drain).
  std::atomic<bool> announced_{false};
  std::thread watcher_;
  std::thread keeper_;
  core::PeerEventThread peer_events_;

  // Orders this node's writes of its member key (a barrier's note, the
  // drain's and the leave's "left"): a later one never undoes "left".
  base::Mutex put_mu_;
  mutable base::Mutex mu_;
  std::map<NodeId, State> state_ ABSL_GUARDED_BY(mu_);
  std::map<NodeId, std::string> endpoints_ ABSL_GUARDED_BY(mu_);
  // The revision each live member's key was created at (its join), and each
  // barrier's: a barrier waits only for members that joined before it began.
  std::map<NodeId, int64_t> since_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, int64_t> barrier_created_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, int64_t> barrier_count_ ABSL_GUARDED_BY(mu_);
  uint64_t barrier_sent_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t watch_from_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status fatal_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<core::Rendezvous>> JoinEtcd(const MeshOptions& options,
                                                           const std::string& endpoint) {
  STEPMESH_ASSIGN_OR_RETURN(core::RendezvousUrl url, core::ParseRendezvousUrl(options));
  if (url.scheme != "etcd") {
    return absl::InvalidArgumentError(absl::StrCat(
        "rendezvous '", core::RedactedRendezvous(options.rendezvous), "' is not etcd://"));
  }
  STEPMESH_ASSIGN_OR_RETURN(EtcdUrl parsed, ParseEtcdUrl(url.rest));
  const std::string prefix =
      parsed.prefix.empty()
          ? absl::StrCat("/stepmesh/", options.mesh_id.empty() ? "default" : options.mesh_id)
          : parsed.prefix;
  const absl::Time deadline = absl::Now() + options.timeout;
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> client,
                            EtcdClient::Connect(parsed, deadline));
  auto rendezvous = std::make_unique<EtcdRendezvous>(options, endpoint, prefix, std::move(client));
  STEPMESH_RETURN_IF_ERROR(rendezvous->Join(deadline));
  return std::unique_ptr<core::Rendezvous>(std::move(rendezvous));
}

}  // namespace stepmesh::etcd
