#pragma once
// A draining server's record of its workers' fences (docs/elastic.md): once
// the server's Leave began, each worker sends a fence after its last push
// here; a worker whose fence arrived pushes nothing more, and the drain is
// over once every worker that is not gone sent one. Each method says which
// thread calls it; the class is the only owner of that state.

#include <atomic>
#include <memory>

#include "src/core/lost_peers.h"

namespace stepmesh::core {

class WorkerFences {
 public:
  explicit WorkerFences(int num_workers);

  // Leave's thread: the drain began; fences count from now on.
  void BeginDrain() { draining_.store(true, std::memory_order_release); }
  // Any thread.
  bool draining() const { return draining_.load(std::memory_order_acquire); }

  // Receive thread: worker `w`'s fence arrived. False (and nothing changes)
  // when it is not this server's drain's: a late one, before a drain began,
  // or `w` outside the workers.
  bool Fence(int w);
  // Any thread (receive thread: per push of `w`): `w` sent its fence.
  bool fenced(int w) const { return fenced_[w].load(std::memory_order_acquire); }

  // Any thread: the workers neither gone (`lost`) nor fenced -- the ones a
  // drain still waits for.
  int Unfenced(const LostPeers& lost) const;
  bool AllFenced(const LostPeers& lost) const;

 private:
  const int num_workers_;
  std::atomic<bool> draining_{false};
  std::unique_ptr<std::atomic<bool>[]> fenced_;
};

}  // namespace stepmesh::core
