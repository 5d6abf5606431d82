// WorkerLogic's peers: servers lost, leaving (their fence) and rejoining,
// the worker's own drain (Participant::Leave), and the cancel at shutdown
// (src/core/worker_logic.h).

#include <atomic>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/base/logging.h"
#include "src/core/chrome_trace.h"
#include "src/core/mesh.h"
#include "src/core/worker_logic.h"
#include "stepmesh/status.h"

namespace stepmesh::core {

absl::Status WorkerLogic::LeavingError() const {
  return absl::FailedPreconditionError(absl::StrCat(
      "worker ", node_.rank(), " is leaving the mesh (Leave): it takes no new requests"));
}

size_t WorkerLogic::Pending() const {
  size_t n = 0;
  for (uint32_t i = 0; i < requests_.size(); ++i) {
    n += requests_.at(i).state.load(std::memory_order_acquire) == RequestState::kPending;
  }
  return n;
}

absl::Status WorkerLogic::Drain(absl::Time deadline) {
  const absl::Time start = absl::Now();
  if (node_.AwaitUntil([this] { return Pending() == 0; }, deadline)) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat(
      "worker ", node_.rank(), " left with ", Pending(), " request(s) still pending after ",
      absl::FormatDuration(absl::Now() - start), " (they fail CANCELLED)"));
}

void WorkerLogic::OnPeerGone(NodeId peer, const absl::Status& why) {
  if (!IsServer(peer)) return;
  const int s = static_cast<int>(NodeRank(peer));
  if (s >= options_.num_servers) return;
  // A draining server was counted out already (OnPeerLeft); its
  // connection ending now fails what it did not answer.
  const bool newly = lost_.MarkLost(s);
  if (!newly && !draining_[s].exchange(false)) return;
  if (newly) stats_.Lost(s);
  const absl::Status failure = absl::UnavailableError(PeerLossMessage(peer, why.message()));
  std::vector<RequestHandle> pending;
  {
    base::MutexLock lock(&reg_mu_);
    pending = requests_.PendingAddressing(s);
  }
  // A server that said goodbye with nothing of ours pending left in order:
  // info. Anything else is a loss the operator should see.
  const bool orderly = absl::IsCancelled(why) && pending.empty();
  if (orderly) {
    STEPMESH_LOG(kInfo, "worker ", node_.rank(), ": ", PeerName(peer), " left (orderly shutdown)");
  } else if (!pending.empty() || !node_.stopped()) {
    STEPMESH_LOG(kWarning, "worker ", node_.rank(), ": ", failure.message(), " (", pending.size(),
                 " request(s) pending)");
  }
  for (RequestHandle handle : pending) {
    Request& r = requests_.at(handle.index());
    if (r.generation == handle.generation() && r.state.load() == RequestState::kPending) {
      Settle(r, s, failure);
    }
  }
}

void WorkerLogic::OnPeerLeft(NodeId peer) {
  if (!IsServer(peer) || node_.stopped()) return;
  const int s = static_cast<int>(NodeRank(peer));
  if (s >= options_.num_servers || lost_.lost(s)) return;
  {
    std::lock_guard<std::mutex> lock(node_.send_lock());
    fence_sent_[s] = 0;
  }
  draining_[s].store(true);
  if (lost_.MarkLost(s)) stats_.Lost(s);
  STEPMESH_LOG(kInfo, "worker ", node_.rank(), ": server ", s, " left the mesh (epoch ",
               membership_.epoch() + 1, "); requests it holds complete first");
  SendItem fence{SendKind::kFence, static_cast<uint32_t>(s), 0, nullptr};
  fence.ordered = true;
  if (absl::Status queued = node_.EnqueueSend(fence); !queued.ok()) {
    STEPMESH_LOG(kWarning, "worker ", node_.rank(), ": cannot queue the fence to server ", s, ": ",
                 queued.ToString());
  }
}

void WorkerLogic::OnPeerJoined(NodeId peer, const std::string& endpoint) {
  if (!IsServer(peer) || node_.stopped()) return;
  const int s = static_cast<int>(NodeRank(peer));
  if (s >= options_.num_servers) return;
  // A server that never looked lost to this worker (its connection is still
  // open) is still superseded: the old connection belongs to a dead process.
  OnPeerGone(peer, absl::UnavailableError("server restarted"));
  absl::Status connected = node_.transport().Connect(node_.self(), {PeerInfo{peer, endpoint}},
                                                     absl::Now() + options_.timeout);
  if (!connected.ok()) {
    STEPMESH_LOG(kWarning, "worker ", node_.rank(), ": cannot reconnect to rejoined server ", s,
                 ": ", connected.ToString());
    return;
  }
  draining_[s].store(false);
  lost_.MarkBack(s);
  stats_.Rejoined(s);
  STEPMESH_LOG(kInfo, "worker ", node_.rank(), ": server ", s, " rejoined at ", endpoint);
}

void WorkerLogic::CancelAll(const absl::Status& why) {
  // Threads are stopped: nothing else touches the requests now.
  for (uint32_t i = 0; i < requests_.size(); ++i) {
    Request& r = requests_.at(i);
    if (r.state.load() != RequestState::kPending) continue;
    requests_.FailIfOk(r, why);
    Complete(r);
  }
  // No reply comes any more: streams waiting on the GPU timeline must not
  // wait forever.
  base::MutexLock lock(&reg_mu_);
  for (auto& [id, reg] : pull_regs_) reg->arrivals->ReleaseWaiters();
}

}  // namespace stepmesh::core
