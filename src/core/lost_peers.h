#pragma once
// Which participants of the other role are gone: written by whichever thread
// learns of a loss (receive or rendezvous) or a rejoin (rendezvous), read by
// every thread. One flag per rank, no lock.

#include <atomic>
#include <memory>

namespace stepmesh::core {

class LostPeers {
 public:
  explicit LostPeers(int count) : count_(count), lost_(new std::atomic<bool>[count]) {
    for (int r = 0; r < count; ++r) lost_[r].store(false, std::memory_order_relaxed);
  }

  int count() const { return count_; }
  bool lost(int rank) const { return lost_[rank].load(); }
  // True for the caller that marked it: a loss is handled once.
  bool MarkLost(int rank) { return !lost_[rank].exchange(true); }
  // A new process took the rank over (rejoin).
  void MarkBack(int rank) { lost_[rank].store(false, std::memory_order_release); }
  int live() const {
    int n = 0;
    for (int r = 0; r < count_; ++r) n += !lost(r);
    return n;
  }

 private:
  const int count_;
  std::unique_ptr<std::atomic<bool>[]> lost_;
};

}  // namespace stepmesh::core
