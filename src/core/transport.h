#pragma once
// The seam between the mesh logic (src/core) and the ways bytes move
// (src/transport/*). A transport moves frames and their payloads between
// registered regions; it never interprets requests or batches. The core tells
// it where payloads may land and how to reach peers.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/core/frame.h"
#include "stepmesh/options.h"
#include "stepmesh/tensor.h"

namespace stepmesh::core {

using RegionId = uint32_t;

// Memory the core registered. A receive region is split into `num_slots` equal
// slots; slot i may only be written by `slot_peers[i]` (a server's recv region:
// one slot per worker; a worker's pull tensor: one slot, its server).
struct RegionInfo {
  RegionId id = 0;
  uint64_t key = 0;
  void* base = nullptr;
  size_t slot_bytes = 0;
  uint32_t num_slots = 1;
  Device device;
  bool remote_writable = false;    // receive regions only
  std::vector<NodeId> slot_peers;  // size num_slots when remote_writable
  // Device memory only: a dma-buf fd covering [base, base + bytes()) starting
  // `dmabuf_offset` bytes into the buffer, for ibv_reg_dmabuf_mr. Open only
  // while RegisterRegion runs (an MR keeps its own reference to the buffer).
  // -1: register `base` as a plain address (host memory, or device memory on
  // a driver with peer-memory support).
  int dmabuf_fd = -1;
  uint64_t dmabuf_offset = 0;
  size_t bytes() const { return slot_bytes * num_slots; }
};

struct PeerInfo {
  NodeId id = kNoNode;
  std::string endpoint;  // the peer's Transport::LocalEndpoint(), via the scheduler
};

// Where an arriving payload lands, decided (and validated) by the core.
struct Destination {
  std::byte* data = nullptr;
  size_t capacity = 0;
  RegionId region = 0;
};

// The core's note on one frame, made when it resolved the frame and handed
// back with its delivery, so that each frame is validated once. Opaque to the
// transport, which only carries it from Resolve to OnFrame.
using FrameContext = void*;

// Implemented by the core; called by the transport on its receive path only
// (one thread: whoever calls Poll). Frames of one peer are resolved and
// delivered in order, each frame's OnFrame before that peer's next Resolve.
class TransportSink {
 public:
  virtual ~TransportSink() = default;
  // Where the payload of a push or reply `header` from `peer` must go, written
  // to `out`. An error rejects the frame: the transport discards its payload
  // and reports OnFrame with that error. Either way `*context` (null unless
  // the core sets it) goes back with the frame's OnFrame.
  virtual absl::Status Resolve(NodeId peer, const FrameHeader& header, Destination& out,
                               FrameContext* context) = 0;
  // The frame (and its payload, now at the resolved destination) arrived, or
  // `status` says why it was rejected. `context`: what Resolve set for this
  // frame; null for frames that are not resolved (kError).
  virtual void OnFrame(NodeId peer, const FrameHeader& header, FrameContext context,
                       absl::Status status) = 0;
  // The peer is gone (closed, reset, timed out, failed auth, bad completion).
  // Every transport reports an orderly departure -- the peer's goodbye arrived,
  // after everything it had queued for us, before its connection closed -- as
  // CANCELLED, and any other loss with another code (UNAVAILABLE): the core
  // logs a departure at info and a loss at warning.
  virtual void OnPeerLost(NodeId peer, absl::Status why) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual absl::string_view name() const = 0;

  // Sets up local resources; the returned string is published in the roster.
  virtual absl::StatusOr<std::string> LocalEndpoint() = 0;
  // Connects to `peers` (the ones this node exchanges data with) by `deadline`.
  // `self` is this node's id, known only once the scheduler assigned the rank.
  // Workers initiate, servers accept. May be called again later with peers
  // that (re)joined.
  virtual absl::Status Connect(NodeId self, absl::Span<const PeerInfo> peers,
                               absl::Time deadline) = 0;

  // Whether payloads may move straight from/to memory on `device` (RDMA with
  // GPUDirect). Where not, the core stages them through pinned host memory it
  // registers instead; it also stages a device region whose RegisterRegion
  // failed, unless the options require GPUDirect.
  virtual bool CanAccess(const Device& device) const { return device.kind == DeviceKind::kCpu; }

  virtual absl::Status RegisterRegion(const RegionInfo& region) = 0;
  virtual absl::Status UnregisterRegion(RegionId id) = 0;

  // Sends header + `bytes` from `src` (inside registered region `src_region`)
  // to `peer`. `src_region == 0` marks a small unregistered payload (an error
  // frame's text, at most 4 KiB) that the transport must copy (RDMA: into its
  // own registered bounce buffer). One call at a time: the core's send
  // thread, or (SendNeverWaits) an application thread the core lets send
  // inline while its send thread is idle, serialized with it. Returns once the frame
  // is written or queued for that peer alone (TCP: the rest goes out when its
  // socket drains; RDMA: posted), so the source may still be read afterwards
  // — the core keeps sources untouched until the request completes (worker)
  // or the peer's next request arrives (server). How long it may wait:
  //   TCP: never. A peer whose queue is full: RESOURCE_EXHAUSTED naming it;
  //     one whose queue has not moved for the timeout is reported lost by
  //     Poll. UnregisterRegion fails (FAILED_PRECONDITION) while queued frames
  //     read it.
  //   RDMA: never either. A frame that cannot be posted yet -- the peer has
  //     not advertised the key, has `recv_depth` frames undelivered (no
  //     receive credit), or the QP's send queue is full -- waits in that
  //     peer's outbox, in order, and the receive thread posts it as the peer
  //     returns credits. A full outbox: RESOURCE_EXHAUSTED naming the peer.
  //     An outbox whose head has not moved for the timeout: the peer is
  //     reported lost by Poll, except when the head waits for an advert: that
  //     frame is dropped and reported to the sink as an error frame from the
  //     peer (DEADLINE_EXCEEDED naming the key), as a server refuses a push
  //     it cannot place. UnregisterRegion fails (FAILED_PRECONDITION) while
  //     queued frames read the region, and waits (fences) until posted
  //     frames that read it completed (docs/rdma.md).
  // The remote destination is the peer's region for (header.key, this node's slot).
  virtual absl::Status Send(NodeId peer, const FrameHeader& header, const void* src,
                            RegionId src_region, size_t bytes) = 0;
  // True when Send never waits for a peer (TCP): then a worker's Post with no
  // ready event may send on the caller's thread (MeshNode::TrySendInline).
  virtual bool SendNeverWaits() const { return false; }

  // Makes progress, calling `sink`, waiting at most `max_wait` when idle
  // (zero: never blocks). One caller at a time: the receive thread, or, where
  // PollFromAnyThread, whichever thread the core gave its poll to.
  virtual absl::Status Poll(TransportSink& sink, absl::Duration max_wait) = 0;
  // True when Poll may be called from any thread, one at a time, each call
  // seeing what the previous caller did (the core serializes callers with a
  // lock, which orders their memory): nothing in Poll belongs to one thread
  // (TCP). Then an application thread waiting for a frame polls the
  // transport itself (MeshNode::AwaitDriving) while the receive thread steps
  // aside, so the frame that ends the wait is read by the thread awaiting it.
  virtual bool PollFromAnyThread() const { return false; }
  // Wakes a Poll blocked in the kernel (from any thread).
  virtual void Wake() = 0;
  // A descriptor that is readable while Poll has something to do (an epoll
  // fd; Wake makes it readable too), for a transport that wraps this one and
  // sleeps on more descriptors than its own (libfabric: its CQ wait fds and
  // its control connection's). -1: none; a wrapper then sleeps in Poll.
  virtual int WaitFd() const { return -1; }

  // Closes every connection. Orderly: first sends what is queued (bounded by
  // the options' timeout per peer), then a goodbye, so peers see a departure
  // (OnPeerLost with CANCELLED), not a loss; a peer that does not read within
  // the bound gets no goodbye and sees a loss.
  virtual void Shutdown() = 0;
};

// Makes the transport a participant uses (tests inject fakes and decorators).
using TransportFactory =
    std::function<absl::StatusOr<std::unique_ptr<Transport>>(const MeshOptions& options)>;

// The host a transport's LocalEndpoint() advertises: node_host when set, else
// the address its listener binds (OptionsForRole resolved any interface).
inline const std::string& AdvertisedHost(const MeshOptions& options) {
  return options.node_host.empty() ? options.bind_host : options.node_host;
}

}  // namespace stepmesh::core
