#include "src/transport/rdma/send_queue.h"

#include <algorithm>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/net.h"
#include "src/transport/rdma/verbs_resources.h"
#include "stepmesh/status.h"

namespace stepmesh::rdma {
namespace {

using base::ErrnoMessage;
using base::MutexLock;

constexpr int kReapBatch = 32;

void FetchMax(std::atomic<uint64_t>& value, uint64_t candidate) {
  uint64_t seen = value.load(std::memory_order_relaxed);
  while (seen < candidate &&
         !value.compare_exchange_weak(seen, candidate, std::memory_order_acq_rel)) {
  }
}

}  // namespace

absl::Status CompletionError(const ibv_wc& wc, const char* what) {
  const std::string text =
      absl::StrCat("rdma ", what, " completion failed: ", WcStatusName(wc.status), " (",
                   static_cast<int>(wc.status), ", vendor ", wc.vendor_err, ")");
  switch (wc.status) {
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_LOC_PROT_ERR:
      return absl::PermissionDeniedError(text);
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return absl::ResourceExhaustedError(text);
    case IBV_WC_WR_FLUSH_ERR:
    case IBV_WC_RETRY_EXC_ERR:
      return absl::UnavailableError(text);
    default:
      return absl::InternalError(text);
  }
}

void FailureRecord::Record(absl::Status why, Rank rank) {
  MutexLock lock(&mu_);
  if (rank <= rank_) return;  // the first of equals wins
  status_ = std::move(why);
  rank_ = rank;
  failed_.store(true, std::memory_order_release);
}

FailureRecord::Rank FailureRecord::rank() const {
  MutexLock lock(&mu_);
  return static_cast<Rank>(rank_);
}

absl::Status FailureRecord::status() const {
  MutexLock lock(&mu_);
  return status_;
}

void SendQueue::Init(VerbsApi* verbs, ibv_qp* qp, ibv_cq* cq, uint32_t granted,
                     uint32_t cq_entries) {
  verbs_ = verbs;
  qp_ = qp;
  cq_ = cq;
  const uint32_t usable = std::min(granted, cq_entries);
  data_slots_ = usable > 2 * kCreditSlots ? usable - kCreditSlots : usable / 2;
  signal_interval_ = std::max<uint32_t>(1, data_slots_ / 4);
}

absl::StatusOr<bool> SendQueue::TryPost(ibv_send_wr* chain, int count, FailureRecord& failure,
                                        absl::FunctionRef<bool()> valid) {
  MutexLock lock(&mu_);
  if (posted_ - completed_.load(std::memory_order_acquire) + count > data_slots_) {
    Reap(failure);
    if (failure.failed()) return failure.status();
    if (posted_ - completed_.load(std::memory_order_acquire) + count > data_slots_) return false;
  }
  if (!valid()) return absl::AbortedError("rdma: route changed while posting");
  STEPMESH_RETURN_IF_ERROR(PostLocked(chain, count, failure));
  return true;
}

absl::Status SendQueue::Post(ibv_send_wr* chain, int count, absl::Time deadline,
                             FailureRecord& failure, absl::FunctionRef<bool()> valid) {
  for (int spins = 0;; ++spins) {
    STEPMESH_ASSIGN_OR_RETURN(const bool posted, TryPost(chain, count, failure, valid));
    if (posted) return absl::OkStatus();
    if ((spins & 63) == 63 && absl::Now() > deadline) {
      return absl::DeadlineExceededError("rdma: the send queue did not drain");
    }
    std::this_thread::yield();
  }
}

absl::Status SendQueue::PostLocked(ibv_send_wr* chain, int count, FailureRecord& failure) {
  ibv_send_wr* wr = chain;
  for (int i = 0; i < count; ++i, wr = wr->next) {
    wr->wr_id = posted_ + i + 1;
    if (++since_signal_ >= signal_interval_) {
      wr->send_flags |= IBV_SEND_SIGNALED;
      since_signal_ = 0;
    }
  }
  ibv_send_wr* bad = nullptr;
  if (const int rc = verbs_->PostSend(qp_, chain, &bad); rc != 0) {
    absl::Status why = absl::UnavailableError(ErrnoMessage("rdma: ibv_post_send", rc));
    failure.Record(why, FailureRecord::kCause);
    return why;
  }
  posted_ += count;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> SendQueue::Fence(absl::Time deadline, FailureRecord& failure) {
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.num_sge = 0;  // zero-length: touches no memory, completes behind everything before it
  wr.wr.rdma.remote_addr = fence_addr_;
  wr.wr.rdma.rkey = fence_rkey_;
  {
    MutexLock lock(&mu_);
    if (completed_.load(std::memory_order_acquire) >= posted_) return posted_;
  }
  // Signalled: the watermark must be observable even when the last request
  // before it was unsignalled.
  wr.send_flags = IBV_SEND_SIGNALED;
  // Post() assigns the next wr_id; signalling is already forced.
  uint64_t watermark = 0;
  STEPMESH_RETURN_IF_ERROR(Post(&wr, 1, deadline, failure, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    watermark = posted_ + 1;
    return true;
  }));
  return watermark;
}

bool SendQueue::PostCredit(ibv_send_wr& wr, FailureRecord& failure) {
  if (credits_posted_ - credits_completed_.load(std::memory_order_acquire) >= kCreditSlots) {
    Reap(failure);
    if (credits_posted_ - credits_completed_.load(std::memory_order_acquire) >= kCreditSlots) {
      return false;
    }
  }
  wr.wr_id = kCreditTag | (credits_posted_ + 1);
  wr.send_flags |= IBV_SEND_SIGNALED;
  wr.next = nullptr;
  ibv_send_wr* bad = nullptr;
  if (const int rc = verbs_->PostSend(qp_, &wr, &bad); rc != 0) {
    failure.Record(absl::UnavailableError(ErrnoMessage("rdma: ibv_post_send (credits)", rc)),
                   FailureRecord::kCause);
    return true;  // nothing to retry: the connection is failing
  }
  ++credits_posted_;
  return true;
}

void SendQueue::Reap(FailureRecord& failure) {
  ibv_wc wc[kReapBatch];
  for (;;) {
    const int n = verbs_->PollCq(cq_, kReapBatch, wc);
    if (n < 0) {
      failure.Record(absl::InternalError("rdma: send CQ overrun"), FailureRecord::kEvent);
      return;
    }
    uint64_t credits = 0;
    uint64_t highest = 0;
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        failure.Record(CompletionError(wc[i], "send"), wc[i].status == IBV_WC_WR_FLUSH_ERR
                                                           ? FailureRecord::kFlush
                                                           : FailureRecord::kCause);
      }
      // Flushed requests count as done too: the NIC will not touch them again.
      if (wc[i].wr_id & kCreditTag) {
        ++credits;
      } else {
        highest = std::max(highest, wc[i].wr_id);
      }
    }
    if (credits > 0) credits_completed_.fetch_add(credits, std::memory_order_acq_rel);
    if (highest > 0) FetchMax(completed_, highest);
    if (n < kReapBatch) return;
  }
}

}  // namespace stepmesh::rdma
