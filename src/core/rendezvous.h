#pragma once
// The rendezvous seam: how a participant meets the rest of its mesh. One
// interface, several implementations chosen by MeshOptions::rendezvous
// (STEPMESH_RENDEZVOUS, docs/deployment.md):
//   scheduler://H:P  our scheduler process (src/core/scheduler_rendezvous.h), the default
//   etcd://H:P,...   an etcd cluster (src/rendezvous/etcd/), picked by the composition root
//
// What every implementation provides, in order of use:
//   join     a rank (the one asked for, or one assigned) and this node's id;
//   roster   every member's endpoint, complete when Join returns;
//   events   membership changes after the roster (a peer lost, left, or a new
//            process under an old rank), each numbered by a membership epoch;
//   barriers all live members, each barrier once;
//   liveness the rendezvous notices a dead participant and tells the others
//            (scheduler: heartbeats; etcd: lease expiry);
//   leave    an orderly goodbye: peers see "left", not "lost".
//
// Membership epochs (elastic membership, docs/elastic.md): every change a
// participant is told of carries an epoch that strictly increases along the
// events one participant sees, and every participant gives one change the
// same number. The scheduler stamps them: the roster the mesh formed with is
// epoch 0, each join, leave (or start of a drain) and loss after it the
// next; a participant joining the running mesh gets the roster of the epoch
// it joined at. With etcd the epoch is the store revision of the change, and
// the roster's the revision it was read at (so epochs there start high and
// skip numbers, but every participant gives a change the same one). A join
// into a running mesh is a kJoined event of a node the roster did not hold.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/core/control_message.h"
#include "stepmesh/options.h"
#include "stepmesh/trace.h"

namespace stepmesh::core {

struct MembershipEvent {
  enum class Kind : uint8_t {
    kJoined,  // a (new) process holds `node` at `endpoint`
    kLeft,    // `node` left in order
    kLost,    // `node` is gone without a goodbye (`why` says how it was noticed)
  };
  Kind kind = Kind::kJoined;
  NodeId node = kNoNode;
  std::string endpoint;  // kJoined
  absl::Status why;      // kLost
  uint64_t epoch = 0;
};

// What the participant does about the events (run in order, one at a time,
// on a thread of the rendezvous that is not its liveness thread: a handler
// may connect, which takes a round trip or a timeout).
struct RendezvousEvents {
  std::function<void(NodeId, absl::Status)> on_peer_lost;
  std::function<void(NodeId, const std::string& endpoint)> on_peer_joined;
  // `node` left in order (the rendezvous saw its leave).
  std::function<void(NodeId)> on_peer_left;
  // Every event above, with its epoch, after its own handler (optional): a
  // participant publishes the new membership once it acted on it.
  std::function<void(const MembershipEvent&)> on_membership;
};

// Calls the handler(s) `event` is for.
void Dispatch(const RendezvousEvents& events, const MembershipEvent& event);

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;

  int rank() const { return rank_; }
  NodeId self() const { return self_; }
  // Every member, this one included, as of epoch `roster_epoch()`.
  const std::vector<RosterEntry>& roster() const { return roster_; }
  uint64_t roster_epoch() const { return roster_epoch_; }

  // Starts the threads that watch liveness and membership; events run on
  // their own thread, in order.
  virtual void StartMonitor(RendezvousEvents events) = 0;
  // Returns once every live member entered the same barrier (`timeout`).
  virtual absl::Status Barrier(absl::Duration timeout) = 0;
  // Orderly leave: no member reports this node as lost. Idempotent.
  virtual void Leave() = 0;
  // The first step of a drain (Participant::Leave): the others count this
  // node out now ("left", a new epoch) while it stays connected to answer
  // what it received; Leave() follows once it did. FAILED_PRECONDITION where
  // the rendezvous has no such step (the framework store, docs/elastic.md).
  virtual absl::Status AnnounceLeaving() {
    return absl::FailedPreconditionError(
        "draining before leaving needs the scheduler rendezvous (this mesh meets through "
        "another; use Shutdown)");
  }
  // Whether this node joined a mesh that was already running (its roster is
  // not the one the mesh formed with).
  bool joined_running() const { return joined_running_; }
  // The mesh's reference clock against this host's monotonic clock (traces
  // of several processes are merged on it): `samples` exchanges, each
  // bounded by `timeout`, the shortest round trip kept.
  virtual absl::StatusOr<ClockSync> EstimateClock(int samples, absl::Duration timeout) = 0;

 protected:
  int rank_ = -1;
  NodeId self_ = kNoNode;
  std::vector<RosterEntry> roster_;
  uint64_t roster_epoch_ = 0;
  bool joined_running_ = false;
};

// Joins the mesh as `options` say, advertising `endpoint` (the transport's),
// and returns once the roster is complete (options.timeout).
using RendezvousFactory = std::function<absl::StatusOr<std::unique_ptr<Rendezvous>>(
    const MeshOptions& options, const std::string& endpoint)>;

// What STEPMESH_RENDEZVOUS names, split: "scheduler" or "etcd", and the rest
// after "://". An empty option is the scheduler at options.scheduler.
struct RendezvousUrl {
  std::string scheme;
  std::string rest;
};
absl::StatusOr<RendezvousUrl> ParseRendezvousUrl(const MeshOptions& options);

// `url` with any USER:PASSWORD@ shown as USER:***@, for messages.
std::string RedactedRendezvous(const std::string& url);

// Our scheduler (src/core/scheduler_rendezvous.h); INVALID_ARGUMENT for any
// other scheme: those need a RendezvousFactory from the composition root.
absl::StatusOr<std::unique_ptr<Rendezvous>> JoinScheduler(const MeshOptions& options,
                                                          const std::string& endpoint);

// INVALID_ARGUMENT naming the options when `options` give a capacity above
// the start shape: `rendezvous` ("the framework store") cannot add members
// to a running mesh (docs/elastic.md); the scheduler and etcd do.
absl::Status RequireFixedShape(const MeshOptions& options, absl::string_view rendezvous);

// This host's wall clock (CLOCK_REALTIME, NTP-disciplined across hosts)
// against its monotonic clock: the reference clock of rendezvous without a
// process to ask (etcd, a framework store). Round trip: the read's span.
ClockSync WallClockAgainstMonotonic();

}  // namespace stepmesh::core
