#pragma once
// The thread a rendezvous runs its participant's peer handlers on
// (RendezvousEvents): posted work runs in order, one at a time, off the
// thread that noticed the change (a handler may connect to a peer, which takes
// a round trip or a timeout). Every rendezvous implementation (scheduler,
// etcd, framework store) uses this one. Stop() ends it; work still queued then
// is dropped: the node is stopping and no longer acts on peers.

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "src/base/sync.h"

namespace stepmesh::core {

class PeerEventThread {
 public:
  PeerEventThread() = default;
  ~PeerEventThread() { Stop(); }
  PeerEventThread(const PeerEventThread&) = delete;
  PeerEventThread& operator=(const PeerEventThread&) = delete;

  // Starts the thread (sm-peer-events); once.
  void Start();
  // Any thread, with or without the caller's own locks held (this takes only its own).
  void Post(std::function<void()> work);
  // Idempotent; returns once the thread ended (after the work running now).
  void Stop();
  // Work posted and not started yet (tests).
  size_t queued();

 private:
  void Loop();

  base::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace stepmesh::core
