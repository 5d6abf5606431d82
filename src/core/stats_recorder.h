#pragma once
// The live counters behind stepmesh::MeshStats: relaxed atomics, sized once at
// creation, so recording is a few uncontended atomic adds (no allocation, no
// lock) on whichever thread the event happens; Snapshot() copies them out.
// A snapshot taken while traffic flows is not a single instant: each counter
// is exact, two counters may be a frame apart.

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "stepmesh/stats.h"

namespace stepmesh::core {

// -DSTEPMESH_STATS=OFF (CMake) compiles the recording out, for measuring what
// it costs (docs/metrics.md, "Overhead"); Stats() then reports zeros. Only for
// that A/B build: the tests expect it on.
#ifdef STEPMESH_STATS_OFF
inline constexpr bool kStatsOn = false;
#else
inline constexpr bool kStatsOn = true;
#endif

class LiveHistogram {
 public:
  void Record(uint64_t ns) {
    if constexpr (!kStatsOn) return;
    // bit_width(ns - 1) = the smallest i with ns <= 2^i (0 and 1 land in bucket 0).
    const int bucket =
        ns <= 1 ? 0 : std::min<int>(std::bit_width(ns - 1), LatencyHistogram::kBuckets - 1);
    buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
    sum_ns_.fetch_add(ns, std::memory_order_relaxed);
    count_.fetch_add(1, std::memory_order_relaxed);
  }
  // Records `end - begin` when both stamps were taken and in order.
  void RecordSpan(uint64_t begin_ns, uint64_t end_ns) {
    if (begin_ns != 0 && end_ns >= begin_ns) Record(end_ns - begin_ns);
  }
  void CopyTo(LatencyHistogram* out) const;

 private:
  std::array<std::atomic<uint64_t>, LatencyHistogram::kBuckets> buckets_{};
  std::atomic<uint64_t> sum_ns_{0};
  std::atomic<uint64_t> count_{0};
};

class StatsRecorder {
 public:
  // `peer_role` and `num_peers`: the other role's nodes this one talks to.
  StatsRecorder(Role role, Role peer_role, int num_peers);

  void Sent(int peer, uint64_t bytes) {
    if constexpr (!kStatsOn) return;
    if (Peer* p = at(peer)) {
      p->bytes_sent.fetch_add(bytes, std::memory_order_relaxed);
      p->frames_sent.fetch_add(1, std::memory_order_relaxed);
    }
  }
  void Received(int peer, uint64_t bytes) {
    if constexpr (!kStatsOn) return;
    if (Peer* p = at(peer)) {
      p->bytes_received.fetch_add(bytes, std::memory_order_relaxed);
      p->frames_received.fetch_add(1, std::memory_order_relaxed);
    }
  }
  void Outcome(int peer, absl::StatusCode code) {
    if constexpr (!kStatsOn) return;
    if (Peer* p = at(peer)) p->outcomes[CodeIndex(code)].fetch_add(1, std::memory_order_relaxed);
  }
  void Lost(int peer) {
    if (Peer* p = at(peer)) p->losses.fetch_add(1, std::memory_order_relaxed);
  }
  void Rejoined(int peer) {
    if (Peer* p = at(peer)) p->rejoins.fetch_add(1, std::memory_order_relaxed);
  }
  void Request(absl::StatusCode code) {
    if constexpr (!kStatsOn) return;
    requests_[CodeIndex(code)].fetch_add(1, std::memory_order_relaxed);
  }
  LiveHistogram& stage(Stage s) { return stages_[static_cast<int>(s)]; }

  // The counters; the caller fills rank, sends_queued and in_flight.
  MeshStats Snapshot() const;

 private:
  struct Peer {
    std::atomic<uint64_t> bytes_sent{0}, frames_sent{0}, bytes_received{0}, frames_received{0};
    std::array<std::atomic<uint64_t>, kNumStatusCodes> outcomes{};
    std::atomic<uint64_t> losses{0}, rejoins{0};
  };
  static int CodeIndex(absl::StatusCode code) {
    const int c = static_cast<int>(code);
    return c >= 0 && c < kNumStatusCodes ? c : static_cast<int>(absl::StatusCode::kUnknown);
  }
  Peer* at(int peer) { return peer >= 0 && peer < num_peers_ ? &peers_[peer] : nullptr; }

  const Role role_;
  const Role peer_role_;
  const int num_peers_;
  std::unique_ptr<Peer[]> peers_;
  std::array<std::atomic<uint64_t>, kNumStatusCodes> requests_{};
  std::array<LiveHistogram, kNumStages> stages_;
};

}  // namespace stepmesh::core
