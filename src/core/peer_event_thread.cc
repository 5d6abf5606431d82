#include "src/core/peer_event_thread.h"

#include <utility>

#include "absl/time/time.h"
#include "src/base/thread_util.h"

namespace stepmesh::core {

void PeerEventThread::Start() {
  thread_ = base::StartNamedThread("sm-peer-events", {}, [this] { Loop(); });
}

void PeerEventThread::Post(std::function<void()> work) {
  base::MutexLock lock(&mu_);
  if (!stop_) queue_.push_back(std::move(work));
}

void PeerEventThread::Stop() {
  {
    base::MutexLock lock(&mu_);
    stop_ = true;
    queue_.clear();
  }
  if (thread_.joinable()) thread_.join();
}

size_t PeerEventThread::queued() {
  base::MutexLock lock(&mu_);
  return queue_.size();
}

void PeerEventThread::Loop() {
  for (;;) {
    std::function<void()> work;
    {
      base::MutexLock lock(&mu_);
      // queue_ and stop_ change only under mu_: one sleep, no slices.
      mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || stop_; });
      if (stop_) return;
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    work();
  }
}

}  // namespace stepmesh::core
