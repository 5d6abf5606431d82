#pragma once
// The RDMA transport's class, shared by its phase files (internal to
// src/transport/rdma/; docs/rdma.md describes the protocol):
//   rdma_transport.cc     set-up (Open), the event loop (Poll), Shutdown, the factory
//   rdma_connect.cc       connecting: dialling or accepting, the hello/ready handshake,
//                         publishing a peer
//   rdma_registration.cc  registering regions, and releasing them: fences, withdrawals
//   rdma_send.cc          Send: prepared routes and sources, a frame's work requests
//   rdma_outbox.cc        the per-peer outbox: queueing, draining as credits return, stalls
//   rdma_receive.cc       receive completions, in-order delivery, credit returns, landing checks
//   rdma_control.cc       control messages on the bootstrap socket (adverts, withdrawals)
//   rdma_events.cc        asynchronous events and peer loss

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/event_loop.h"
#include "src/base/logging.h"
#include "src/base/net.h"
#include "src/base/sync.h"
#include "src/core/handshake.h"
#include "src/core/protocol.h"
#include "src/transport/rdma/bootstrap_listener.h"
#include "src/transport/rdma/peer_setup.h"
#include "src/transport/rdma/rdma_peer.h"
#include "src/transport/rdma/rdma_transport.h"
#include "src/transport/rdma/rdma_wire.h"
#include "src/transport/rdma/send_queue.h"
#include "src/transport/rdma/verbs_resources.h"
#include "stepmesh/status.h"

// Names this folder's files share (an internal namespace: no header outside
// src/transport/rdma/ includes this one).
namespace stepmesh::rdma::impl {

using base::ConnectTcp;
using base::ErrnoMessage;
using base::HostPort;
using base::Mutex;
using base::MutexLock;
using base::ParseHostPort;
using base::ReadFully;
using base::SetNoDelay;
using base::SetNonBlocking;
using base::UniqueFd;
using base::WriteFully;
using core::DecodeFrame;
using core::Destination;
using core::DialHandshake;
using core::EncodeFrame;
using core::FrameHeader;
using core::FrameType;
using core::kFrameBytes;
using core::kNoNode;
using core::NodeId;
using core::PeerInfo;
using core::PeerName;
using core::RegionId;
using core::RegionInfo;
using core::Transport;
using core::TransportSink;

using rdma::kRingStride;
using rdma::kSmallPayloadMax;

inline constexpr size_t kMaxPeers = 1024;  // connections over a transport's life (rejoins included)
inline constexpr int kPollBatch = 32;
inline constexpr size_t kPageBytes = 4096;
inline constexpr int kMaxChain = 16;               // work requests per ibv_post_send
inline constexpr uint64_t kMaxWrBytes = 1u << 30;  // and never more than the port's max_msg_sz
// Frames waiting for one peer's credits or adverts. A healthy peer needs none
// (the credit window covers what is in flight); the outbox grows on demand up
// to this, then Send fails RESOURCE_EXHAUSTED naming the peer.
inline constexpr size_t kMaxQueuedFrames = 4096;
inline constexpr size_t kInitialQueuedFrames = 16;

inline bool IsDataFrame(FrameType type) {
  return type == FrameType::kPush || type == FrameType::kReply;
}

struct ReceiveSlot {
  std::byte* data = nullptr;
  size_t bytes = 0;
};

struct LocalRegion {
  RegionInfo info;
  MrHandle local_mr;
  std::vector<MrHandle> slot_mrs;  // remote_writable: one MR per slot
};

// The send thread's prepared state: looked up once per (peer, key) and per
// source region, then reused frame after frame without a lock.
struct CachedRoute {
  Peer* peer = nullptr;
  Route* route = nullptr;
  uint64_t peers_version = 0;
};
struct CachedSource {
  const std::byte* base = nullptr;
  size_t bytes = 0;
  uint32_t lkey = 0;
  uint64_t version = 0;  // regions_version_ when looked up
};

class RdmaTransport final : public Transport {
 public:
  RdmaTransport(const MeshOptions& options, std::shared_ptr<VerbsApi> verbs)
      : verbs_(std::move(verbs)), options_(options), rdma_(options.rdma), peers_(kMaxPeers) {}

  ~RdmaTransport() override;

  absl::string_view name() const override { return "rdma"; }

  absl::Status Open();

  absl::StatusOr<std::string> LocalEndpoint() override {
    STEPMESH_ASSIGN_OR_RETURN(uint16_t port, listener_.port());
    return absl::StrCat(core::AdvertisedHost(options_), ":", port, "|", GidToString(port_.gid), "|",
                        port_.device_name, "/", int{port_.port});
  }

  absl::Status Connect(NodeId self, absl::Span<const PeerInfo> peers, absl::Time deadline) override;

  bool CanAccess(const Device& device) const override {
    return device.kind == DeviceKind::kCpu || rdma_.gpudirect != GpuDirect::kOff;
  }

  absl::Status RegisterRegion(const RegionInfo& info) override;

  // Memory is deregistered only when nothing can touch it any more: our own
  // writes reading it have completed (a fence behind them on every QP), and
  // every peer holding an rkey of one of its slots has acknowledged the
  // withdrawal (it fenced its own writes first). A peer that does neither
  // within options.timeout is failed -- its QPs in ERR -- before the MRs go.
  absl::Status UnregisterRegion(RegionId id) override;

  // Posts the frame now when nothing to `peer_id` waits and the peer has
  // what a post needs (its advert, a credit, send-queue room); otherwise
  // queues it behind the others to that peer, for the receive thread to post
  // as the peer's credits return. Never waits.
  absl::Status Send(NodeId peer_id, const FrameHeader& header, const void* src, RegionId src_region,
                    size_t bytes) override;

  absl::Status Poll(TransportSink& sink, absl::Duration max_wait) override;

  void Wake() override { loop_.Wake(); }

  // Frames already posted are delivered before the peer hears the goodbye:
  // the goodbye travels over TCP, which can overtake RDMA, so every QP first
  // drains (its requests acknowledged by the peer's NIC, i.e. placed), up to
  // options.timeout. Only QPs that did not drain are forced into ERR.
  void Shutdown() override;

 private:
  // Event-loop tokens besides peer tokens (base::EventLoop reserves ~0).
  static constexpr uint64_t kChannelToken = ~uint64_t{1};
  static constexpr uint64_t kAsyncToken = ~uint64_t{2};

  absl::Status Watch(int fd, uint64_t token) { return loop_.Watch(fd, EPOLLIN, token); }

  // [addr, addr + bytes) inside `region`. Device memory goes by its dma-buf
  // when the core exported one, mapped at its own address (the iova) so work
  // requests name it like host memory; otherwise by address, which for device
  // memory needs the peer-memory kernel module (nvidia-peermem). A NIC or
  // kernel that refuses dma-buf MRs (EOPNOTSUPP / EPROTONOSUPPORT: MLNX_OFED,
  // kernels before 5.12) gets the address instead, and from then on only that.
  absl::StatusOr<MrHandle> RegisterPart(const RegionInfo& region, void* addr, size_t bytes,
                                        int access);

  // Access flags every data MR gets besides the local/remote ones: relaxed
  // ordering unless turned off (an optional flag: providers without it drop it).
  int DataAccessFlags() const {
    return rdma_.relaxed_ordering == "off" ? 0 : IBV_ACCESS_RELAXED_ORDERING;
  }
  // Appended to an ENOMEM from a registration.
  std::string MemlockHint(size_t bytes) const {
    return absl::StrCat(" registering ", FormatBytes(bytes), MemlockAdvice(*verbs_));
  }

  // ---- Connection set-up ----

  absl::StatusOr<rdma::Hello> ReadHello(int fd, absl::Time deadline);

  // Builds the peer's QPs and memory, swaps hellos, brings the QPs to RTS,
  // swaps "ready", then publishes the peer.
  absl::Status Handshake(NodeId peer_id, UniqueFd fd, absl::Time deadline);

  // `*reporting`: the connection to the same node this one supersedes, when
  // that one was already being reported lost.
  absl::Status Publish(std::unique_ptr<Peer> peer, Peer** reporting);

  // ---- Send path ----

  absl::Status Gone(Peer& peer);

  absl::StatusOr<Peer*> PeerFor(NodeId id);

  // The prepared route for (peer, key): a hash lookup in the send thread's own
  // table; the locked lookups happen once, on the first frame.
  absl::StatusOr<const CachedRoute*> RouteFor(NodeId peer_id, uint64_t key);

  absl::StatusOr<CachedSource> SourceFor(RegionId id, const std::byte* src, size_t bytes);

  // ---- Posting and the per-peer outbox ----

  static bool HasCredit(const Peer& peer, const QueuePair& qp) {
    const uint64_t returned =
        std::atomic_ref<uint64_t>(*qp.mailbox).load(std::memory_order_acquire);
    return qp.frames_sent - returned < peer.depth;
  }

  // Posts `frame` (it may be partly posted already) or the part of it that
  // has room; nothing waits. `version`: the regions_version_ the source was
  // looked up under (a frame not yet queued), which must still hold.
  absl::Status Submit(Peer& peer, QueuedFrame& frame, std::optional<uint64_t> version);

  static void Pop(Outbox& box) ABSL_EXCLUSIVE_LOCKS_REQUIRED(box.mu);

  static std::string BlockedOn(Blocked blocked, uint64_t key);

  // Posts queued frames while the peer has what they need (outbox lock held).
  void DrainOutbox(Peer& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer.outbox.mu);

  // Receive thread: drains every backlogged outbox, and settles heads that
  // cannot go: a frame the peer never advertised a slot for within the
  // timeout (or whose slot is now too small) is dropped and reported to the
  // sink as an error frame of that peer's; a peer whose credits or send
  // queue have not moved for the timeout is lost.
  void ServiceOutboxes(TransportSink& sink);

  // Frames still queued when the connection goes are dropped with it.
  void ClearOutbox(Peer& peer);

  // Shutdown: queued frames go out first, while the peers return credits,
  // until `deadline`.
  void FlushOutboxes(absl::Time deadline);

  // Moves `frame` on as far as the peer allows: Blocked::kNothing once it is
  // wholly posted. Errors: the frame can never go (OUT_OF_RANGE), or the peer
  // is gone.
  absl::StatusOr<Blocked> Advance(Peer& peer, QueuedFrame& frame)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer.outbox.mu);

  // Posts what is left of a started frame: the striped chunk (QP 1) with
  // its immediate, then the payload and the frame itself, a WRITE_WITH_IMM of
  // the header (and a small payload) into the peer's ring on QP 0. RC
  // ordering within a QP makes the payload visible before the frame's
  // completion. False: a send queue is full (the progress is kept).
  absl::StatusOr<bool> PostStarted(Peer& peer, QueuedFrame& frame)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer.outbox.mu);

  // A payload's pieces (each at most max_msg_sz) from `*done` on, in chains
  // of at most kMaxChain (and never more than the queue holds); the last
  // chain ends with `tail` (a WRITE_WITH_IMM). True once the tail is posted;
  // false when the send queue is full (`*done` says how far it got).
  template <typename Valid>
  absl::StatusOr<bool> PostPieces(Peer& peer, QueuePair& qp, const std::byte* src, uint64_t remote,
                                  uint32_t rkey, uint32_t lkey, size_t bytes, size_t* done,
                                  ibv_send_wr* tail, ibv_sge* tail_sge, Valid& valid);

  enum class Drain { kDone, kPeerGone, kTimedOut };

  // A fence behind everything posted on each of `peer`'s QPs: the watermarks
  // to wait for.
  std::array<uint64_t, rdma::kMaxQpsPerPeer> FencePeer(Peer& peer, absl::Time deadline);

  // Fences every usable peer's QPs, then waits for all of them; per peer
  // (unusable ones: kDone).
  std::vector<Drain> DrainAll(absl::Time deadline);

  // Before a region is deregistered: every send that may read it completed.
  void DrainSends(absl::Time deadline, const std::string& why);

  // Whether every QP of `peer` completed up to `marks` by `deadline` (polling
  // the send CQs here: nobody else has to). A peer that hung up its bootstrap
  // connection will acknowledge nothing more (its QPs may be gone): waiting
  // for it would only run into the retry budget.
  Drain AwaitDrained(Peer& peer, const std::array<uint64_t, rdma::kMaxQpsPerPeer>& marks,
                     absl::Time deadline);

  // The peer closed its end of the bootstrap connection (left or died).
  static bool HungUp(const Peer& peer) {
    pollfd p{peer.socket.get(), POLLRDHUP, 0};
    return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
  }

  // ---- Withdrawing receive slots ----

  void WithdrawSlots(const RegionInfo& info, absl::Time deadline);

  void WakeAckWaiters() { MutexLock lock(&acks_mu_); }  // unlocking re-evaluates the waits

  // ---- Receive path ----

  absl::Status PostReceive(QueuePair& qp, uint32_t q);

  void ArmAll();

  void ConsumeCqEvents();

  // Reaps send CQs (the first real error of a QP is found here, not as a
  // flush later), acknowledges withdrawals whose fences completed, returns
  // credits that could not be written earlier, and reports failures.
  void Housekeep(TransportSink& sink);

  void ServiceAcks(Peer& peer);

  void ReportFailures(TransportSink& sink);

  int DrainCompletions(TransportSink& sink);

  int DrainPeer(Peer& peer, TransportSink& sink);

  void Fail(Peer& peer, absl::Status why) {
    peer.failure.Record(std::move(why), FailureRecord::kCause);
  }

  void OnReceive(Peer& peer, const ibv_wc& wc, TransportSink& sink);

  // Delivers QP 0's frames in order while their stripes are in. A frame
  // waiting for a stripe stays in its ring slot, its receive and credit held
  // back: the sender cannot get further ahead than its credit window.
  void DeliverReady(Peer& peer, TransportSink& sink);

  // Re-posts a consumed receive and, every quarter window, tells the peer.
  void Consumed(Peer& peer, QueuePair& qp, uint32_t q) {
    ++qp.delivered;
    if (absl::Status st = PostReceive(qp, q); !st.ok()) return Fail(peer, std::move(st));
    MaybeReturnCredits(peer, qp, /*any=*/false);
  }

  void MaybeReturnCredits(Peer& peer, QueuePair& qp, bool any);

  void Deliver(Peer& peer, const FrameHeader& header, absl::Span<const std::byte> small,
               TransportSink& sink);

  // The payload already sits in this node's slot for (key, writer); the core's
  // destination must be exactly that slot.
  absl::Status CheckLanding(NodeId writer, const FrameHeader& header, const Destination& dest);

  // ---- Asynchronous events ----

  void HandleAsyncEvents(TransportSink& sink);

  // An event on our own port: OK when it changes nothing peers depend on.
  absl::Status PortEvent(ibv_event_type type);

  // ---- Peer loss ----

  void ErrorQps(Peer& peer);

  void Lose(Peer& peer, TransportSink& sink, absl::Status why);

  void WakeRouteWaiters(Peer& peer) {
    MutexLock lock(&peer.route_mu);  // unlocking re-evaluates the waiters' conditions
  }

  Peer* FindPeer(NodeId id) {
    MutexLock lock(&peers_mu_);
    auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : it->second;
  }

  // ---- Control messages (bootstrap socket) ----

  void SendAdvert(Peer& peer, const LocalRegion& region, uint32_t slot);

  void WriteControl(Peer& peer, const std::byte* msg, size_t n);

  void ReadControl(Peer& peer, TransportSink& sink);

  static size_t BodyBytes(const Peer& peer) {
    return static_cast<size_t>(peer.rx[6]) | static_cast<size_t>(peer.rx[7]) << 8;
  }

  // Changes a route while holding every data QP's post lock: a post that
  // re-checks the route under that lock sees the change.
  void ChangeRoute(Peer& peer, Route& route, uint64_t addr, uint64_t bytes, uint32_t rkey,
                   bool live) {
    auto write = [&] { WriteRoute(route, addr, bytes, rkey, live); };
    if (peer.num_qps == 1) return peer.qps[0].sq.Exclusive(write);
    peer.qps[0].sq.Exclusive([&] { peer.qps[1].sq.Exclusive(write); });
  }

  void HandleControl(Peer& peer, TransportSink& sink);

  const std::shared_ptr<VerbsApi> verbs_;  // first: every handle below releases through it
  const MeshOptions options_;
  const RdmaOptions rdma_;
  PortChoice port_;
  std::atomic<bool> dmabuf_refused_{false};  // the NIC said EOPNOTSUPP to a dma-buf MR
  PdHandle pd_;
  ChannelHandle channel_;
  SetupContext setup_;
  uint64_t max_wr_bytes_ = kMaxWrBytes;
  BootstrapListener listener_;
  base::EventLoop loop_;  // the peers' sockets, the CQ channel, async events
  NodeId self_ = kNoNode;
  std::mt19937 rng_{std::random_device{}()};
  std::atomic<bool> shut_down_{false};
  uint64_t busy_polls_ = 0;
  std::atomic<size_t> pending_acks_{0};  // withdrawals still to acknowledge, all peers
  std::atomic<size_t> backlogged_{0};    // peers with frames queued
  QueuedFrame scratch_;                  // Send's frame (send thread only)

  Mutex regions_mu_;  // before peers_mu_, recv_mu_ and any peer's write_mu
  absl::flat_hash_map<RegionId, std::unique_ptr<LocalRegion>> regions_ ABSL_GUARDED_BY(regions_mu_);
  std::atomic<uint64_t> regions_version_{0};  // bumped when a region goes

  // Where each (key, writer) pair's payloads land: the slot advertised to it.
  // The receive thread's per-frame lock; the send path never takes it.
  Mutex recv_mu_;
  absl::flat_hash_map<std::pair<uint64_t, NodeId>, ReceiveSlot> receive_slots_
      ABSL_GUARDED_BY(recv_mu_);

  // Withdrawals waiting for the writer's acknowledgement: (peer token, key).
  Mutex acks_mu_;
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, int> awaited_acks_ ABSL_GUARDED_BY(acks_mu_);

  Mutex peers_mu_;
  absl::flat_hash_map<NodeId, Peer*> by_id_ ABSL_GUARDED_BY(peers_mu_);
  // Fixed-size: slots below peer_count_ never move, so the receive thread reads
  // them without the lock; a replaced peer stays until the transport goes.
  std::vector<std::unique_ptr<Peer>> peers_;
  std::atomic<size_t> peer_count_{0};
  std::atomic<uint64_t> peers_version_{0};  // bumped when a peer (re)connects

  // The send thread's own (Send is send-thread only): no lock.
  absl::flat_hash_map<std::pair<NodeId, uint64_t>, CachedRoute> route_cache_;
  absl::flat_hash_map<NodeId, std::pair<Peer*, uint64_t>> peer_cache_;
  absl::flat_hash_map<RegionId, CachedSource> source_cache_;
};

}  // namespace stepmesh::rdma::impl
