#include "src/transport/libfabric/frame_assembler.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace stepmesh::libfabric {

// Bounds what a misbehaving writer can make this side remember.
constexpr size_t kMaxEarly = 1 << 16;

PendingFrame* FrameAssembler::Find(uint32_t seq) {
  for (PendingFrame& f : fifo_) {
    if (f.seq == seq) return &f;
  }
  return nullptr;
}

void FrameAssembler::OnDescriptor(FrameDescriptor d, absl::Time now) {
  PendingFrame& f = fifo_.emplace_back();
  f.seq = d.seq & kSeqMask;
  f.chunks = d.chunks;
  f.header = d.header;
  f.inline_bytes = std::move(d.inline_bytes);
  f.since = now;
  if (auto it = early_.find(f.seq); it != early_.end()) {
    f.landed = it->second;
    early_.erase(it);
  }
  if (auto it = aborted_.find(f.seq); it != aborted_.end()) {
    f.failure = std::move(it->second);
    aborted_.erase(it);
  }
  if (f.landed > f.chunks) {
    f.failure = absl::DataLossError(absl::StrCat("libfabric: frame ", f.seq, " had ", f.landed,
                                                 " writes land, its descriptor counts ", f.chunks));
  }
}

void FrameAssembler::OnChunk(uint32_t seq) {
  if (PendingFrame* f = Find(seq); f != nullptr) {
    if (++f->landed > f->chunks && f->failure.ok()) {
      f->failure =
          absl::DataLossError(absl::StrCat("libfabric: frame ", seq, " had ", f->landed,
                                           " writes land, its descriptor counts ", f->chunks));
    }
    return;
  }
  if (early_.size() < kMaxEarly || early_.contains(seq)) ++early_[seq];
}

void FrameAssembler::OnAbort(uint32_t seq, absl::Status why) {
  if (PendingFrame* f = Find(seq); f != nullptr) {
    if (f->failure.ok()) f->failure = std::move(why);
    return;
  }
  if (aborted_.size() < kMaxEarly) aborted_.emplace(seq, std::move(why));
}

void FrameAssembler::FailOldest(absl::Status why) {
  if (!fifo_.empty() && fifo_.front().failure.ok()) fifo_.front().failure = std::move(why);
}

}  // namespace stepmesh::libfabric
