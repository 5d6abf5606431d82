#pragma once
// What every member of a mesh is, attention worker or FFN server: its rank, its
// backend, its counters and traces, the mesh-wide barrier and leaving. Roles
// add their data path (stepmesh/worker.h, stepmesh/server.h) and declare none
// of these again.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "stepmesh/backend.h"
#include "stepmesh/export.h"
#include "stepmesh/stats.h"
#include "stepmesh/trace.h"

namespace stepmesh {

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

  // Waits (options.timeout) for every worker and server to reach the same barrier.
  virtual absl::Status Barrier() = 0;
  // Leaves the mesh in order; what is pending fails with CANCELLED. Also run
  // by the destructor; idempotent.
  virtual absl::Status Shutdown() = 0;
};

}  // namespace stepmesh
