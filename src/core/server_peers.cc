// ServerLogic's workers: lost, leaving (their fences), rejoining (with
// WorkerRejoins), and the server's own drain (Participant::Leave)
// (src/core/server_logic.h).

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/base/logging.h"
#include "src/core/chrome_trace.h"
#include "src/core/mesh.h"
#include "src/core/server_logic.h"
#include "stepmesh/status.h"

namespace stepmesh::core {

bool ServerLogic::AllFenced() const {
  return fences_.AllFenced(lost_) && !parked_any_.load(std::memory_order_acquire);
}

bool ServerLogic::DrainedOut() {
  return fences_.draining() && AllFenced() && assembler_.NothingToHandOut();
}

absl::Status ServerLogic::Drain(absl::Time deadline) {
  const absl::Time start = absl::Now();
  fences_.BeginDrain();
  STEPMESH_RETURN_IF_ERROR(node_.rendezvous().AnnounceLeaving());
  node_.NotifyWaiters();
  if (node_.AwaitUntil([this] { return AllFenced() && assembler_.Idle(); }, deadline)) {
    return absl::OkStatus();
  }
  const int unfenced = fences_.Unfenced(lost_);
  return absl::DeadlineExceededError(absl::StrCat(
      "server ", node_.rank(), " left after ", absl::FormatDuration(absl::Now() - start),
      " without draining: ", unfenced, " worker(s) had not confirmed their last push, and ",
      assembler_.Idle() ? "no batch" : "batches", " were still unanswered"));
}

void ServerLogic::Fenced(int w) {
  if (!fences_.Fence(w)) return;  // a previous drain's, late
  assembler_.StopAwaiting(w);
  node_.NotifyWaiters();
}

void ServerLogic::OnPeerGone(NodeId peer, const absl::Status& why) {
  if (!IsWorker(peer)) return;
  const int w = static_cast<int>(NodeRank(peer));
  if (w >= options_.num_workers || !lost_.MarkLost(w)) return;
  stats_.Lost(w);
  STEPMESH_LOG(kInfo, "server ", node_.rank(), ": ", PeerLossMessage(peer, why.message()));
  assembler_.DropWorker(w);
  node_.NotifyWaiters();
}

void ServerLogic::OnPeerLost(NodeId peer, absl::Status why) {
  if (IsWorker(peer) && rejoins_.SetAsideLoss(static_cast<int>(NodeRank(peer)))) {
    STEPMESH_LOG(kInfo, "server ", node_.rank(), ": worker ", NodeRank(peer),
                 "'s connection ended while it rejoined (its previous process's, or a new "
                 "one that left: the scheduler tells): ",
                 why.ToString());
    return;
  }
  OnPeerGone(peer, why);
}

void ServerLogic::OnPeerLeft(NodeId peer) {
  if (!IsWorker(peer)) return;
  if (!rejoins_.TakeSetAsideLoss(static_cast<int>(NodeRank(peer)))) return;
  OnPeerGone(peer, absl::CancelledError("left"));
}

void ServerLogic::OnPeerJoined(NodeId peer, const std::string& endpoint) {
  if (!IsWorker(peer) || node_.stopped()) return;
  const int w = static_cast<int>(NodeRank(peer));
  if (w >= options_.num_workers) return;
  // Draining: the newcomer's roster does not hold this server.
  if (fences_.draining()) return;
  // A worker that never looked lost (its old connection still open) is superseded.
  OnPeerGone(peer, absl::UnavailableError("worker restarted"));
  rejoins_.BeginRejoin(w);
  // Batches wait for it once its first request arrived (docs/elastic.md).
  assembler_.AwaitAfterFirstRequest(w);
  // Counted before its connection exists, so no batch forms without it meanwhile.
  lost_.MarkBack(w);
  absl::Status connected = node_.transport().Connect(node_.self(), {PeerInfo{peer, endpoint}},
                                                     absl::Now() + options_.timeout);
  rejoins_.EndRejoin(w);
  if (!connected.ok()) {
    OnPeerGone(peer, connected);
    STEPMESH_LOG(kWarning, "server ", node_.rank(), ": rejoined worker ", w,
                 " never connected: ", connected.ToString());
    return;
  }
  stats_.Rejoined(w);
  STEPMESH_LOG(kInfo, "server ", node_.rank(), ": worker ", w, " rejoined at ", endpoint);
}

void ServerLogic::OnRoster(bool joined_running) {
  if (!joined_running) return;
  for (int w = 0; w < options_.num_workers; ++w) assembler_.AwaitAfterFirstRequest(w);
}

void ServerLogic::CancelAll(const absl::Status&) { assembler_.ClearReady(); }

}  // namespace stepmesh::core
