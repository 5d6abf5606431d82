#include "src/core/worker_fences.h"

namespace stepmesh::core {

WorkerFences::WorkerFences(int num_workers)
    : num_workers_(num_workers > 0 ? num_workers : 0),
      fenced_(new std::atomic<bool>[num_workers_]) {
  for (int w = 0; w < num_workers_; ++w) fenced_[w].store(false, std::memory_order_relaxed);
}

bool WorkerFences::Fence(int w) {
  if (w < 0 || w >= num_workers_ || !draining()) return false;
  fenced_[w].store(true, std::memory_order_release);
  return true;
}

int WorkerFences::Unfenced(const LostPeers& lost) const {
  int n = 0;
  for (int w = 0; w < num_workers_; ++w) n += !lost.lost(w) && !fenced(w);
  return n;
}

bool WorkerFences::AllFenced(const LostPeers& lost) const {
  for (int w = 0; w < num_workers_; ++w) {
    if (!lost.lost(w) && !fenced(w)) return false;
  }
  return true;
}

}  // namespace stepmesh::core
