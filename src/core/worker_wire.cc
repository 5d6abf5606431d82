// WorkerLogic on the wire: the send thread's pushes and fences, the receive
// thread's replies, and a request's settling and completion
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

void WorkerLogic::Execute(const SendItem& item, const absl::Status& ready) {
  if (item.kind == SendKind::kFence) return SendFence(static_cast<int>(item.index));
  Request& r = requests_.at(item.index);
  absl::Status failed =
      ready.ok()
          ? absl::OkStatus()
          : absl::Status(ready.code(), absl::StrCat("ready event failed: ", ready.message()));
  for (int i = 0; i < r.num_pushes && failed.ok(); ++i) {
    const PlannedPush& p = r.pushes[i];
    failed = io_.StageOut(p.reg->wire, p.reg->view.data, 0, p.bytes);
  }
  // Worker w starts with server w (a rotation; see ReplyPath::SendReplies).
  const int num_servers = options_.num_servers;
  for (int i = 0; i < num_servers; ++i) {
    const int s = (i + node_.rank()) % num_servers;
    if (!r.addressed[s]) continue;
    if (!failed.ok()) {
      Settle(r, s, failed);
    } else if (lost_.lost(s) && !(draining_[s].load() && !fence_sent_[s])) {
      // Gone; or draining with its fence already sent (a post that raced
      // the drain notice): it takes nothing after the fence.
      Settle(r, s, GoneError(s));
    } else {
      SendPushes(r, RequestId(item.index, item.generation), s);
    }
  }
  Release(r);  // the send thread's reference
}

void WorkerLogic::SendFence(int s) {
  fence_sent_[s] = 1;
  FrameHeader h;
  h.type = FrameType::kError;
  h.src = node_.self();
  h.dst = node_.PeerId(s);
  h.key = kFenceKey;
  h.status_code = static_cast<uint32_t>(absl::StatusCode::kCancelled);
  h.payload_bytes = 0;
  if (absl::Status sent = node_.transport().Send(h.dst, h, nullptr, 0, 0); !sent.ok()) {
    // Its connection is gone already (a server that simply shut down).
    STEPMESH_LOG(kInfo, "worker ", node_.rank(), ": no fence to departing server ", s, ": ",
                 sent.message());
  }
}

void WorkerLogic::SendPushes(Request& r, uint64_t request_id, int s) {
  const int num_servers = options_.num_servers;
  uint16_t parts = 0;
  for (int i = 0; i < r.num_pushes; ++i) parts += r.targets[i * num_servers + s];
  FrameHeader h;
  h.type = FrameType::kPush;
  h.src = node_.self();
  h.dst = node_.PeerId(s);
  h.request_id = request_id;
  h.part_count = parts;
  if (r.pull_key[s] != kNoPull) {
    h.flags = kFlagHasPull;
    h.pull_key = r.pull_key[s];
  }
  if (r.stage.has_value()) {
    h.flags |= kFlagStage;
    h.status_code = *r.stage;
  }
  h.stamps.enqueue_ns = r.enqueue_ns;
  h.stamps.post_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
  r.stamps[s].enqueue_ns = r.enqueue_ns;
  r.stamps[s].post_ns = h.stamps.post_ns;
  uint16_t part = 0;
  for (int i = 0; i < r.num_pushes; ++i) {
    if (!r.targets[i * num_servers + s]) continue;
    const PlannedPush& p = r.pushes[i];
    h.key = p.key;
    h.dtype = p.dtype;
    h.payload_bytes = p.bytes;
    h.part_index = part++;
    io_.Seal(h, p.reg->wire, p.data);
    absl::Status sent = node_.transport().Send(h.dst, h, p.data, p.region, p.bytes);
    if (!sent.ok()) {
      Settle(
          r, s,
          absl::Status(sent.code(), absl::StrCat("sending to server ", s, ": ", sent.message())));
      return;
    }
    stats_.Sent(s, p.bytes);
  }
}

absl::Status WorkerLogic::Resolve(NodeId peer, const FrameHeader& h, Destination& out,
                                  FrameContext* context) {
  if (h.type != FrameType::kReply) {
    return absl::InvalidArgumentError(
        absl::StrCat("a worker receives replies, not frame type ", static_cast<int>(h.type)));
  }
  STEPMESH_ASSIGN_OR_RETURN(Request * r, AwaitingReply(peer, h));
  *context = r;
  const int s = static_cast<int>(NodeRank(peer));
  if (r->pull_key[s] == kNoPull) {
    if (h.payload_bytes != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("server ", s, " replied with data to a push-only request"));
    }
    return absl::OkStatus();
  }
  if (h.key != r->pull_key[s]) {
    return absl::InvalidArgumentError(absl::StrCat("server ", s, " replied under key ", h.key,
                                                   ", the request pulls key ", r->pull_key[s]));
  }
  const TensorRegistration& reg = *r->pull_reg[s];
  if (h.dtype != reg.view.dtype) {
    return absl::InvalidArgumentError(absl::StrCat("reply dtype ", DTypeName(h.dtype),
                                                   " under key ", h.key, " but the pull tensor is ",
                                                   DTypeName(reg.view.dtype)));
  }
  if (h.payload_bytes > reg.view.bytes()) {
    return absl::OutOfRangeError(absl::StrCat("reply of ", h.payload_bytes, " bytes under key ",
                                              h.key, " exceeds the pull tensor's ",
                                              reg.view.bytes()));
  }
  out = Destination{reg.wire.wire, reg.view.bytes(), reg.wire.region};
  return absl::OkStatus();
}

void WorkerLogic::OnFrame(NodeId peer, const FrameHeader& h, FrameContext context,
                          absl::Status status) {
  node_.MarkActivity();
  Request* r = static_cast<Request*>(context);
  const int s = static_cast<int>(NodeRank(peer));
  if (IsServer(peer)) stats_.Received(s, h.payload_bytes);
  if (h.type == FrameType::kError) {
    // Error frames carry no payload and are not resolved: validated here, once.
    absl::StatusOr<Request*> pending = AwaitingReply(peer, h);
    if (!pending.ok()) {
      STEPMESH_LOG(kWarning, "dropped a frame from server ", s, ": ", pending.status().ToString(),
                   " (frame status: ", status.ToString(), ")");
      return;
    }
    r = *pending;
  } else if (h.type != FrameType::kReply) {
    // Nothing was claimed for it; a server has no request to fail, so the
    // log is the answer.
    STEPMESH_LOG_LIMITED(violations_, kWarning, "worker ", node_.rank(), ": dropped a frame from ",
                         PeerName(peer), ": ", status.message());
    return;
  } else if (r == nullptr) {  // Resolve found no request awaiting it: `status` says why
    STEPMESH_LOG(kWarning, "dropped a frame from server ", s, ": ", status.ToString());
    return;
  } else if (!requests_.IsCurrent(*r, h.request_id)) {
    // Failed (the server was lost) and reused while the payload was landing.
    STEPMESH_LOG(kWarning, "dropped a frame from server ", s,
                 ": its request finished while it arrived (frame status: ", status.ToString(), ")");
    return;
  }
  if (h.type == FrameType::kReply && status.ok() && r->pull_key[s] != kNoPull) {
    const TensorRegistration& reg = *r->pull_reg[s];
    status = io_.Check(h, reg.wire, reg.wire.wire);
    if (status.ok()) status = io_.StageIn(reg.wire, reg.view.data, 0, h.payload_bytes);
  }
  if (h.type == FrameType::kReply && status.ok()) {
    TraceStamps& t = r->stamps[s];
    t.server_arrival_ns = h.stamps.server_arrival_ns;
    t.server_handler_ns = h.stamps.server_handler_ns;
    t.server_reply_ns = h.stamps.server_reply_ns;
    t.server_respond_ns = t.server_reply_ns != 0 ? t.server_reply_ns - h.status_code : 0;
    t.reply_arrival_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
    RecordStages(t);
  }
  if (!status.ok()) {
    status = absl::Status(status.code(), absl::StrCat("server ", s, ": ", status.message()));
  }
  Settle(*r, s, status);
}

absl::StatusOr<Request*> WorkerLogic::AwaitingReply(NodeId peer, const FrameHeader& h) const {
  const uint32_t s = NodeRank(peer);
  if (!IsServer(peer) || s >= static_cast<uint32_t>(options_.num_servers)) {
    return absl::PermissionDeniedError("frame from a node that is not a server");
  }
  return requests_.PendingFor(h.request_id, static_cast<int>(s));
}

void WorkerLogic::Settle(Request& r, int server, const absl::Status& status) {
  bool first = false;
  const bool last = requests_.Settle(r, server, status, &first);
  if (first) stats_.Outcome(server, status.code());
  if (last) Complete(r);
}

void WorkerLogic::RecordStages(const TraceStamps& t) {
  stats_.stage(Stage::kSubmit).RecordSpan(t.enqueue_ns, t.post_ns);
  const uint64_t server_ns = t.server_reply_ns - t.server_arrival_ns;
  if (t.post_ns != 0 && t.server_arrival_ns != 0 && t.server_reply_ns >= t.server_arrival_ns &&
      t.reply_arrival_ns >= t.post_ns + server_ns) {
    stats_.stage(Stage::kNetwork).Record(t.reply_arrival_ns - t.post_ns - server_ns);
  }
}

void WorkerLogic::Release(Request& r) {
  if (requests_.Release(r)) Complete(r);
}

void WorkerLogic::Complete(Request& r) {
  {
    base::MutexLock lock(&reg_mu_);
    for (int i = 0; i < r.num_pushes; ++i) r.pushes[i].reg->in_flight = false;
    for (int s = 0; s < options_.num_servers; ++s) {
      if (r.pull_key[s] != kNoPull) r.pull_reg[s]->in_flight = false;
    }
  }
  const uint64_t complete_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
  stats_.stage(Stage::kTotal).RecordSpan(r.enqueue_ns, complete_ns);
  if (trace_ring_.on()) RecordTrace(r, complete_ns);
  requests_.MarkDone(r, complete_ns);
  node_.NotifyWaiters();
}

void WorkerLogic::RecordTrace(const Request& r, uint64_t complete_ns) {
  using W = WorkerTraceWords;
  trace_ring_.Record([&](const TraceRing::Writer& out) {
    out.Put(W::kRequestId, RequestId(r.index, r.generation.load(std::memory_order_relaxed)));
    out.Put(W::kEnqueue, r.enqueue_ns);
    out.Put(W::kComplete, complete_ns);
    for (int s = 0; s < options_.num_servers; ++s) {
      const size_t at = W::kFirstServer + W::kPerServer * s;
      out.Put(at + W::kPost, r.stamps[s].post_ns);
      out.Put(at + W::kReplyArrival, r.stamps[s].reply_arrival_ns);
      out.Put(at + W::kAddressed, r.addressed[s]);
    }
  });
}

}  // namespace stepmesh::core
