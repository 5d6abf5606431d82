#pragma once
// What a worker's and a server's trace records hold (the words of a
// TraceRing record), and their Chrome trace-event JSON (docs/tracing.md).
//
// Every stamp is recorded on the host's own CLOCK_MONOTONIC; the export adds
// the participant's offset to the scheduler's clock (ClockSync), so the files
// of several processes share one time axis and MergeChromeTraces
// (stepmesh/trace.h) only concatenates them.

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "src/core/membership_view.h"
#include "src/core/trace_ring.h"
#include "stepmesh/options.h"
#include "stepmesh/trace.h"

namespace stepmesh::core {

// A worker's record: one completed request, its stamps on the worker's clock.
struct WorkerTraceWords {
  static constexpr size_t kRequestId = 0;  // RequestId(index, generation), as on the wire
  static constexpr size_t kEnqueue = 1;    // PushPull called
  static constexpr size_t kComplete = 2;   // the last server settled
  // Then per server s, at kFirstServer + kPerServer * s:
  static constexpr size_t kFirstServer = 3;
  static constexpr size_t kPerServer = 3;
  static constexpr size_t kPost = 0;          // the push to s posted (0: never sent)
  static constexpr size_t kReplyArrival = 1;  // s's reply landed (0: none)
  static constexpr size_t kAddressed = 2;     // 1 when the request addressed s
  static constexpr size_t Words(int num_servers) {
    return kFirstServer + kPerServer * static_cast<size_t>(num_servers);
  }
};

// A server's record: one worker's request answered, stamps on the server's clock.
struct ServerTraceWords {
  static constexpr size_t kRequestId = 0;  // the worker's request id
  static constexpr size_t kWorker = 1;
  static constexpr size_t kArrival = 2;  // the request's last push byte arrived
  static constexpr size_t kHandler = 3;  // its batch handed to GetBatch
  static constexpr size_t kReply = 4;    // the reply (or error frame) posted
  static constexpr size_t kCode = 5;     // absl::StatusCode sent: 0 for a reply
  static constexpr size_t kWords = 6;
};

// The Chrome trace-event JSON of one participant's records: one process
// ("worker 0", "server 1"), a thread per stage (more lanes when requests
// overlap), timestamps in the scheduler's clock (`clock`), and the ring's
// counts, the clock's uncertainty and the membership epoch at the export
// (docs/elastic.md) under "otherData"; each of `epochs` (the membership
// changes this participant applied) an instant event "membership epoch E"
// at the time it applied it, its counts in "args".
std::string FormatChromeTrace(Role role, int rank, int num_peers,
                              const TraceRing::Snapshot& records, const ClockSync& clock,
                              uint64_t membership_epoch = 0,
                              absl::Span<const EpochMark> epochs = {});

// Writes `text` to `path` (replacing it); errors name the path.
absl::Status WriteTextFile(const std::string& path, absl::string_view text);

}  // namespace stepmesh::core
