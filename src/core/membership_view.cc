#include "src/core/membership_view.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "src/core/protocol.h"
#include "stepmesh/trace.h"

namespace stepmesh::core {
namespace {

void Insert(std::vector<int>& ranks, int rank) {
  auto at = std::lower_bound(ranks.begin(), ranks.end(), rank);
  if (at == ranks.end() || *at != rank) ranks.insert(at, rank);
}

void Erase(std::vector<int>& ranks, int rank) {
  auto at = std::lower_bound(ranks.begin(), ranks.end(), rank);
  if (at != ranks.end() && *at == rank) ranks.erase(at);
}

}  // namespace

void MembershipView::Reset(const std::vector<RosterEntry>& roster, uint64_t epoch) {
  base::MutexLock lock(&mu_);
  current_ = Membership{};
  current_.epoch = epoch;
  for (const RosterEntry& entry : roster) {
    const int rank = static_cast<int>(NodeRank(entry.node));
    Insert(IsWorker(entry.node) ? current_.workers : current_.servers, rank);
  }
  Publish();
}

void MembershipView::Apply(const MembershipEvent& event) {
  base::MutexLock lock(&mu_);
  if (event.epoch <= current_.epoch) return;
  current_.epoch = event.epoch;
  std::vector<int>& ranks = IsWorker(event.node) ? current_.workers : current_.servers;
  const int rank = static_cast<int>(NodeRank(event.node));
  if (event.kind == MembershipEvent::Kind::kJoined) {
    Insert(ranks, rank);
  } else {
    Erase(ranks, rank);
  }
  Publish();
}

void MembershipView::Publish() {
  workers_count_.store(static_cast<int>(current_.workers.size()), std::memory_order_relaxed);
  servers_count_.store(static_cast<int>(current_.servers.size()), std::memory_order_relaxed);
  epoch_.store(current_.epoch, std::memory_order_release);
  if (marks_.size() == kMaxMarks) marks_.erase(marks_.begin());
  marks_.push_back({MonotonicNowNs(), current_.epoch, static_cast<int>(current_.workers.size()),
                    static_cast<int>(current_.servers.size())});
}

std::vector<EpochMark> MembershipView::Marks() const {
  base::MutexLock lock(&mu_);
  return marks_;
}

void MembershipView::Close() {
  base::MutexLock lock(&mu_);
  closed_ = true;
}

Membership MembershipView::Current() const {
  base::MutexLock lock(&mu_);
  return current_;
}

absl::StatusOr<Membership> MembershipView::WaitChange(uint64_t after_epoch,
                                                      absl::Duration timeout) {
  base::MutexLock lock(&mu_);
  auto changed = [this, after_epoch]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return current_.epoch > after_epoch || closed_;
  };
  if (!mu_.AwaitWithTimeout(changed, timeout)) {
    return absl::DeadlineExceededError(absl::StrCat("no membership epoch after ", after_epoch,
                                                    " within ", absl::FormatDuration(timeout),
                                                    " (current: ", current_.epoch, ")"));
  }
  if (current_.epoch > after_epoch) return current_;
  return absl::CancelledError(
      absl::StrCat("the participant shut down (membership epoch ", current_.epoch, ")"));
}

}  // namespace stepmesh::core
