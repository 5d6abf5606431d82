#include "src/core/store_rendezvous.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/base/sync.h"
#include "src/base/thread_util.h"
#include "src/core/auth.h"
#include "src/core/peer_event_thread.h"
#include "src/core/protocol.h"
#include "stepmesh/status.h"

namespace stepmesh::core {
namespace {

std::string Shape(const MeshOptions& o) {
  return absl::StrCat("workers=", o.num_workers, " servers=", o.num_servers, " mesh=", o.mesh_id);
}

std::string NodeName(NodeId node) {
  return absl::StrCat(NodeRole(node) == Role::kWorker ? "worker/" : "server/", NodeRank(node));
}

// The member value: endpoint, a newline, the proof (hex; empty without a token).
std::string Proof(const std::string& token, const std::string& key, const std::string& endpoint,
                  const std::string& shape) {
  if (token.empty()) return "";
  return absl::BytesToHexString(AsText(HmacSha256(
      token, absl::StrCat("stepmesh store member\n", key, "\n", endpoint, "\n", shape))));
}

class StoreRendezvous final : public Rendezvous {
 public:
  StoreRendezvous(std::shared_ptr<RendezvousStore> store, const MeshOptions& options,
                  std::string endpoint)
      : store_(std::move(store)),
        options_(options),
        endpoint_(std::move(endpoint)),
        prefix_(absl::StrCat("stepmesh/", options.mesh_id.empty() ? "default" : options.mesh_id,
                             "/")) {}

  ~StoreRendezvous() override {
    Leave();
    stop_.store(true);
    { base::MutexLock lock(&mu_); }
    if (monitor_.joinable()) monitor_.join();
    peer_events_.Stop();
  }

  absl::Status Join(absl::Time deadline) {
    STEPMESH_RETURN_IF_ERROR(CheckShape(deadline));
    STEPMESH_RETURN_IF_ERROR(TakeRank());
    const std::string key = Key("member/", self_);
    STEPMESH_RETURN_IF_ERROR(Named(
        store_->Set(key, absl::StrCat(endpoint_, "\n",
                                      Proof(options_.auth_token, key, endpoint_, Shape(options_)))),
        key));
    STEPMESH_RETURN_IF_ERROR(Named(store_->Add(Key("present/", self_), 1).status(), key));
    STEPMESH_RETURN_IF_ERROR(Named(store_->Add(Key("beat/", self_), 1).status(), key));
    joined_ = true;
    return AwaitRoster(deadline);
  }

  void StartMonitor(RendezvousEvents events) override {
    events_ = std::move(events);
    peer_events_.Start();
    monitor_ = base::StartNamedThread("sm-store-beat", {}, [this] { MonitorLoop(); });
  }

  absl::Status Barrier(absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    uint64_t seq;
    {
      base::MutexLock lock(&mu_);
      seq = ++barrier_sent_;
    }
    const std::string key = absl::StrCat(prefix_, "barrier/", seq);
    absl::StatusOr<int64_t> count = store_->Add(key, 1);
    absl::Duration pause = absl::Milliseconds(1);
    for (;;) {
      if (!count.ok()) return Named(count.status(), key);
      int live;
      {
        base::MutexLock lock(&mu_);
        live = LiveCount();
      }
      if (*count >= live) return absl::OkStatus();
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("barrier ", seq, " (store key ", key, "): ", *count, " of ", live,
                         " live members entered within ", absl::FormatDuration(timeout)));
      }
      if (stop_.load()) return absl::CancelledError("the participant is shutting down");
      absl::SleepFor(pause);
      pause = std::min(pause * 2, absl::Milliseconds(20));
      count = store_->Add(key, 0);
    }
  }

  void Leave() override {
    if (!joined_ || left_.exchange(true)) return;
    (void)store_->Add(Key("left/", self_), 1);  // a store gone already: nobody to tell
  }

  absl::StatusOr<ClockSync> EstimateClock(int samples, absl::Duration) override {
    ClockSync best = WallClockAgainstMonotonic();
    for (int i = 1; i < samples; ++i) {
      const ClockSync s = WallClockAgainstMonotonic();
      if (s.round_trip_ns < best.round_trip_ns) best = s;
    }
    return best;
  }

 private:
  std::string Key(absl::string_view what, NodeId node) const {
    return absl::StrCat(prefix_, what, NodeName(node));
  }

  static absl::Status Named(const absl::Status& s, const std::string& key) {
    if (s.ok()) return s;
    return absl::Status(s.code(), absl::StrCat("store key ", key, ": ", s.message()));
  }

  absl::Status CheckShape(absl::Time deadline) {
    const std::string key = prefix_ + "shape";
    const std::string shape = Shape(options_);
    absl::StatusOr<int64_t> claim = store_->Add(key + "/claim", 1);
    if (!claim.ok()) return Named(claim.status(), key + "/claim");
    if (*claim == 1) return Named(store_->Set(key, shape), key);
    STEPMESH_RETURN_IF_ERROR(
        Named(store_->Wait({key}, std::max(deadline - absl::Now(), absl::Milliseconds(1))), key));
    absl::StatusOr<std::string> theirs = store_->Get(key);
    if (!theirs.ok()) return Named(theirs.status(), key);
    if (*theirs != shape) {
      return absl::FailedPreconditionError(
          absl::StrCat("store key ", key, " holds another mesh's shape (", *theirs,
                       "); this participant has ", shape, ": use another mesh_id"));
    }
    return absl::OkStatus();
  }

  absl::Status TakeRank() {
    const int n = options_.role == Role::kWorker ? options_.num_workers : options_.num_servers;
    const std::string dir = options_.role == Role::kWorker ? "worker/" : "server/";
    auto claim = [&](int r) -> absl::StatusOr<bool> {
      const std::string key = absl::StrCat(prefix_, "rank/", dir, r);
      absl::StatusOr<int64_t> v = store_->Add(key, 1);
      if (!v.ok()) return Named(v.status(), key);
      return *v == 1;
    };
    if (options_.rank >= 0) {
      STEPMESH_ASSIGN_OR_RETURN(bool mine, claim(options_.rank));
      if (!mine) {
        return absl::AlreadyExistsError(absl::StrCat(
            "store key ", prefix_, "rank/", dir, options_.rank,
            " is already claimed: another participant of this rank, or a previous run's keys "
            "in a long-lived store (use another mesh_id)"));
      }
      rank_ = options_.rank;
    } else {
      for (int tries = 0; rank_ < 0; ++tries) {
        const std::string key = absl::StrCat(prefix_, "next/", dir);
        absl::StatusOr<int64_t> next = store_->Add(key, 1);
        if (!next.ok()) return Named(next.status(), key);
        const int r = static_cast<int>(*next - 1);
        if (r >= n || tries > n) {
          return absl::AlreadyExistsError(absl::StrCat("store key ", key, ": every ", dir,
                                                       " rank of ", n, " is already taken"));
        }
        STEPMESH_ASSIGN_OR_RETURN(bool mine, claim(r));
        if (mine) rank_ = r;
      }
    }
    self_ = MakeNodeId(options_.role, static_cast<uint32_t>(rank_));
    return absl::OkStatus();
  }

  absl::Status AwaitRoster(absl::Time deadline) {
    std::vector<NodeId> all;
    std::vector<std::string> keys;
    for (int w = 0; w < options_.num_workers; ++w) all.push_back(WorkerId(w));
    for (int s = 0; s < options_.num_servers; ++s) all.push_back(ServerId(s));
    for (NodeId node : all) keys.push_back(Key("member/", node));
    absl::Status waited =
        store_->Wait(keys, std::max(deadline - absl::Now(), absl::Milliseconds(1)));
    if (!waited.ok()) {
      std::string missing;
      for (NodeId node : all) {
        absl::StatusOr<int64_t> present = store_->Add(Key("present/", node), 0);
        if (present.ok() && *present == 0)
          absl::StrAppend(&missing, missing.empty() ? "" : ", ", NodeName(node));
      }
      return absl::Status(
          waited.code(),
          absl::StrCat("waiting for the roster under store keys ", prefix_, "member/: missing ",
                       missing.empty() ? "?" : missing, " (", waited.message(), ")"));
    }
    base::MutexLock lock(&mu_);
    for (size_t i = 0; i < all.size(); ++i) {
      absl::StatusOr<std::string> value = store_->Get(keys[i]);
      if (!value.ok()) return Named(value.status(), keys[i]);
      std::vector<std::string> parts = absl::StrSplit(*value, absl::MaxSplits('\n', 1));
      parts.resize(2);
      if (!options_.auth_token.empty() &&
          parts[1] != Proof(options_.auth_token, keys[i], parts[0], Shape(options_))) {
        return absl::PermissionDeniedError(
            absl::StrCat("store key ", keys[i],
                         " was not written with this mesh's auth token (STEPMESH_AUTH_TOKEN)"));
      }
      roster_.push_back({all[i], parts[0]});
      peers_[all[i]] = Peer{};
    }
    roster_epoch_ = 0;
    return absl::OkStatus();
  }

  int LiveCount() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    int live = 0;
    for (const auto& [node, p] : peers_) live += p.state == State::kLive ? 1 : 0;
    return live;
  }

  void MonitorLoop() {
    const std::string beat = Key("beat/", self_);
    absl::Time next = absl::Now();
    while (!stop_.load()) {
      if (absl::Now() < next) {
        absl::SleepFor(std::min(absl::Milliseconds(20), next - absl::Now()));
        continue;
      }
      next = absl::Now() + options_.heartbeat_interval;
      if (left_.load()) continue;
      if (absl::StatusOr<int64_t> b = store_->Add(beat, 1); !b.ok()) {
        STEPMESH_LOG(kWarning, "store heartbeat (key ", beat, "): ", b.status().message());
        continue;
      }
      std::vector<NodeId> live;
      {
        base::MutexLock lock(&mu_);
        for (const auto& [node, p] : peers_) {
          if (node != self_ && p.state == State::kLive) live.push_back(node);
        }
      }
      for (NodeId node : live) {
        absl::StatusOr<int64_t> left = store_->Add(Key("left/", node), 0);
        absl::StatusOr<int64_t> beats = store_->Add(Key("beat/", node), 0);
        if (!left.ok() || !beats.ok()) continue;  // the store is unwell: no verdict
        const absl::Time now = absl::Now();
        base::MutexLock lock(&mu_);
        Peer& p = peers_[node];
        MembershipEvent e;
        e.node = node;
        if (*left > 0) {
          p.state = State::kLeft;
          e.kind = MembershipEvent::Kind::kLeft;
        } else if (*beats != p.beats) {
          p.beats = *beats;
          p.changed = now;
          continue;
        } else if (now - p.changed > options_.timeout) {
          p.state = State::kLost;
          e.kind = MembershipEvent::Kind::kLost;
          e.why = absl::UnavailableError(absl::StrCat(
              "store key ", Key("beat/", node), " unchanged for ",
              absl::FormatDuration(absl::Trunc(now - p.changed, absl::Milliseconds(1))),
              " (no heartbeat)"));
        } else {
          continue;
        }
        e.epoch = ++epoch_;
        peer_events_.Post([this, e = std::move(e)] { Dispatch(events_, e); });
      }
    }
  }

  enum class State : uint8_t { kLive, kLeft, kLost };
  struct Peer {
    State state = State::kLive;
    int64_t beats = -1;
    absl::Time changed = absl::Now();
  };

  std::shared_ptr<RendezvousStore> store_;
  const MeshOptions options_;
  const std::string endpoint_;
  const std::string prefix_;
  bool joined_ = false;
  RendezvousEvents events_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> left_{false};
  std::thread monitor_;
  PeerEventThread peer_events_;

  base::Mutex mu_;
  std::map<NodeId, Peer> peers_ ABSL_GUARDED_BY(mu_);
  uint64_t barrier_sent_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Rendezvous>> JoinStore(std::shared_ptr<RendezvousStore> store,
                                                      const MeshOptions& options,
                                                      const std::string& endpoint) {
  if (store == nullptr) return absl::InvalidArgumentError("JoinStore: no store");
  STEPMESH_RETURN_IF_ERROR(RequireFixedShape(options, "the framework store"));
  auto rendezvous = std::make_unique<StoreRendezvous>(std::move(store), options, endpoint);
  STEPMESH_RETURN_IF_ERROR(rendezvous->Join(absl::Now() + options.timeout));
  return std::unique_ptr<Rendezvous>(std::move(rendezvous));
}

}  // namespace stepmesh::core
