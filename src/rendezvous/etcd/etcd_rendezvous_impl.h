#pragma once
// EtcdRendezvous (etcd_rendezvous.h says what it keeps in etcd): joining,
// barriers, leaving and the lease in etcd_rendezvous.cc; the rank claim, the
// roster and the membership watch in etcd_roster.cc.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/base/sync.h"
#include "src/core/peer_event_thread.h"
#include "src/core/rendezvous.h"
#include "src/rendezvous/etcd/etcd_client.h"
#include "src/rendezvous/etcd/etcd_member_keys.h"
#include "stepmesh/options.h"

namespace stepmesh::etcd {

// How long a member may be unreachable before the watch gives up on the
// cluster (the data plane carries on; no more membership events).
inline constexpr absl::Duration kWatchReconnectWindow = absl::Seconds(30);
// An orderly leave's two writes, each.
inline constexpr absl::Duration kLeaveBound = absl::Seconds(2);

// One participant's membership of the mesh through etcd.
class EtcdRendezvous final : public core::Rendezvous {
 public:
  EtcdRendezvous(const MeshOptions& options, std::string endpoint, std::string prefix,
                 std::unique_ptr<EtcdClient> client);

  ~EtcdRendezvous() override;

  // Takes a lease and a rank, then waits for the roster (JoinEtcd).
  absl::Status Join(absl::Time deadline);

  void StartMonitor(core::RendezvousEvents events) override;

  absl::Status Barrier(absl::Duration timeout) override;

  void Leave() override;

  // The drain's first step: the member key says "left" (a new revision, the
  // epoch the others count this node out at) while the lease, and so the
  // key, stays until Leave() revokes it.
  absl::Status AnnounceLeaving() override;

  absl::StatusOr<ClockSync> EstimateClock(int samples, absl::Duration) override;

 private:
  // `s` with the etcd key it is about in front.
  absl::Status Named(const absl::Status& s, const std::string& key) const;

  absl::Status CheckShape(absl::Time deadline);

  uint64_t Entered();

  // Whether the mesh formed already: its start shape was complete once
  // (PREFIX/formed, written by each member whose roster completed).
  absl::StatusOr<bool> Formed(absl::Time deadline);

  // The rank asked for; else the lowest free one: of the start shape while
  // the mesh forms, of the capacity once it formed (docs/elastic.md). Each
  // claim is a transaction that creates the member key only if absent, so no
  // two processes ever hold one rank.
  absl::Status TakeRank(absl::Time deadline);

  // Applies one member key's put or delete to the view; returns the event
  // for the others (nullopt: no change, or this node's own key).
  std::optional<core::MembershipEvent> Apply(const WatchEvent& e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Status Verified(const std::string& key, const Member& m) const;

  // Every role's live members reach the start shape.
  bool StartShapeLive() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // The roster: at once when the mesh formed already (a join into the
  // running mesh: its members as of the read), else once the start shape is
  // complete. Then this node marks the mesh formed.
  absl::Status AwaitRoster(absl::Time deadline);

  // PREFIX/formed under this node's lease, unless another member's holds it
  // (when that one goes, the watch of the others writes it again).
  absl::Status MarkFormed(absl::Time deadline);

  // Live members whose key existed when barrier `seq` began (all live ones
  // while that is not known yet).
  int LiveCountAt(uint64_t seq) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  int LiveCount() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  void WatchLoop();

  void KeepAliveLoop();

  enum class Standing : uint8_t { kLive, kLeft, kLost };
  // A member's Standing as the value of state_: a class, because GCC gives an
  // enum default visibility even under -fvisibility=hidden, and the std::map
  // code over it would be exported from libstepmesh.so (exported_symbols).
  struct State {
    State() = default;
    State(Standing s) : standing(s) {}  // NOLINT: implicit, as the enum was
    operator Standing() const { return standing; }
    Standing standing = Standing::kLive;
  };

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
  std::map<core::NodeId, State> state_ ABSL_GUARDED_BY(mu_);
  std::map<core::NodeId, std::string> endpoints_ ABSL_GUARDED_BY(mu_);
  // The revision each live member's key was created at (its join), and each
  // barrier's: a barrier waits only for members that joined before it began.
  std::map<core::NodeId, int64_t> since_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, int64_t> barrier_created_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, int64_t> barrier_count_ ABSL_GUARDED_BY(mu_);
  uint64_t barrier_sent_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t watch_from_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status fatal_ ABSL_GUARDED_BY(mu_);
};

}  // namespace stepmesh::etcd
