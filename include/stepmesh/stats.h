#pragma once
// Counters and latency histograms of one mesh participant, always on.
//
// A worker or server keeps them in relaxed atomics sized at creation (no
// allocation and no lock per frame); AFTensorWorker::Stats() and
// AFTensorServer::Stats() copy them out. PrometheusText() formats a snapshot
// in the Prometheus text exposition format (docs/metrics.md lists every name).

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "stepmesh/options.h"

namespace stepmesh {

// absl::StatusCode values 0 (OK) .. 16 (UNAUTHENTICATED).
inline constexpr int kNumStatusCodes = 17;

// Stages of a request, from the trace stamps (stepmesh/trace.h). Each is a
// difference of two stamps taken on one host, so no clock synchronisation is
// needed. The push and the reply cross hosts: their sum (the wire time of the
// round trip) is kNetwork; splitting it needs the hosts' clock offset.
enum class Stage : uint8_t {
  kSubmit,    // worker: PushPull called -> send thread posted the push
  kNetwork,   // worker: posted -> reply landed, less the server's residency
  kDispatch,  // server: last push byte arrived -> batch handed to GetBatch
  kRespond,   // server: batch handed out -> reply posted (the application's FFN)
  kWake,      // worker: request complete -> Wait() returned to the application
  kTotal,     // worker: PushPull called -> request complete
};
inline constexpr int kNumStages = 6;
STEPMESH_EXPORT absl::string_view StageName(Stage stage);

// Fixed log2 buckets: bucket i < 38 counts samples of at most 2^i ns (bucket
// 0: 0 and 1 ns); the last, 38, everything above 2^37 ns (about 137 s).
struct LatencyHistogram {
  static constexpr int kBuckets = 39;
  static constexpr uint64_t UpperBoundNs(int bucket) { return uint64_t{1} << bucket; }
  std::array<uint64_t, kBuckets> buckets{};  // not cumulative
  uint64_t count = 0;
  uint64_t sum_ns = 0;
};

// What one node exchanged with one peer of the other role. Bytes are payload
// bytes (tensor data and error texts), frames every data frame.
struct PeerStats {
  Role role = Role::kServer;  // the peer's
  int rank = 0;
  uint64_t bytes_sent = 0;
  uint64_t frames_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t frames_received = 0;
  // Worker: the peer's part of each request, by outcome (index: absl::StatusCode;
  // [0] succeeded). Server: error frames sent to the peer, by code.
  std::array<uint64_t, kNumStatusCodes> outcomes{};
  uint64_t losses = 0;   // the peer was counted out (lost or left)
  uint64_t rejoins = 0;  // its restarted process reconnected
};

struct MeshStats {
  Role role = Role::kWorker;
  int rank = -1;
  std::vector<PeerStats> peers;  // every peer of the other role, by rank
  // Worker: requests collected by Wait(), by result (index: absl::StatusCode).
  // Server: batches answered by Respond(), [0] only.
  std::array<uint64_t, kNumStatusCodes> requests{};
  uint64_t sends_queued = 0;  // items on the send queue now
  // The membership epoch this participant last heard of (Membership::epoch),
  // and how many members each role has at it.
  uint64_t membership_epoch = 0;
  int member_workers = 0;
  int member_servers = 0;
  uint64_t in_flight = 0;  // worker: requests not yet collected; server: batches ready, not taken
  std::array<LatencyHistogram, kNumStages> stages{};
  const LatencyHistogram& stage(Stage s) const { return stages[static_cast<int>(s)]; }
};

// The Prometheus text exposition (format 0.0.4) of `stats`: HELP and TYPE
// lines, counters labelled by role, rank and peer, one histogram per stage in
// seconds (_bucket{le=...}, _sum, _count).
STEPMESH_EXPORT std::string PrometheusText(const MeshStats& stats);

}  // namespace stepmesh
