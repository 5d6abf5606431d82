#pragma once
// A server's view of its workers' processes: which process of each worker rank
// it serves (an epoch bumped at every rejoin) and the short window while a
// rejoined worker's new connection is being made. Each method says which
// thread calls it; the class is the only owner of that state.
//
// The window: from counting a rejoined worker back in until Connect returns,
// a connection loss the transport reports may be the previous process's, read
// late by a receive thread lagging the rendezvous thread. It is set aside
// (counting the worker out would leave the new process's requests waiting for
// batches that never form). It may as well be the new process's own (a
// transport may carry the new connection before Connect returns): the
// scheduler settles that afterwards -- a new process that crashed is reported
// lost, one that left in order is reported as having left, and only then does
// TakeSetAsideLoss say the loss set aside must be counted after all.

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace stepmesh::core {

class WorkerRejoins {
 public:
  explicit WorkerRejoins(int num_workers);

  // Any thread: the process of worker `w` this server serves (0 for the first).
  uint32_t epoch(int w) const { return states_[w].epoch.load(std::memory_order_acquire); }

  // Receive thread, before a frame of worker `w`: true once after each rejoin
  // of `w` (the caller then drops what the previous process left half-received).
  bool NewProcessSeen(int w);

  // Rendezvous thread: worker `w`'s new process rejoined; its connection is
  // being made until EndRejoin(w).
  void BeginRejoin(int w);
  // Rendezvous thread: the connection attempt of BeginRejoin(w) returned.
  void EndRejoin(int w);

  // Receive thread: a connection loss of worker `w` was reported. True when it
  // falls in a rejoin window and is set aside (the caller ignores it).
  bool SetAsideLoss(int w);

  // Rendezvous thread: the scheduler says `w` left in order. True (once) when
  // the last rejoin set a loss aside, which must now count the worker out.
  bool TakeSetAsideLoss(int w);

 private:
  enum class Window : uint8_t { kNone, kConnecting, kLossSetAside };
  struct State {
    std::atomic<uint32_t> epoch{0};
    std::atomic<Window> window{Window::kNone};
    uint32_t seen_epoch = 0;      // receive thread only
    bool loss_set_aside = false;  // rendezvous thread only: the last window's outcome
  };
  const int num_workers_;
  std::unique_ptr<State[]> states_;
};

}  // namespace stepmesh::core
