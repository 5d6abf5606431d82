// ServerLogic's receive thread: the per-frame checks of arriving pushes, their
// delivery into batches, and what a restarted worker's previous process left
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

absl::Status ServerLogic::Resolve(NodeId peer, const FrameHeader& h, Destination& out,
                                  FrameContext* context) {
  const uint32_t w = NodeRank(peer);
  if (!IsWorker(peer) || w >= static_cast<uint32_t>(options_.num_workers)) {
    return absl::PermissionDeniedError(absl::StrCat("a frame from node 0x", absl::Hex(peer),
                                                    ", which is not one of the ",
                                                    options_.num_workers, " workers of this mesh"));
  }
  if (h.type != FrameType::kPush) {
    // Refused before anything is reserved; OnFrame answers it.
    return absl::InvalidArgumentError(
        absl::StrCat("a server receives pushes, not frame type ", static_cast<int>(h.type)));
  }
  ForgetPreviousProcess(static_cast<int>(w));
  if (fences_.fenced(static_cast<int>(w))) {
    return absl::UnavailableError(absl::StrCat("server ", node_.rank(),
                                               " left the mesh (it drains) and takes nothing "
                                               "after worker ",
                                               w, "'s last push"));
  }
  PushNote& note = notes_[w];
  note.reg = nullptr;
  note.duplicate = false;
  note.parking = false;
  *context = &note;
  base::ReaderMutexLock lock(&reg_mu_);
  auto it = recv_regs_.find(h.key);
  // Why not refuse a push whose key (or pull key) is not registered at
  // once: a worker may push as soon as the mesh is up, before this server's
  // application registered the key (no barrier is required of integrators).
  // Why not wait here: this thread reads every worker's frames. So the push
  // is parked, bounded per worker, and the receive thread moves on (see
  // ParkedPush).
  if (it == recv_regs_.end()) return Park(static_cast<int>(w), h, out, note);
  STEPMESH_RETURN_IF_ERROR(Admit(static_cast<int>(w), h, *it->second, out, note));
  // Only the reply tensor is missing: the payload lands in its slot, now
  // reserved, and only its delivery is parked.
  if (!PullRegistered(h, *it->second, static_cast<int>(w))) note.parking = true;
  return absl::OkStatus();
}

bool ServerLogic::PullRegistered(const FrameHeader& h) const {
  return (h.flags & kFlagHasPull) == 0 || reply_regs_.contains(h.pull_key);
}

bool ServerLogic::PullRegistered(const FrameHeader& h, RecvRegistration& reg, int w) const {
  if ((h.flags & kFlagHasPull) == 0) return true;
  if (h.pull_key != kNoPull && reg.pull_checked[w] == h.pull_key) return true;
  if (!reply_regs_.contains(h.pull_key)) return false;
  reg.pull_checked[w] = h.pull_key;
  return true;
}

absl::Status ServerLogic::Admit(int w, const FrameHeader& h, RecvRegistration& reg,
                                Destination& out, PushNote& note) {
  if (h.dtype != reg.view.dtype) {
    return absl::InvalidArgumentError(absl::StrCat("push dtype ", DTypeName(h.dtype), " under key ",
                                                   h.key, " but server ", node_.rank(),
                                                   " registered ", DTypeName(reg.view.dtype)));
  }
  if (h.payload_bytes > reg.slot_bytes) {
    return absl::OutOfRangeError(absl::StrCat("push of ", h.payload_bytes, " bytes under key ",
                                              h.key, " exceeds server ", node_.rank(), "'s ",
                                              reg.slot_bytes, "-byte slot"));
  }
  if (h.request_id == reg.last_request[w]) {
    // The same request's push again. Refusing it with an error would fail
    // that request while this server still serves its original -- the
    // worker would reuse the key's tensors, and its next push would meet a
    // busy slot (and, over RDMA, the original's late reply would land in
    // the next request's pull tensor). Answering it again would hold the
    // slot for a batch nobody waits for. The original's reply answers it.
    note.duplicate = true;
    return absl::AlreadyExistsError(absl::StrCat("push under key ", h.key, " of request 0x",
                                                 absl::Hex(h.request_id),
                                                 " arrived twice; the copy is dropped"));
  }
  if (reg.busy[w].exchange(true)) {
    return absl::FailedPreconditionError(
        absl::StrCat("push under key ", h.key, " while the previous one is still being processed"));
  }
  reg.last_request[w] = h.request_id;
  note.reg = &reg;  // its slot stays reserved (and the key registered) until the push is done
  out = Destination{reg.wire.wire + w * reg.slot_bytes, reg.slot_bytes, reg.wire.region};
  return absl::OkStatus();
}

std::string ServerLogic::MissingRegistration(int w, const FrameHeader& h) const {
  if (!recv_regs_.contains(h.key)) {
    return absl::StrCat("push key ", h.key, " of worker ", w, " is not registered on server ",
                        node_.rank());
  }
  return absl::StrCat("worker ", w, " pulls key ", h.pull_key,
                      ", which has no reply tensor on server ", node_.rank());
}

void ServerLogic::OnFrame(NodeId peer, const FrameHeader& h, FrameContext context,
                          absl::Status status) {
  node_.MarkActivity();
  if (IsWorker(peer)) stats_.Received(static_cast<int>(NodeRank(peer)), h.payload_bytes);
  if (context == nullptr) {
    // Refused by Resolve before it claimed anything (a frame of another
    // type, a sender outside the mesh), or an error frame from a worker.
    if (h.type == FrameType::kError && h.key == kFenceKey && absl::IsCancelled(status) &&
        IsWorker(peer) && NodeRank(peer) < static_cast<uint32_t>(options_.num_workers)) {
      return Fenced(static_cast<int>(NodeRank(peer)));
    }
    if (h.type == FrameType::kError) {
      STEPMESH_LOG_LIMITED(violations_, kWarning, "server ", node_.rank(), ": ", PeerName(peer),
                           " sent an error frame: ", status.ToString());
      return;
    }
    STEPMESH_LOG_LIMITED(violations_, kWarning, "server ", node_.rank(), ": refused a frame from ",
                         PeerName(peer), ": ", status.message());
    QueueError(peer, h.request_id, status);
    return;
  }
  PushNote& note = *static_cast<PushNote*>(context);
  if (std::exchange(note.duplicate, false)) {
    STEPMESH_LOG_LIMITED(violations_, kWarning, "server ", node_.rank(), ": ", PeerName(peer), ": ",
                         status.message());
    return;
  }
  RecvRegistration* reg = std::exchange(note.reg, nullptr);
  const int w = note.worker;
  if (std::exchange(note.parking, false) && status.ok()) {
    if (reg == nullptr) parked_bytes_[w] += h.payload_bytes;  // else it sits in its slot
    parked_[w].push_back(
        ParkedPush{h, std::move(note.park), reg, absl::Now() + ParkWait(), rejoins_.epoch(w)});
    ++parked_total_;
    parked_any_.store(true, std::memory_order_release);
    STEPMESH_LOG(kInfo, "server ", node_.rank(), ": worker ", w, "'s push under key ", h.key,
                 " waits for its registration here");
    // A registration between Resolve and here found nothing parked yet.
    registered_.store(true, std::memory_order_release);
    return;
  }
  note.park.reset();
  Deliver(peer, w, h, reg, std::move(status));
}

void ServerLogic::Deliver(NodeId peer, int w, const FrameHeader& h, RecvRegistration* reg,
                          absl::Status status) {
  if (status.ok()) {
    status = reg == nullptr ? absl::InternalError("push delivered without a resolved destination")
                            : io_.Check(h, reg->wire, reg->wire.wire + w * reg->slot_bytes);
  }
  BatchAssembler::Arrival arrival = assembler_.AddPart(w, h, reg, status);
  if (!arrival.report.ok()) QueueError(peer, h.request_id, arrival.report);
  if (arrival.ready) node_.NotifyWaiters();
  if (arrival.complete == nullptr) return;
  Assembly& a = *arrival.complete;
  for (int i = 0; i < a.num_keys; ++i) {
    // Staged regions: move the worker's bytes from the wire copy to the tensor.
    const RecvRegistration& part = *a.regs[i];
    if (absl::Status s = io_.StageIn(part.wire, part.view.data, w * part.slot_bytes, a.bytes[i]);
        !s.ok()) {
      QueueError(peer, h.request_id, s);
      if (assembler_.Abandon(w, a)) node_.NotifyWaiters();
      return;
    }
  }
  bool ready = false;
  if (absl::Status added = assembler_.Commit(w, a, &ready); !added.ok()) {
    QueueError(peer, h.request_id, added);
  }
  if (ready) node_.NotifyWaiters();
}

void ServerLogic::ForgetPreviousProcess(int w) {
  if (!rejoins_.NewProcessSeen(w)) return;
  const std::vector<const RecvRegistration*> held = assembler_.ForgetWorker(w);
  // Only this thread sets busy flags, so none can become held meanwhile.
  base::ReaderMutexLock lock(&reg_mu_);
  for (auto& [key, reg] : recv_regs_) {
    // The new process numbers its requests afresh.
    reg->last_request[w] = 0;
    if (std::find(held.begin(), held.end(), reg.get()) == held.end()) reg->busy[w].store(false);
  }
}

}  // namespace stepmesh::core
