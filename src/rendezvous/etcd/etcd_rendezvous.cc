#include "src/rendezvous/etcd/etcd_rendezvous.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/base/thread_util.h"
#include "src/core/auth.h"
#include "src/rendezvous/etcd/etcd_rendezvous_impl.h"
#include "stepmesh/status.h"

namespace stepmesh::etcd {

EtcdRendezvous::EtcdRendezvous(const MeshOptions& options, std::string endpoint, std::string prefix,
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

EtcdRendezvous::~EtcdRendezvous() {
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

absl::Status EtcdRendezvous::Join(absl::Time deadline) {
  STEPMESH_ASSIGN_OR_RETURN(lease_, client_->GrantLease(ttl_s_, deadline));
  STEPMESH_RETURN_IF_ERROR(CheckShape(deadline));
  STEPMESH_RETURN_IF_ERROR(TakeRank(deadline));
  return AwaitRoster(deadline);
}

void EtcdRendezvous::StartMonitor(core::RendezvousEvents events) {
  events_ = std::move(events);
  peer_events_.Start();
  keeper_ = base::StartNamedThread("sm-etcd-lease", {}, [this] { KeepAliveLoop(); });
  watcher_ = base::StartNamedThread("sm-etcd-watch", {}, [this] { WatchLoop(); });
}

absl::Status EtcdRendezvous::Barrier(absl::Duration timeout) {
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
    return absl::DeadlineExceededError(absl::StrCat(
        "barrier ", seq, " (etcd key ", key, "): ", it == barrier_count_.end() ? 0 : it->second,
        " of ", LiveCountAt(seq), " live members entered within ", absl::FormatDuration(timeout)));
  }
  if (!fatal_.ok()) return fatal_;
  if (stop_.load()) return absl::CancelledError("the participant is shutting down");
  return absl::OkStatus();
}

void EtcdRendezvous::Leave() {
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
absl::Status EtcdRendezvous::AnnounceLeaving() {
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
      client_->Put(key, MemberValue(options_, endpoint_, proof_, /*left=*/true, Entered()), lease_,
                   absl::Now() + kLeaveBound);
  if (!put.ok()) {
    announced_.store(false);
    return Named(put, key);
  }
  return absl::OkStatus();
}

absl::StatusOr<ClockSync> EtcdRendezvous::EstimateClock(int samples, absl::Duration) {
  ClockSync best = core::WallClockAgainstMonotonic();
  for (int i = 1; i < samples; ++i) {
    const ClockSync s = core::WallClockAgainstMonotonic();
    if (s.round_trip_ns < best.round_trip_ns) best = s;
  }
  return best;
}

absl::Status EtcdRendezvous::Named(const absl::Status& s, const std::string& key) const {
  return absl::Status(s.code(), absl::StrCat("etcd key ", key, ": ", s.message()));
}

uint64_t EtcdRendezvous::Entered() {
  base::MutexLock lock(&mu_);
  return barrier_sent_;
}

// Live members whose key existed when barrier `seq` began (all live ones
// while that is not known yet).
int EtcdRendezvous::LiveCountAt(uint64_t seq) const {
  auto began = barrier_created_.find(seq);
  if (began == barrier_created_.end()) return LiveCount();
  int live = 0;
  for (const auto& [node, st] : state_) {
    if (st != Standing::kLive) continue;
    auto since = since_.find(node);
    live += since == since_.end() || since->second < began->second ? 1 : 0;
  }
  return live;
}

int EtcdRendezvous::LiveCount() const {
  int live = 0;
  for (const auto& [node, st] : state_) live += st == Standing::kLive ? 1 : 0;
  return live;
}

void EtcdRendezvous::KeepAliveLoop() {
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
      if (warned) STEPMESH_LOG(kInfo, "etcd keep-alive of lease ", LeaseId(lease_), " works again");
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
