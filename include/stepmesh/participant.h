#pragma once
// What every member of a mesh is, attention worker or FFN server: its rank, its
// backend, its counters and traces, the mesh-wide barrier and leaving. Roles
// add their data path (stepmesh/worker.h, stepmesh/server.h) and declare none
// of these again.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "stepmesh/backend.h"
#include "stepmesh/export.h"
#include "stepmesh/stats.h"
#include "stepmesh/trace.h"

namespace stepmesh {

// Who is in the mesh at one membership epoch (docs/elastic.md). The start
// shape is epoch 0 with the scheduler rendezvous; every join, orderly leave
// and loss after it is the next epoch, numbered by the rendezvous, so every
// participant gives one change the same number.
struct Membership {
  uint64_t epoch = 0;
  std::vector<int> workers;  // attention ranks, ascending, each in [0, max_workers)
  std::vector<int> servers;  // FFN ranks, ascending, each in [0, max_servers)
};

class STEPMESH_EXPORT Participant {
 public:
  virtual ~Participant() = default;

  // This participant's rank within its role (workers and servers count apart).
  virtual int rank() const = 0;
  virtual Backend& backend() = 0;

  // A copy of the counters and stage histograms (always kept; the stage
  // histograms need options.trace.enabled). `in_flight` is the role's own
  // measure: a worker's requests pending, a server's batches handed out and
  // not answered. Any thread; allocates.
  virtual MeshStats Stats() = 0;

  // This host's clock against the scheduler's (stepmesh/trace.h): 8 exchanges
  // over the control connection, the shortest kept; each bounded by
  // options.timeout. For lining up stamps of several hosts.
  virtual absl::StatusOr<ClockSync> SchedulerClock() = 0;

  // The recorded requests (options.trace.events, the newest that many) as
  // Chrome trace-event JSON: this participant as one process, a thread per
  // stage, timestamps on the scheduler's clock (SchedulerClock() is run for
  // it), so MergeChromeTraces lines up the exports of several processes
  // (docs/tracing.md). FAILED_PRECONDITION when recording is off. Any thread;
  // allocates; requests completing meanwhile may be left out (counted as
  // dropped in the export).
  virtual absl::StatusOr<std::string> ChromeTraceJson() = 0;
  // ChromeTraceJson() written to `path`.
  virtual absl::Status WriteChromeTrace(const std::string& path) = 0;

  // Waits (options.timeout) for every worker and server to reach the same
  // barrier: the members of the current epoch (a participant that joins
  // takes part from its join on; one leaving, from its Leave on, does not).
  virtual absl::Status Barrier() = 0;
  // Leaves the mesh in order; what is pending fails with CANCELLED. Also run
  // by the destructor; idempotent.
  virtual absl::Status Shutdown() = 0;

  // --- elastic membership (docs/elastic.md) ---
  // The membership as this participant last heard it: the roster it joined
  // with, then every change the rendezvous announced. Any thread; allocates.
  virtual Membership CurrentMembership() const = 0;
  // The poll for changes: returns the membership once its epoch is past
  // `after_epoch` (at once when it already is; several changes heard
  // meanwhile come as one answer, the newest). DEADLINE_EXCEEDED after
  // `timeout`; CANCELLED once this participant shut down or left. Any thread,
  // any number of waiters at once; the data path never waits for them.
  virtual absl::StatusOr<Membership> WaitMembershipChange(uint64_t after_epoch,
                                                          absl::Duration timeout) = 0;
  // Drains, then leaves in order: the others see "left" (not "lost"), as a
  // new epoch. A worker stops accepting requests (Post/PushPull fail
  // FAILED_PRECONDITION naming it), waits until every request it posted is
  // complete, then leaves. A server is announced as left at once, so workers
  // address it no more (their new pushes to it fail UNAVAILABLE naming it); it
  // answers every request that arrived -- the application keeps calling
  // GetBatch/Respond, on another thread than Leave's, until GetBatch returns
  // UNAVAILABLE "drained" -- then leaves. Past `timeout` it leaves anyway
  // (what is pending then fails CANCELLED, as with Shutdown) and returns
  // DEADLINE_EXCEEDED saying what was left. Afterwards the participant is
  // shut down. Once; a second call (or one after Shutdown) returns OK.
  virtual absl::Status Leave(absl::Duration timeout) = 0;
};

}  // namespace stepmesh
