#pragma once
// What a role (worker, server) plugs into its mesh node (src/core/mesh_node.h):
// the send items it queues and executes, the frames it resolves and takes,
// and the peer events it answers. The node owns the logic and calls it only
// through this interface; the logic reaches the node through the node's
// public methods. The transport's sink is the logic itself, so a frame costs
// the same two virtual calls (Resolve, OnFrame) it cost when roles derived
// from the node.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "src/core/protocol.h"
#include "src/core/transport.h"
#include "stepmesh/types.h"

namespace stepmesh::core {

// What a queued send item is, per role: a worker queues requests and fences,
// a server replies and error reports.
enum class SendKind : uint8_t {
  kRequest,  // worker: request slot `index` (its pushes to every server it addresses)
  kFence,    // worker: the marker after its last push to draining server `index`
  kReplies,  // server: the replies of batch slot `index`
  kError,    // server: the error report of record `index` (ReplyPath::RecordError)
};

// Work for the send thread, by index: no allocation per send.
struct SendItem {
  SendKind kind = SendKind::kRequest;
  uint32_t index = 0;
  uint32_t generation = 0;
  Event* ready = nullptr;  // sent once this completes
  int64_t queued_ns = 0;  // set by EnqueueSend: a ready event pending past options.timeout fails it
  // Sent only after every item queued before it (one waiting for its ready
  // event included): a marker that must follow what was queued ahead.
  bool ordered = false;
};

class RoleLogic : public TransportSink {
 public:
  // Runs on the send thread once `item.ready` completed (or failed: `ready`),
  // or on the caller's thread through MeshNode::TrySendInline; one at a time,
  // under MeshNode::send_lock().
  virtual void Execute(const SendItem& item, const absl::Status& ready) = 0;

  // TransportSink: Resolve and OnFrame (receive thread, per frame), and
  // OnPeerLost -- the transport lost its connection to `peer`. Usually the
  // peer is gone (the default); a server tells a rejoined worker's superseded
  // connection from the worker itself.
  void OnPeerLost(NodeId peer, absl::Status why) override { OnPeerGone(peer, why); }

  // A peer is gone. Called from the receive or the rendezvous thread, maybe twice.
  virtual void OnPeerGone(NodeId peer, const absl::Status& why) = 0;
  // A peer's new process took over its rank at `endpoint` (rendezvous thread).
  virtual void OnPeerJoined(NodeId peer, const std::string& endpoint) = 0;
  // The scheduler saw `peer` leave in order (rendezvous thread, after the
  // events before it). Usually nothing to do: the transport reports the
  // goodbye after the peer's last frames, which this notice may overtake.
  virtual void OnPeerLeft(NodeId /*peer*/) {}
  // Start(), once the roster is in and before the progress threads run:
  // `joined_running` when this node joined a mesh that already ran.
  virtual void OnRoster(bool /*joined_running*/) {}
  // Fails everything still pending (Stop() calls it after the threads ended).
  virtual void CancelAll(const absl::Status& why) = 0;
  // Receive thread, after every Poll (and so at least every 50 ms): work the
  // receive path set aside (a server's parked pushes). Must be cheap when idle.
  virtual void AfterPoll() {}
};

}  // namespace stepmesh::core
