#pragma once
// One participant's view of the mesh membership (stepmesh::Membership): the
// roster it joined with, then every MembershipEvent the rendezvous delivered,
// each a numbered epoch (docs/elastic.md). Written by the rendezvous' event
// thread, read by any thread (CurrentMembership, WaitMembershipChange,
// Stats); the data path never reads it: the per-rank flags it needs live in
// LostPeers, set by the same events.

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/base/sync.h"
#include "src/core/control_message.h"
#include "src/core/rendezvous.h"
#include "stepmesh/participant.h"

namespace stepmesh::core {

// A membership change as a trace shows it (docs/elastic.md): the epoch this
// participant applied, when (its monotonic clock), and the counts after it.
struct EpochMark {
  uint64_t at_ns = 0;
  uint64_t epoch = 0;
  int workers = 0;
  int servers = 0;
};

class MembershipView {
 public:
  // The roster Join returned, at `epoch`.
  void Reset(const std::vector<RosterEntry>& roster, uint64_t epoch);
  // A change: a node joined, left or was lost. One at or before the epoch
  // already held is ignored (the roster included it).
  void Apply(const MembershipEvent& event);
  // The participant shut down or left: waiters return CANCELLED.
  void Close();

  Membership Current() const;
  absl::StatusOr<Membership> WaitChange(uint64_t after_epoch, absl::Duration timeout);
  // Lock-free reads for Stats().
  uint64_t epoch() const { return epoch_.load(std::memory_order_acquire); }
  int workers() const { return workers_count_.load(std::memory_order_relaxed); }
  int servers() const { return servers_count_.load(std::memory_order_relaxed); }

  // Every epoch applied (the roster's first), oldest first; past kMaxMarks
  // the oldest go. For the Chrome trace export, not the data path.
  static constexpr size_t kMaxMarks = 256;
  std::vector<EpochMark> Marks() const;

 private:
  void Publish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable base::Mutex mu_;
  Membership current_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<EpochMark> marks_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> workers_count_{0};
  std::atomic<int> servers_count_{0};
};

}  // namespace stepmesh::core
