// The RDMA transport: set-up (Open), the event loop (Poll), Shutdown, and
// CreateRdmaTransport / RdmaDeviceAvailable.

#include "src/transport/rdma/rdma_transport.h"

#include "src/transport/rdma/rdma_transport_impl.h"

namespace stepmesh::rdma::impl {

RdmaTransport::~RdmaTransport() {
  Shutdown();
  // Unacknowledged CQ events would make ibv_destroy_cq wait forever.
  ConsumeCqEvents();
  // Peers (QPs, CQs, MRs) go before the regions, the channel, the PD and the context.
  for (auto& peer : peers_) peer.reset();
  regions_.clear();
}

absl::Status RdmaTransport::Open() {
  STEPMESH_RETURN_IF_ERROR(rdma_.Validate());
  // Before any registration: PyTorch's DataLoader (and anything else that
  // forks) must not leave the child sharing pinned pages with the parent.
  // A kernel that copies pinned pages on fork needs none of it, and
  // ibv_fork_init would then only madvise(DONTFORK) every registration.
  const ibv_fork_status fork = verbs_->IsForkInitialized();
  if (rdma_.fork_init == "on" || (rdma_.fork_init == "auto" && fork != IBV_FORK_UNNEEDED)) {
    if (const int rc = verbs_->ForkInit(); rc != 0) {
      STEPMESH_LOG(kWarning, "rdma: ", ErrnoMessage("ibv_fork_init", rc),
                   "; registered memory is not fork-safe in this process");
    }
  }
  STEPMESH_ASSIGN_OR_RETURN(port_, OpenPort(*verbs_, options_));
  // Every peer's control block is pinned before any tensor: a container's
  // default RLIMIT_MEMLOCK (64 KiB, or 8 MiB) fails the first Connect with
  // a bare ENOMEM otherwise.
  const int peers = options_.role == Role::kWorker ? options_.num_servers : options_.num_workers;
  STEPMESH_RETURN_IF_ERROR(CheckMemlock(
      *verbs_,
      uint64_t(std::max(peers, 1)) * ControlBlockBytes(static_cast<uint32_t>(rdma_.qps_per_peer),
                                                       static_cast<uint32_t>(rdma_.recv_depth)),
      absl::StrCat("connecting to ", peers, " peer(s) with ", rdma_.qps_per_peer,
                   " QP(s) of STEPMESH_RDMA_RECV_DEPTH=", rdma_.recv_depth)));
  ibv_device_attr device{};
  if (const int rc = verbs_->QueryDevice(port_.context.get(), &device); rc != 0) {
    return absl::InternalError(ErrnoMessage("rdma: ibv_query_device", rc));
  }
  max_wr_bytes_ =
      port_.max_msg_sz > 0 ? std::min<uint64_t>(port_.max_msg_sz, kMaxWrBytes) : kMaxWrBytes;
  pd_ = PdHandle(verbs_.get(), verbs_->AllocPd(port_.context.get()));
  if (!pd_) return absl::InternalError(ErrnoMessage("rdma: ibv_alloc_pd", errno));
  channel_ = ChannelHandle(verbs_.get(), verbs_->CreateCompChannel(port_.context.get()));
  if (!channel_) return absl::InternalError(ErrnoMessage("rdma: ibv_create_comp_channel", errno));
  setup_.verbs = verbs_.get();
  setup_.port = &port_;
  setup_.options = &rdma_;
  setup_.pd = pd_.get();
  setup_.channel = channel_.get();
  setup_.max_qp_wr = static_cast<uint32_t>(std::max(device.max_qp_wr, 1));
  setup_.max_cqe = static_cast<uint32_t>(std::max(device.max_cqe, 1));
  STEPMESH_RETURN_IF_ERROR(SetNonBlocking(channel_->fd, true));
  STEPMESH_RETURN_IF_ERROR(SetNonBlocking(port_.context->async_fd, true));
  absl::StatusOr<base::EventLoop> loop = base::EventLoop::Create();
  if (!loop.ok()) return absl::InternalError(absl::StrCat("rdma: ", loop.status().message()));
  loop_ = *std::move(loop);
  STEPMESH_RETURN_IF_ERROR(Watch(channel_->fd, kChannelToken));
  STEPMESH_RETURN_IF_ERROR(Watch(port_.context->async_fd, kAsyncToken));
  STEPMESH_ASSIGN_OR_RETURN(listener_, BootstrapListener::Listen(options_.bind_host));
  STEPMESH_LOG(kInfo, "rdma: ", port_.device_name, " chosen: ", port_.why);
  STEPMESH_LOG(kInfo, "rdma: using ", port_.device_name, " port ", int{port_.port},
               port_.roce() ? " (RoCE)" : absl::StrCat(" (InfiniBand, LID ", port_.lid, ")"),
               " GID index ", port_.gid_index, " (", GidToString(port_.gid), ")");
  // A bonded (LAG) device: each of a peer's QPs gets its own physical port
  // (BringUp), so striped payloads use both links instead of one hash bucket.
  if (uint8_t lag = 0;
      rdma_.qps_per_peer > 1 && verbs_->QueryLagPorts(port_.context.get(), &lag) == 0 && lag > 1) {
    setup_.lag_ports = lag;
    STEPMESH_LOG(kInfo, "rdma: ", port_.device_name, " bonds ", int{lag},
                 " ports; QP q of each peer goes out on LAG port 1 + q % ", int{lag});
  }
  return absl::OkStatus();
}

absl::Status RdmaTransport::Poll(TransportSink& sink, absl::Duration max_wait) {
  int work = DrainCompletions(sink);
  // Credits come back by RDMA into the mailboxes, which wake nobody.
  const bool backlogged = backlogged_.load(std::memory_order_acquire) > 0;
  if (backlogged) ServiceOutboxes(sink);
  // Busy, or spinning (no wait): sockets, events and send CQs every 64th call.
  const bool may_block = work == 0 && max_wait > absl::ZeroDuration();
  if (!may_block && (++busy_polls_ & 63) != 0) return absl::OkStatus();
  Housekeep(sink);
  int timeout_ms = 0;
  if (work == 0 && max_wait > absl::ZeroDuration()) {
    // Arm, then look once more: a completion between the drain and the arm
    // would otherwise sleep until the next one.
    ArmAll();
    work = DrainCompletions(sink);
    if (work == 0) {
      timeout_ms = static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(max_wait)));
      // Fences behind a withdrawal complete on send CQs, which wake nobody;
      // returned credits neither.
      if (pending_acks_.load(std::memory_order_relaxed) > 0 || backlogged) timeout_ms = 1;
    }
  }
  epoll_event events[16];
  bool woken = false;
  absl::StatusOr<int> ready = loop_.Wait(events, 16, work > 0 ? 0 : timeout_ms, &woken);
  if (!ready.ok()) return absl::InternalError(absl::StrCat("rdma: ", ready.status().message()));
  const int n = *ready;
  for (int i = 0; i < n; ++i) {
    const uint64_t token = events[i].data.u64;
    if (token == kChannelToken) {
      ConsumeCqEvents();
    } else if (token == kAsyncToken) {
      HandleAsyncEvents(sink);
    } else if (token < kMaxPeers) {
      Peer* peer = peers_[token].get();
      if (peer != nullptr && !peer->lost) ReadControl(*peer, sink);
    }
  }
  if (n > 0 || woken) {
    DrainCompletions(sink);
    ReportFailures(sink);
  }
  return absl::OkStatus();
}

void RdmaTransport::Shutdown() {
  if (shut_down_.exchange(true)) return;
  WakeAckWaiters();
  const absl::Time deadline = absl::Now() + options_.timeout;
  FlushOutboxes(deadline);
  const std::vector<Drain> drained = DrainAll(deadline);
  const size_t count = drained.size();
  std::byte bye[rdma::kBootHeaderBytes];
  const size_t n = rdma::EncodeEmpty(rdma::BootType::kGoodbye, bye);
  for (size_t i = 0; i < count; ++i) {
    Peer& peer = *peers_[i];
    if (peer.lost.exchange(true)) continue;
    bool queued;
    {
      MutexLock box(&peer.outbox.mu);
      queued = peer.outbox.size > 0;
    }
    {
      MutexLock lock(&peer.write_mu);
      // A goodbye only behind everything queued: a peer whose frames did
      // not all go sees a loss.
      if (!queued) (void)::send(peer.socket.get(), bye, n, MSG_NOSIGNAL | MSG_DONTWAIT);
      loop_.Unwatch(peer.socket.get());
      ::shutdown(peer.socket.get(), SHUT_RDWR);
    }
    if (drained[i] == Drain::kTimedOut || queued) {
      STEPMESH_LOG(kWarning, "rdma: ", PeerName(peer.id), " did not acknowledge everything sent ",
                   "within ", absl::FormatDuration(options_.timeout), " before shutdown");
    }
    if (drained[i] != Drain::kDone || queued) ErrorQps(peer);
    ClearOutbox(peer);
    WakeRouteWaiters(peer);
  }
}

}  // namespace stepmesh::rdma::impl

namespace stepmesh::rdma {

absl::StatusOr<std::unique_ptr<core::Transport>> CreateRdmaTransport(
    const MeshOptions& options, std::shared_ptr<VerbsApi> verbs) {
  if (verbs == nullptr) {
    STEPMESH_ASSIGN_OR_RETURN(verbs, MakeRealVerbsApi());
  }
  auto transport = std::make_unique<impl::RdmaTransport>(options, std::move(verbs));
  STEPMESH_RETURN_IF_ERROR(transport->Open());
  return transport;
}

bool RdmaDeviceAvailable() {
  absl::StatusOr<std::shared_ptr<VerbsApi>> verbs = MakeRealVerbsApi();
  return verbs.ok() && OpenPort(**verbs, MeshOptions()).ok();
}

}  // namespace stepmesh::rdma
