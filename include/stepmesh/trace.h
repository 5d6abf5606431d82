#pragma once
// Per-request timing, stamped on the path and carried in frames so that the
// differences between stamps of one host need no clock synchronisation.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "stepmesh/export.h"
#include "stepmesh/options.h"

namespace stepmesh {

// Nanoseconds of CLOCK_MONOTONIC on the host that took the stamp (0: not taken).
struct TraceStamps {
  uint64_t enqueue_ns = 0;         // worker: PushPull called              (worker clock)
  uint64_t post_ns = 0;            // worker: send thread posted the push  (worker clock)
  uint64_t server_arrival_ns = 0;  // server: last push byte arrived      (server clock)
  uint64_t server_handler_ns = 0;  // server: batch handed to GetBatch    (server clock)
  uint64_t server_reply_ns = 0;    // server: reply posted                (server clock)
  uint64_t reply_arrival_ns = 0;   // worker: reply landed                (worker clock)
  // server: Respond() called (server clock; between server_handler_ns and
  // server_reply_ns; travels as its distance to server_reply_ns, capped at 4.29 s)
  uint64_t server_respond_ns = 0;
};

struct TraceRecord {
  struct PerServer {
    int server = -1;
    TraceStamps stamps;
  };
  std::vector<PerServer> servers;
  uint64_t complete_ns = 0;  // worker: the request completed
};

STEPMESH_EXPORT uint64_t MonotonicNowNs();

// This host's clock against the scheduler's, for lining up stamps of several
// hosts: scheduler time = local MonotonicNowNs() + offset_ns, within
// round_trip_ns / 2 (the best of a few exchanges over the control connection,
// NTP-style: offset = scheduler stamp - midpoint of the local send and receive).
struct ClockSync {
  int64_t offset_ns = 0;
  uint64_t round_trip_ns = 0;
};

// Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev; docs/tracing.md):
// AFTensorWorker::ChromeTraceJson() and AFTensorServer::ChromeTraceJson()
// export one participant each, already on the scheduler's clock; this merges
// several such exports (or merged files) into one, whose "traceEvents" hold
// every input's events and "otherData.participants" every input's clock
// offset, uncertainty and ring counts. INVALID_ARGUMENT names the input (by
// index) that is not a trace object, or a participant found in two inputs.
// The Chrome process id ("pid") a participant's export uses: workers 1 + rank,
// servers 1000001 + rank; the exports' own threads ("tid") are below 10000,
// so an application may add events of its own to a participant's process
// with tids from 10000 on and merge them in.
STEPMESH_EXPORT int ChromeTraceProcessId(Role role, int rank);

STEPMESH_EXPORT absl::StatusOr<std::string> MergeChromeTraces(absl::Span<const std::string> traces);

}  // namespace stepmesh
