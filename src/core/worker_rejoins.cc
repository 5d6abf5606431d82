#include "src/core/worker_rejoins.h"

namespace stepmesh::core {

WorkerRejoins::WorkerRejoins(int num_workers)
    : num_workers_(num_workers), states_(new State[num_workers > 0 ? num_workers : 0]) {}

bool WorkerRejoins::NewProcessSeen(int w) {
  State& s = states_[w];
  const uint32_t now = s.epoch.load(std::memory_order_acquire);
  if (s.seen_epoch == now) return false;
  s.seen_epoch = now;
  return true;
}

void WorkerRejoins::BeginRejoin(int w) {
  State& s = states_[w];
  s.epoch.fetch_add(1, std::memory_order_acq_rel);
  s.window.store(Window::kConnecting, std::memory_order_release);
}

void WorkerRejoins::EndRejoin(int w) {
  State& s = states_[w];
  s.loss_set_aside =
      s.window.exchange(Window::kNone, std::memory_order_acq_rel) == Window::kLossSetAside;
}

bool WorkerRejoins::SetAsideLoss(int w) {
  if (w < 0 || w >= num_workers_) return false;
  State& s = states_[w];
  Window connecting = Window::kConnecting;
  if (s.window.compare_exchange_strong(connecting, Window::kLossSetAside,
                                       std::memory_order_acq_rel)) {
    return true;
  }
  // A second report in the same window is set aside too.
  return connecting == Window::kLossSetAside;
}

bool WorkerRejoins::TakeSetAsideLoss(int w) {
  if (w < 0 || w >= num_workers_) return false;
  State& s = states_[w];
  if (!s.loss_set_aside) return false;
  s.loss_set_aside = false;
  return true;
}

}  // namespace stepmesh::core
