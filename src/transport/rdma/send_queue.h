#pragma once
// The send side of one RC queue pair, and the record of why a connection
// failed.
//
// Who posts: whoever drains a peer's outbox (the send thread's Send, or the
// receive thread once credits came back: frames, payloads) and, rarely, control paths
// (fences for UnregisterRegion, withdrawals and Shutdown) post data requests
// under `mu`; the receive thread posts credit returns from a reserved share of
// the queue without taking `mu`, so the two threads never wait for each other.
// Whoever needs to know what completed polls the send CQ (ibv_poll_cq is
// thread-safe) and publishes through atomics.
//
// Accounting is conservative: a signalled data completion with wr_id k means
// every data request up to k is done; each credit request is signalled and
// counted by itself. Data and credit requests outstanding never exceed the
// queue the NIC granted nor the CQ behind it, so a QP that fails -- and then
// flushes every outstanding request, signalled or not -- cannot overrun its CQ.

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/base/sync.h"
#include "src/transport/rdma/verbs_api.h"

namespace stepmesh::rdma {

// A status for a failed work completion, naming it ("remote access error").
absl::Status CompletionError(const ibv_wc& wc, const char* what);

// The best-known reason a connection failed, kept until the receive thread
// reports it. A real cause (a completion error other than a flush) replaces an
// asynchronous event, which replaces a flush: a QP that failed on one request
// flushes all the others, and "work request flushed" explains nothing.
class FailureRecord {
 public:
  enum Rank : int { kFlush = 0, kEvent = 1, kCause = 2 };

  void Record(absl::Status why, Rank rank);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  Rank rank() const;
  absl::Status status() const;

 private:
  mutable base::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  int rank_ ABSL_GUARDED_BY(mu_) = -1;
  std::atomic<bool> failed_{false};
};

class SendQueue {
 public:
  // Signalled, each with its own completion; the receive thread's share.
  static constexpr uint32_t kCreditSlots = 8;
  static constexpr uint64_t kCreditTag = uint64_t{1} << 63;

  // `granted` send WRs (what ibv_create_qp wrote back), `cq_entries` the CQ's size.
  void Init(VerbsApi* verbs, ibv_qp* qp, ibv_cq* cq, uint32_t granted, uint32_t cq_entries);
  // Where fences write: any valid remote location (zero-length writes touch nothing).
  void SetFenceTarget(uint64_t addr, uint32_t rkey) {
    fence_addr_ = addr;
    fence_rkey_ = rkey;
  }

  uint32_t data_slots() const { return data_slots_; }

  // Posts a chain of `count` data requests (wr_id and signalling are assigned
  // here) if the queue has room for all of them now: false (nothing posted)
  // when it has not, even after reaping. `valid` is called under the post lock
  // right before posting; false aborts with ABORTED (the route changed under
  // the caller). Failures are recorded in `failure`. Never waits.
  absl::StatusOr<bool> TryPost(ibv_send_wr* chain, int count, FailureRecord& failure,
                               absl::FunctionRef<bool()> valid);
  // The same, waiting for queue slots until `deadline` (control paths only:
  // fences).
  absl::Status Post(ibv_send_wr* chain, int count, absl::Time deadline, FailureRecord& failure,
                    absl::FunctionRef<bool()> valid);

  // A signalled zero-length write behind everything posted so far; returns the
  // watermark Drained() waits for (no request when nothing is outstanding).
  absl::StatusOr<uint64_t> Fence(absl::Time deadline, FailureRecord& failure);
  bool Drained(uint64_t watermark) const {
    return completed_.load(std::memory_order_acquire) >= watermark;
  }

  // Receive thread only: posts a credit write (wr.wr_id and flags are set
  // here). False when the credit share is full even after reaping: try later.
  bool PostCredit(ibv_send_wr& wr, FailureRecord& failure);

  // Runs `fn` holding the post lock: a change that every later Post's `valid`
  // check must see (a route withdrawn, a source deregistered).
  void Exclusive(absl::FunctionRef<void()> fn) {
    base::MutexLock lock(&mu_);
    fn();
  }

  // Polls the send CQ (any thread). Completion errors go to `failure`.
  void Reap(FailureRecord& failure);

 private:
  // Posts `chain` (room already checked).
  absl::Status PostLocked(ibv_send_wr* chain, int count, FailureRecord& failure)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  base::Mutex mu_;  // data posts; the receive thread's credit writes never take it
  VerbsApi* verbs_ = nullptr;
  ibv_qp* qp_ = nullptr;
  ibv_cq* cq_ = nullptr;
  uint32_t data_slots_ = 0;
  uint32_t signal_interval_ = 1;
  uint64_t fence_addr_ = 0;
  uint32_t fence_rkey_ = 0;
  uint64_t posted_ ABSL_GUARDED_BY(mu_) = 0;  // data requests; wr_id = ordinal
  uint32_t since_signal_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> completed_{0};  // highest data wr_id reaped
  uint64_t credits_posted_ = 0;         // receive thread
  std::atomic<uint64_t> credits_completed_{0};
};

}  // namespace stepmesh::rdma
