#pragma once
// Completion by count, never by order. A frame from a peer is complete when
// its descriptor (on the ordered control connection) has arrived and as many
// of its payload writes have landed as the descriptor counts -- each landing
// is one receive completion whose immediate data names (writer tag, seq).
// Writes, completions and descriptors may come in any order relative to each
// other (EFA's SRD reorders; the control connection is a different channel
// altogether); frames are still handed to the core in the writer's order, as
// the TransportSink contract wants. Receive thread only.

#include <cstdint>
#include <deque>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "src/transport/libfabric/fabric_wire.h"

namespace stepmesh::libfabric {

struct PendingFrame {
  uint32_t seq = 0;
  uint32_t chunks = 0;
  uint32_t landed = 0;
  core::FrameHeader header;
  std::string inline_bytes;
  absl::Status failure;  // aborted by the writer, over-counted, or timed out
  absl::Time since;
  bool complete() const { return !failure.ok() || landed == chunks; }
};

class FrameAssembler {
 public:
  void OnDescriptor(FrameDescriptor d, absl::Time now);
  // One landed write of frame `seq` (its descriptor may not be here yet).
  void OnChunk(uint32_t seq);
  // The writer could not write frame `seq`: it completes with `why`.
  void OnAbort(uint32_t seq, absl::Status why);
  // The oldest frame when complete (or failed); null while it still waits.
  PendingFrame* Ready() {
    return !fifo_.empty() && fifo_.front().complete() ? &fifo_.front() : nullptr;
  }
  void Pop() { fifo_.pop_front(); }
  bool waiting() const { return !fifo_.empty(); }
  // The oldest frame waits since then (InfiniteFuture when none).
  absl::Time oldest() const { return fifo_.empty() ? absl::InfiniteFuture() : fifo_.front().since; }
  // Fails the oldest frame (it waited too long).
  void FailOldest(absl::Status why);
  size_t early_counts() const { return early_.size(); }

 private:
  PendingFrame* Find(uint32_t seq);
  std::deque<PendingFrame> fifo_;
  absl::flat_hash_map<uint32_t, uint32_t> early_;        // seq -> writes landed first
  absl::flat_hash_map<uint32_t, absl::Status> aborted_;  // aborts ahead of descriptors
};

}  // namespace stepmesh::libfabric
