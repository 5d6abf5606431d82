// EtcdRendezvous: the rank claim, the roster and the membership watch.

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/core/protocol.h"
#include "src/rendezvous/etcd/etcd_rendezvous_impl.h"
#include "stepmesh/status.h"

namespace stepmesh::etcd {

using core::kNoNode;
using core::MembershipEvent;
using core::NodeId;

absl::Status EtcdRendezvous::CheckShape(absl::Time deadline) {
  const std::string key = prefix_ + "/shape";
  const std::string shape = Shape(options_);
  absl::StatusOr<TxnResult> r = client_->Txn(CreateIfAbsent(key, shape, lease_), deadline);
  if (!r.ok()) return Named(r.status(), key);
  if (!r->succeeded && !r->range.empty() && r->range[0].value != shape) {
    return absl::FailedPreconditionError(
        absl::StrCat("etcd key ", key, " at ", client_->url().Endpoints(),
                     " holds another mesh's shape (", r->range[0].value, "); this participant has ",
                     shape, ": use another prefix (etcd://.../PREFIX) or mesh id"));
  }
  return absl::OkStatus();
}

// Whether the mesh formed already: its start shape was complete once
// (PREFIX/formed, written by each member whose roster completed).
absl::StatusOr<bool> EtcdRendezvous::Formed(absl::Time deadline) {
  absl::StatusOr<RangeResult> r = client_->Range(formed_key_, "", deadline);
  if (!r.ok()) return Named(r.status(), formed_key_);
  return !r->kvs.empty();
}

// The rank asked for; else the lowest free one: of the start shape while
// the mesh forms, of the capacity once it formed (docs/elastic.md). Each
// claim is a transaction that creates the member key only if absent, so no
// two processes ever hold one rank.
absl::Status EtcdRendezvous::TakeRank(absl::Time deadline) {
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
      return absl::ResourceExhaustedError(
          absl::StrCat("no free ", RoleDir(role), " rank: all ", capacity,
                       " of the mesh's capacity (", CapacityOption(role),
                       ") are members (etcd keys ", dir, " at ", client_->url().Endpoints(), ")"));
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
std::optional<MembershipEvent> EtcdRendezvous::Apply(const WatchEvent& e) {
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
    if (st != Standing::kLive) return std::nullopt;
    st = Standing::kLost;
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
    if (st != Standing::kLive) return std::nullopt;
    st = Standing::kLeft;
    out.kind = MembershipEvent::Kind::kLeft;
    return out;
  }
  std::string& endpoint = endpoints_[node];
  if (st == Standing::kLive && endpoint == m->endpoint) return std::nullopt;
  st = Standing::kLive;
  endpoint = m->endpoint;
  since_[node] = e.kv.create_revision;
  out.kind = MembershipEvent::Kind::kJoined;
  out.endpoint = m->endpoint;
  return out;
}

absl::Status EtcdRendezvous::Verified(const std::string& key, const Member& m) const {
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
bool EtcdRendezvous::StartShapeLive() const {
  int workers = 0, servers = 0;
  for (const auto& [node, st] : state_) {
    if (st != Standing::kLive) continue;
    (core::NodeRole(node) == Role::kWorker ? workers : servers) += 1;
  }
  return workers >= options_.num_workers && servers >= options_.num_servers;
}

// The roster: at once when the mesh formed already (a join into the
// running mesh: its members as of the read), else once the start shape is
// complete. Then this node marks the mesh formed.
absl::Status EtcdRendezvous::AwaitRoster(absl::Time deadline) {
  const bool formed = joined_running_;
  absl::StatusOr<RangeResult> all = client_->Range(members_dir_, PrefixEnd(members_dir_), deadline);
  if (!all.ok()) return Named(all.status(), members_dir_);
  {
    base::MutexLock lock(&mu_);
    for (const KeyValue& kv : all->kvs) {
      const NodeId node = NodeOfKey(kv.key, members_dir_);
      if (node == kNoNode) continue;
      STEPMESH_ASSIGN_OR_RETURN(Member m, ParseMember(kv));
      STEPMESH_RETURN_IF_ERROR(Verified(kv.key, m));
      if (m.left) continue;
      state_[node] = Standing::kLive;
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
        if (it == state_.end() || it->second != Standing::kLive) {
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
      if (st == Standing::kLive) roster_.push_back({node, endpoints_[node]});
    }
    roster_epoch_ = static_cast<uint64_t>(revision);
    watch_from_ = revision + 1;
  }
  return MarkFormed(deadline);
}

// PREFIX/formed under this node's lease, unless another member's holds it
// (when that one goes, the watch of the others writes it again).
absl::Status EtcdRendezvous::MarkFormed(absl::Time deadline) {
  absl::StatusOr<TxnResult> t = client_->Txn(CreateIfAbsent(formed_key_, "1", lease_), deadline);
  return t.ok() ? absl::OkStatus() : Named(t.status(), formed_key_);
}

void EtcdRendezvous::WatchLoop() {
  int64_t from;
  {
    base::MutexLock lock(&mu_);
    from = watch_from_;
  }
  const std::string barriers = prefix_ + "/barriers/";
  absl::Status s = client_->Watch(
      prefix_ + "/", PrefixEnd(prefix_ + "/"), from, kWatchReconnectWindow, absl::InfiniteFuture(),
      [&](int64_t, const std::vector<WatchEvent>& events) {
        base::MutexLock lock(&mu_);
        for (const WatchEvent& e : events) {
          absl::string_view key = e.kv.key;
          if (absl::ConsumePrefix(&key, barriers)) {
            uint64_t seq = 0;
            int64_t count = 0;
            if (!e.deleted && absl::SimpleAtoi(key, &seq) && absl::SimpleAtoi(e.kv.value, &count)) {
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

}  // namespace stepmesh::etcd
