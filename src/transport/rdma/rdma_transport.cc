#include "src/transport/rdma/rdma_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
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
#include "src/base/logging.h"
#include "src/base/net.h"
#include "src/base/sync.h"
#include "src/core/handshake.h"
#include "src/core/protocol.h"
#include "src/transport/rdma/bootstrap_listener.h"
#include "src/transport/rdma/peer_setup.h"
#include "src/transport/rdma/rdma_peer.h"
#include "src/transport/rdma/rdma_wire.h"
#include "src/transport/rdma/send_queue.h"
#include "src/transport/rdma/verbs_resources.h"
#include "stepmesh/status.h"

namespace stepmesh::rdma {
namespace {

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

constexpr size_t kMaxPeers = 1024;  // connections over a transport's life (rejoins included)
constexpr int kPollBatch = 32;
constexpr size_t kPageBytes = 4096;
constexpr int kMaxChain = 16;               // work requests per ibv_post_send
constexpr uint64_t kMaxWrBytes = 1u << 30;  // and never more than the port's max_msg_sz
// Frames waiting for one peer's credits or adverts. A healthy peer needs none
// (the credit window covers what is in flight); the outbox grows on demand up
// to this, then Send fails RESOURCE_EXHAUSTED naming the peer.
constexpr size_t kMaxQueuedFrames = 4096;
constexpr size_t kInitialQueuedFrames = 16;

bool IsDataFrame(FrameType type) { return type == FrameType::kPush || type == FrameType::kReply; }

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

// Builds a chain of RDMA writes of [src, src + bytes) to [remote, ...) in
// pieces of at most `max_piece` bytes; returns how many it filled (<= room).
int FillPieces(const std::byte* src, uint64_t remote, uint32_t rkey, uint32_t lkey, size_t bytes,
               size_t max_piece, ibv_sge* sges, ibv_send_wr* wrs, int room) {
  int n = 0;
  for (size_t done = 0; done < bytes && n < room; ++n) {
    const size_t piece = std::min(bytes - done, max_piece);
    sges[n] = {reinterpret_cast<uintptr_t>(src + done), static_cast<uint32_t>(piece), lkey};
    wrs[n] = ibv_send_wr{};
    wrs[n].opcode = IBV_WR_RDMA_WRITE;
    wrs[n].wr.rdma.remote_addr = remote + done;
    wrs[n].wr.rdma.rkey = rkey;
    done += piece;
  }
  return n;
}

void Link(ibv_sge* sges, ibv_send_wr* wrs, int n) {
  for (int i = 0; i < n; ++i) {
    wrs[i].sg_list = &sges[i];
    wrs[i].num_sge = 1;
    wrs[i].next = i + 1 < n ? &wrs[i + 1] : nullptr;
  }
}

class RdmaTransport final : public Transport {
 public:
  RdmaTransport(const MeshOptions& options, std::shared_ptr<VerbsApi> verbs)
      : verbs_(std::move(verbs)), options_(options), rdma_(options.rdma), peers_(kMaxPeers) {}

  ~RdmaTransport() override {
    Shutdown();
    // Unacknowledged CQ events would make ibv_destroy_cq wait forever.
    ConsumeCqEvents();
    // Peers (QPs, CQs, MRs) go before the regions, the channel, the PD and the context.
    for (auto& peer : peers_) peer.reset();
    regions_.clear();
  }

  absl::string_view name() const override { return "rdma"; }

  absl::Status Open() {
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
    epoll_fd_.Reset(::epoll_create1(EPOLL_CLOEXEC));
    wake_fd_.Reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!epoll_fd_.valid() || !wake_fd_.valid()) {
      return absl::InternalError(ErrnoMessage("rdma: epoll/eventfd", errno));
    }
    STEPMESH_RETURN_IF_ERROR(Watch(wake_fd_.get(), kWakeToken));
    STEPMESH_RETURN_IF_ERROR(Watch(channel_->fd, kChannelToken));
    STEPMESH_RETURN_IF_ERROR(Watch(port_.context->async_fd, kAsyncToken));
    STEPMESH_ASSIGN_OR_RETURN(listener_, BootstrapListener::Listen(options_.bind_host));
    STEPMESH_LOG(kInfo, "rdma: ", port_.device_name, " chosen: ", port_.why);
    STEPMESH_LOG(kInfo, "rdma: using ", port_.device_name, " port ", int{port_.port},
                 port_.roce() ? " (RoCE)" : absl::StrCat(" (InfiniBand, LID ", port_.lid, ")"),
                 " GID index ", port_.gid_index, " (", GidToString(port_.gid), ")");
    // A bonded (LAG) device: each of a peer's QPs gets its own physical port
    // (BringUp), so striped payloads use both links instead of one hash bucket.
    if (uint8_t lag = 0; rdma_.qps_per_peer > 1 &&
                         verbs_->QueryLagPorts(port_.context.get(), &lag) == 0 && lag > 1) {
      setup_.lag_ports = lag;
      STEPMESH_LOG(kInfo, "rdma: ", port_.device_name, " bonds ", int{lag},
                   " ports; QP q of each peer goes out on LAG port 1 + q % ", int{lag});
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> LocalEndpoint() override {
    STEPMESH_ASSIGN_OR_RETURN(uint16_t port, listener_.port());
    return absl::StrCat(core::AdvertisedHost(options_), ":", port, "|", GidToString(port_.gid), "|",
                        port_.device_name, "/", int{port_.port});
  }

  absl::Status Connect(NodeId self, absl::Span<const PeerInfo> peers,
                       absl::Time deadline) override {
    self_ = self;
    setup_.self = self;
    std::vector<NodeId> expected;
    for (const PeerInfo& info : peers) {
      if (!core::IsWorker(self_)) {
        expected.push_back(info.id);
        continue;
      }
      STEPMESH_ASSIGN_OR_RETURN(HostPort where,
                                ParseHostPort(info.endpoint.substr(0, info.endpoint.find('|'))));
      absl::StatusOr<UniqueFd> fd = ConnectTcp(where, deadline);
      if (!fd.ok()) {
        return absl::UnavailableError(absl::StrCat("rdma: connecting to ", PeerName(info.id),
                                                   " at ", info.endpoint, ": ",
                                                   fd.status().message()));
      }
      STEPMESH_RETURN_IF_ERROR(
          DialHandshake(fd->get(), self_, info.id, options_.auth_token, deadline));
      STEPMESH_RETURN_IF_ERROR(Handshake(info.id, *std::move(fd), deadline));
    }
    while (!expected.empty()) {
      // Who dials, and (with a secret) proof of it, before any verbs resource
      // is built; every accepted socket's handshake runs at once, capped, so
      // silent or hostile clients cannot keep a real peer waiting.
      absl::StatusOr<std::pair<NodeId, UniqueFd>> accepted =
          listener_.AcceptOne(self_, expected, options_.auth_token, deadline);
      if (!accepted.ok()) {
        return absl::DeadlineExceededError(absl::StrCat(
            "rdma: ", expected.size(), " peer(s) never connected: ", accepted.status().message()));
      }
      auto& [from, fd] = *accepted;
      expected.erase(std::find(expected.begin(), expected.end(), from));
      STEPMESH_RETURN_IF_ERROR(Handshake(from, std::move(fd), deadline));
    }
    return absl::OkStatus();
  }

  bool CanAccess(const Device& device) const override {
    return device.kind == DeviceKind::kCpu || rdma_.gpudirect != GpuDirect::kOff;
  }

  absl::Status RegisterRegion(const RegionInfo& info) override {
    if (info.base == nullptr || info.bytes() == 0) {
      return absl::InvalidArgumentError("rdma: empty region");
    }
    if (info.remote_writable && info.slot_peers.size() != info.num_slots) {
      return absl::InvalidArgumentError("rdma: slot_peers must name every slot's writer");
    }
    auto region = std::make_unique<LocalRegion>();
    region->info = info;
    // Local access only for sending; receive slots get REMOTE_WRITE, one MR each,
    // so a peer's rkey reaches only the slot it owns.
    const std::string what =
        absl::StrCat("rdma: registering region ", info.id, " (", DeviceName(info.device),
                     info.dmabuf_fd >= 0 ? " memory by dma-buf)" : " memory)");
    const int ordering = DataAccessFlags();
    // A receive region gets only its per-slot MRs: a whole-region MR as well
    // would pin every page twice against RLIMIT_MEMLOCK (the kernel charges
    // each MR on its own). Local access (a send from it) goes by the slot's MR.
    if (!info.remote_writable) {
      absl::StatusOr<MrHandle> local =
          RegisterPart(info, info.base, info.bytes(), IBV_ACCESS_LOCAL_WRITE | ordering);
      if (!local.ok()) {
        return absl::InternalError(absl::StrCat(what, ": ", local.status().message()));
      }
      region->local_mr = *std::move(local);
    } else {
      for (uint32_t slot = 0; slot < info.num_slots; ++slot) {
        absl::StatusOr<MrHandle> mr = RegisterPart(
            info, static_cast<std::byte*>(info.base) + slot * info.slot_bytes, info.slot_bytes,
            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | ordering);
        if (!mr.ok()) {
          return absl::InternalError(
              absl::StrCat(what, ", slot ", slot, ": ", mr.status().message()));
        }
        region->slot_mrs.push_back(*std::move(mr));
      }
    }
    MutexLock lock(&regions_mu_);
    if (regions_.contains(info.id)) {
      return absl::AlreadyExistsError(absl::StrCat("rdma: region ", info.id, " registered twice"));
    }
    {
      MutexLock slots(&recv_mu_);
      for (NodeId writer : info.slot_peers) {
        if (receive_slots_.contains({info.key, writer})) {
          return absl::AlreadyExistsError(absl::StrCat(
              "rdma: ", PeerName(writer), " already has a receive slot for key ", info.key));
        }
      }
      for (uint32_t slot = 0; info.remote_writable && slot < info.num_slots; ++slot) {
        receive_slots_[{info.key, info.slot_peers[slot]}] = ReceiveSlot{
            static_cast<std::byte*>(info.base) + slot * info.slot_bytes, info.slot_bytes};
      }
    }
    LocalRegion* raw = region.get();
    regions_.emplace(info.id, std::move(region));
    for (uint32_t slot = 0; info.remote_writable && slot < info.num_slots; ++slot) {
      if (Peer* peer = FindPeer(info.slot_peers[slot]); peer != nullptr && peer->usable()) {
        SendAdvert(*peer, *raw, slot);
      }
    }
    return absl::OkStatus();
  }

  // Memory is deregistered only when nothing can touch it any more: our own
  // writes reading it have completed (a fence behind them on every QP), and
  // every peer holding an rkey of one of its slots has acknowledged the
  // withdrawal (it fenced its own writes first). A peer that does neither
  // within options.timeout is failed -- its QPs in ERR -- before the MRs go.
  absl::Status UnregisterRegion(RegionId id) override {
    std::unique_ptr<LocalRegion> region;
    {
      MutexLock lock(&regions_mu_);
      auto it = regions_.find(id);
      if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("rdma: no region ", id));
      // Sends that looked the source up before this abort at their post (or
      // are queued, and seen below).
      regions_version_.fetch_add(1, std::memory_order_acq_rel);
      // Frames still queued read their payload from the region when their
      // peer returns credits: it must stay until they are out.
      const size_t count = peer_count_.load(std::memory_order_acquire);
      for (size_t i = 0; i < count; ++i) {
        Peer& peer = *peers_[i];
        MutexLock box(&peer.outbox.mu);
        for (size_t f = 0; f < peer.outbox.size; ++f) {
          if (peer.outbox.at(f).region == id) {
            return absl::FailedPreconditionError(
                absl::StrCat("rdma: region ", id, " still has frames queued to ", PeerName(peer.id),
                             " (slow to return credits); try again"));
          }
        }
      }
      region = std::move(it->second);
      regions_.erase(it);
      MutexLock slots(&recv_mu_);
      for (NodeId writer : region->info.slot_peers)
        receive_slots_.erase({region->info.key, writer});
    }
    const absl::Time deadline = absl::Now() + options_.timeout;
    DrainSends(deadline, /*why=*/absl::StrCat("deregistering region ", id));
    if (region->info.remote_writable) WithdrawSlots(region->info, deadline);
    return absl::OkStatus();  // the MRs are deregistered as `region` goes
  }

  // Posts the frame now when nothing to `peer_id` waits and the peer has
  // what a post needs (its advert, a credit, send-queue room); otherwise
  // queues it behind the others to that peer, for the receive thread to post
  // as the peer's credits return. Never waits.
  absl::Status Send(NodeId peer_id, const FrameHeader& header, const void* src, RegionId src_region,
                    size_t bytes) override {
    const auto* source = static_cast<const std::byte*>(src);
    QueuedFrame& frame = scratch_;
    frame.header = header;
    frame.src = source;
    frame.route = nullptr;
    frame.region = src_region;
    frame.lkey = 0;
    frame.started = false;
    if (!IsDataFrame(header.type)) {
      STEPMESH_ASSIGN_OR_RETURN(Peer * peer, PeerFor(peer_id));
      frame.bytes = std::min(bytes, kSmallPayloadMax);  // error text beyond this is cut
      frame.header.payload_bytes = frame.bytes;
      return Submit(*peer, frame, std::nullopt);
    }
    if (header.payload_bytes != bytes) {
      return absl::InvalidArgumentError("rdma: header.payload_bytes differs from the payload");
    }
    frame.bytes = bytes;
    if (bytes == 0) {  // an acknowledgement: no advert, no payload write
      STEPMESH_ASSIGN_OR_RETURN(Peer * peer, PeerFor(peer_id));
      return Submit(*peer, frame, std::nullopt);
    }
    // A source that changes between the lookup and the post (a
    // deregistration) aborts the post; look once more.
    for (int attempt = 0;; ++attempt) {
      STEPMESH_ASSIGN_OR_RETURN(const CachedRoute* cached, RouteFor(peer_id, header.key));
      Peer& peer = *cached->peer;
      if (!peer.usable()) return Gone(peer);
      const RouteView view = ReadRoute(*cached->route);
      if (view.live && bytes > view.bytes) {
        return absl::OutOfRangeError(absl::StrCat("rdma: ", bytes, " bytes for key ", header.key,
                                                  " exceed the peer's slot of ", view.bytes));
      }
      STEPMESH_ASSIGN_OR_RETURN(const CachedSource source_info,
                                SourceFor(src_region, source, bytes));
      frame.route = cached->route;
      frame.lkey = source_info.lkey;
      absl::Status sent = Submit(peer, frame, source_info.version);
      if (!absl::IsAborted(sent) || attempt == 2) return sent;
    }
  }

  absl::Status Poll(TransportSink& sink, absl::Duration max_wait) override {
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
    const int n = ::epoll_wait(epoll_fd_.get(), events, 16, work > 0 ? 0 : timeout_ms);
    if (n < 0) {
      if (errno == EINTR) return absl::OkStatus();
      return absl::InternalError(ErrnoMessage("rdma: epoll_wait", errno));
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t token = events[i].data.u64;
      if (token == kWakeToken) {
        uint64_t drain;
        (void)!::read(wake_fd_.get(), &drain, sizeof(drain));
      } else if (token == kChannelToken) {
        ConsumeCqEvents();
      } else if (token == kAsyncToken) {
        HandleAsyncEvents(sink);
      } else if (token < kMaxPeers) {
        Peer* peer = peers_[token].get();
        if (peer != nullptr && !peer->lost) ReadControl(*peer, sink);
      }
    }
    if (n > 0) {
      DrainCompletions(sink);
      ReportFailures(sink);
    }
    return absl::OkStatus();
  }

  void Wake() override {
    const uint64_t one = 1;
    if (wake_fd_.valid()) (void)!::write(wake_fd_.get(), &one, sizeof(one));
  }

  // Frames already posted are delivered before the peer hears the goodbye:
  // the goodbye travels over TCP, which can overtake RDMA, so every QP first
  // drains (its requests acknowledged by the peer's NIC, i.e. placed), up to
  // options.timeout. Only QPs that did not drain are forced into ERR.
  void Shutdown() override {
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
        ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, peer.socket.get(), nullptr);
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

 private:
  static constexpr uint64_t kWakeToken = ~uint64_t{0};
  static constexpr uint64_t kChannelToken = ~uint64_t{1};
  static constexpr uint64_t kAsyncToken = ~uint64_t{2};

  absl::Status Watch(int fd, uint64_t token) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = token;
    if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      return absl::InternalError(ErrnoMessage("rdma: epoll_ctl", errno));
    }
    return absl::OkStatus();
  }

  // [addr, addr + bytes) inside `region`. Device memory goes by its dma-buf
  // when the core exported one, mapped at its own address (the iova) so work
  // requests name it like host memory; otherwise by address, which for device
  // memory needs the peer-memory kernel module (nvidia-peermem). A NIC or
  // kernel that refuses dma-buf MRs (EOPNOTSUPP / EPROTONOSUPPORT: MLNX_OFED,
  // kernels before 5.12) gets the address instead, and from then on only that.
  absl::StatusOr<MrHandle> RegisterPart(const RegionInfo& region, void* addr, size_t bytes,
                                        int access) {
    std::string dmabuf_error;
    if (region.dmabuf_fd >= 0 && !dmabuf_refused_.load(std::memory_order_relaxed)) {
      const uint64_t offset =
          region.dmabuf_offset + static_cast<uint64_t>(static_cast<std::byte*>(addr) -
                                                       static_cast<std::byte*>(region.base));
      MrHandle mr(verbs_.get(),
                  verbs_->RegDmabufMr(pd_.get(), offset, bytes, reinterpret_cast<uintptr_t>(addr),
                                      region.dmabuf_fd, access));
      if (mr) return mr;
      const int error = errno;
      dmabuf_error = ErrnoMessage("ibv_reg_dmabuf_mr", error);
      if (error != EOPNOTSUPP && error != EPROTONOSUPPORT) {
        return absl::InternalError(dmabuf_error);
      }
      if (!dmabuf_refused_.exchange(true)) {
        STEPMESH_LOG(kWarning, "rdma: ", port_.device_name, " refuses dma-buf memory regions (",
                     dmabuf_error,
                     "); registering device memory by address (peer memory, nvidia-peermem) "
                     "instead");
      }
    }
    MrHandle mr(verbs_.get(), verbs_->RegMr(pd_.get(), addr, bytes, access));
    if (mr) return mr;
    const int error = errno;
    std::string message = ErrnoMessage(
        region.device.kind == DeviceKind::kCpu ? "ibv_reg_mr" : "ibv_reg_mr (peer memory)", error);
    if (!dmabuf_error.empty()) message = absl::StrCat(dmabuf_error, ", then ", message);
    if (region.dmabuf_fd >= 0 && dmabuf_error.empty()) {
      absl::StrAppend(&message, " (dma-buf refused earlier)");
    }
    if (error == ENOMEM) absl::StrAppend(&message, MemlockHint(bytes));
    return absl::InternalError(message);
  }

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

  absl::StatusOr<rdma::Hello> ReadHello(int fd, absl::Time deadline) {
    std::byte head[rdma::kBootHeaderBytes];
    STEPMESH_RETURN_IF_ERROR(ReadFully(fd, head, sizeof(head), deadline));
    STEPMESH_ASSIGN_OR_RETURN(rdma::BootHeader h, rdma::DecodeBootHeader(head));
    if (h.type != rdma::BootType::kHello) return absl::DataLossError("rdma: expected a hello");
    std::byte body[rdma::kMaxBootBody];
    STEPMESH_RETURN_IF_ERROR(ReadFully(fd, body, h.body_bytes, deadline));
    return rdma::DecodeHello(body, h.body_bytes);
  }

  // Builds the peer's QPs and memory, swaps hellos, brings the QPs to RTS,
  // swaps "ready", then publishes the peer.
  absl::Status Handshake(NodeId peer_id, UniqueFd fd, absl::Time deadline) {
    auto peer = std::make_unique<Peer>();
    peer->id = peer_id;
    peer->num_qps = static_cast<uint32_t>(rdma_.qps_per_peer);
    peer->depth = static_cast<uint32_t>(rdma_.recv_depth);
    rdma::Hello mine;
    STEPMESH_RETURN_IF_ERROR(BuildPeer(setup_, rng_, *peer, mine));
    std::byte msg[rdma::kBootHeaderBytes + rdma::kMaxBootBody];
    const size_t len = rdma::EncodeHello(mine, msg);
    // Both ends write, then read: the hellos are small enough for the socket buffers.
    STEPMESH_RETURN_IF_ERROR(WriteFully(fd.get(), msg, len, deadline));
    STEPMESH_ASSIGN_OR_RETURN(rdma::Hello theirs, ReadHello(fd.get(), deadline));
    if (theirs.node != peer_id) {
      return absl::FailedPreconditionError(
          absl::StrCat("rdma: expected ", PeerName(peer_id), ", reached ", PeerName(theirs.node)));
    }
    if (theirs.num_qps != peer->num_qps || theirs.recv_depth != peer->depth) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rdma: ", PeerName(peer_id), " uses ", theirs.num_qps, " QPs x ", theirs.recv_depth,
          " receives, this node ", peer->num_qps, " x ", peer->depth,
          " (rdma.qps_per_peer and rdma.recv_depth must match across the mesh)"));
    }
    STEPMESH_RETURN_IF_ERROR(BringUp(setup_, *peer, theirs));
    const size_t ready = rdma::EncodeEmpty(rdma::BootType::kReady, msg);
    STEPMESH_RETURN_IF_ERROR(WriteFully(fd.get(), msg, ready, deadline));
    std::byte head[rdma::kBootHeaderBytes];
    STEPMESH_RETURN_IF_ERROR(ReadFully(fd.get(), head, sizeof(head), deadline));
    STEPMESH_ASSIGN_OR_RETURN(rdma::BootHeader h, rdma::DecodeBootHeader(head));
    if (h.type != rdma::BootType::kReady || h.body_bytes != 0) {
      return absl::DataLossError("rdma: expected ready");
    }
    STEPMESH_RETURN_IF_ERROR(SetNoDelay(fd.get()));
    STEPMESH_RETURN_IF_ERROR(SetNonBlocking(fd.get(), true));
    peer->socket = std::move(fd);
    Peer* reporting = nullptr;
    STEPMESH_RETURN_IF_ERROR(Publish(std::move(peer), &reporting));
    // The connection this one replaces was being reported lost as it was
    // superseded: let that report reach the core before Connect returns, so
    // the core never takes the old connection's end for the new one's.
    if (reporting != nullptr) {
      const absl::Time until = std::min(deadline, absl::Now() + options_.timeout);
      while (!reporting->loss_reported.load() && !shut_down_.load() && absl::Now() < until) {
        absl::SleepFor(absl::Microseconds(100));
      }
    }
    return absl::OkStatus();
  }

  // `*reporting`: the connection to the same node this one supersedes, when
  // that one was already being reported lost.
  absl::Status Publish(std::unique_ptr<Peer> peer, Peer** reporting) {
    MutexLock regions_lock(&regions_mu_);
    Peer* raw = peer.get();
    {
      MutexLock lock(&peers_mu_);
      const size_t slot = peer_count_.load(std::memory_order_relaxed);
      if (slot >= kMaxPeers) return absl::ResourceExhaustedError("rdma: too many connections");
      raw->token = slot;
      if (auto it = by_id_.find(raw->id); it != by_id_.end() && it->second->lost.load()) {
        *reporting = it->second;
      } else if (it != by_id_.end() && !it->second->lost.exchange(true)) {
        // A rejoin replaces a connection never reported lost (the core learns
        // of the new process from the scheduler). Its socket leaves the epoll
        // set too: a closed socket would keep it readable forever.
        Peer& old = *it->second;
        ErrorQps(old);
        ClearOutbox(old);
        ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, old.socket.get(), nullptr);
        ::shutdown(old.socket.get(), SHUT_RDWR);
        WakeRouteWaiters(old);
      }
      by_id_[raw->id] = raw;
      peers_[slot] = std::move(peer);
      peer_count_.store(slot + 1, std::memory_order_release);
      peers_version_.fetch_add(1, std::memory_order_acq_rel);  // send-thread caches look again
    }
    WakeAckWaiters();
    STEPMESH_RETURN_IF_ERROR(Watch(raw->socket.get(), raw->token));
    for (const auto& [id, region] : regions_) {
      const RegionInfo& info = region->info;
      if (!info.remote_writable) continue;
      for (uint32_t slot = 0; slot < info.num_slots; ++slot) {
        if (info.slot_peers[slot] == raw->id) SendAdvert(*raw, *region, slot);
      }
    }
    return absl::OkStatus();
  }

  // ---- Send path ----

  absl::Status Gone(Peer& peer) {
    if (peer.failure.failed()) {
      return absl::UnavailableError(
          absl::StrCat("rdma: ", PeerName(peer.id), " is gone: ", peer.failure.status().message()));
    }
    return absl::UnavailableError(absl::StrCat("rdma: ", PeerName(peer.id), " is gone"));
  }

  absl::StatusOr<Peer*> PeerFor(NodeId id) {
    const uint64_t version = peers_version_.load(std::memory_order_acquire);
    if (auto it = peer_cache_.find(id); it != peer_cache_.end() && it->second.second == version) {
      Peer* peer = it->second.first;
      if (!peer->usable()) return Gone(*peer);
      return peer;
    }
    Peer* peer = FindPeer(id);
    if (peer == nullptr) {
      return absl::NotFoundError(absl::StrCat("rdma: no connection to node 0x", absl::Hex(id)));
    }
    peer_cache_[id] = {peer, version};
    if (!peer->usable()) return Gone(*peer);
    return peer;
  }

  // The prepared route for (peer, key): a hash lookup in the send thread's own
  // table; the locked lookups happen once, on the first frame.
  absl::StatusOr<const CachedRoute*> RouteFor(NodeId peer_id, uint64_t key) {
    const uint64_t version = peers_version_.load(std::memory_order_acquire);
    auto it = route_cache_.find({peer_id, key});
    if (it != route_cache_.end() && it->second.peers_version == version) return &it->second;
    Peer* peer = FindPeer(peer_id);
    if (peer == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("rdma: no connection to node 0x", absl::Hex(peer_id)));
    }
    Route* route;
    {
      MutexLock lock(&peer->route_mu);
      std::unique_ptr<Route>& slot = peer->routes[key];
      if (slot == nullptr) slot = std::make_unique<Route>();  // live once advertised
      route = slot.get();
    }
    CachedRoute& entry = route_cache_[{peer_id, key}];
    entry = {peer, route, version};
    return &entry;
  }

  absl::StatusOr<CachedSource> SourceFor(RegionId id, const std::byte* src, size_t bytes) {
    const uint64_t version = regions_version_.load(std::memory_order_acquire);
    auto it = source_cache_.find(id);
    if (it == source_cache_.end() || it->second.version != version) {
      MutexLock lock(&regions_mu_);
      auto region = regions_.find(id);
      if (region == regions_.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("rdma: source region ", id, " is not registered"));
      }
      const RegionInfo& info = region->second->info;
      if (!region->second->local_mr) {
        // A receive region: the slot holding [src, src + bytes), by its own MR.
        const auto* base = static_cast<const std::byte*>(info.base);
        const size_t slot = src >= base ? static_cast<size_t>(src - base) / info.slot_bytes : 0;
        if (src < base || slot >= info.num_slots ||
            src + bytes > base + (slot + 1) * info.slot_bytes) {
          return absl::OutOfRangeError(
              absl::StrCat("rdma: a send from receive region ", id, " must lie inside one slot"));
        }
        return CachedSource{base + slot * info.slot_bytes, info.slot_bytes,
                            region->second->slot_mrs[slot]->lkey, version};
      }
      it = source_cache_
               .insert_or_assign(
                   id, CachedSource{static_cast<const std::byte*>(info.base), info.bytes(),
                                    region->second->local_mr->lkey, version})
               .first;
    }
    const CachedSource& source = it->second;
    if (src < source.base || src + bytes > source.base + source.bytes) {
      return absl::OutOfRangeError(absl::StrCat("rdma: source outside region ", id));
    }
    return source;
  }

  // ---- Posting and the per-peer outbox ----

  static bool HasCredit(const Peer& peer, const QueuePair& qp) {
    const uint64_t returned =
        std::atomic_ref<uint64_t>(*qp.mailbox).load(std::memory_order_acquire);
    return qp.frames_sent - returned < peer.depth;
  }

  // Posts `frame` (it may be partly posted already) or the part of it that
  // has room; nothing waits. `version`: the regions_version_ the source was
  // looked up under (a frame not yet queued), which must still hold.
  absl::Status Submit(Peer& peer, QueuedFrame& frame, std::optional<uint64_t> version) {
    Outbox& box = peer.outbox;
    MutexLock lock(&peer.outbox.mu);
    // UnregisterRegion bumps the version before it looks for queued frames
    // under this lock: a frame checked here is either seen there or aborted.
    if (version.has_value() && regions_version_.load(std::memory_order_acquire) != *version) {
      return absl::AbortedError("rdma: the source region changed");
    }
    if (!peer.usable()) return Gone(peer);
    if (box.size == 0) {
      STEPMESH_ASSIGN_OR_RETURN(const Blocked blocked, Advance(peer, frame));
      if (blocked == Blocked::kNothing) return absl::OkStatus();
      box.blocked = blocked;
    }
    if (box.size == kMaxQueuedFrames) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "rdma: the send queue to ", PeerName(peer.id), " is full (", kMaxQueuedFrames,
          " frames waiting for ", BlockedOn(box.blocked, box.at(0).header.key), " for ",
          absl::FormatDuration(
              absl::Trunc(absl::Nanoseconds(absl::GetCurrentTimeNanos() - box.head_since_ns),
                          absl::Milliseconds(1))),
          ")"));
    }
    if (box.size == box.ring.size()) Grow(box);
    QueuedFrame& queued = box.at(box.size);
    queued = frame;
    if (frame.route == nullptr && frame.bytes > 0) {
      // An error frame's text (small, rare): the caller's buffer is not kept.
      queued.copy.assign(reinterpret_cast<const char*>(frame.src), frame.bytes);
      queued.src = nullptr;
    }
    queued.queued_ns = absl::GetCurrentTimeNanos();
    if (box.size++ == 0) {
      box.head_since_ns = queued.queued_ns;
      box.backlogged.store(true, std::memory_order_release);
      backlogged_.fetch_add(1, std::memory_order_acq_rel);
      Wake();  // its Poll now looks at the peer's credits every millisecond
    }
    return absl::OkStatus();
  }

  // Doubles a full outbox (only while a peer is slow: steady state never grows it).
  static void Grow(Outbox& box) ABSL_EXCLUSIVE_LOCKS_REQUIRED(box.mu) {
    std::vector<QueuedFrame> bigger(
        std::min(kMaxQueuedFrames, std::max<size_t>(box.ring.size() * 2, kInitialQueuedFrames)));
    for (size_t i = 0; i < box.size; ++i) bigger[i] = std::move(box.at(i));
    box.ring = std::move(bigger);
    box.head = 0;
  }

  static void Pop(Outbox& box) ABSL_EXCLUSIVE_LOCKS_REQUIRED(box.mu) {
    QueuedFrame& done = box.at(0);
    done.copy.clear();
    done.src = nullptr;
    box.head = (box.head + 1) % box.ring.size();
    --box.size;
    box.head_since_ns = absl::GetCurrentTimeNanos();
    box.blocked = Blocked::kNothing;
  }

  static std::string BlockedOn(Blocked blocked, uint64_t key) {
    switch (blocked) {
      case Blocked::kAdvert:
        return absl::StrCat("its advert of a receive region for key ", key);
      case Blocked::kCredit:
        return "its receive credits";
      case Blocked::kSendQueue:
        return "room in the send queue";
      default:
        return "the head frame";
    }
  }

  // Posts queued frames while the peer has what they need (outbox lock held).
  void DrainOutbox(Peer& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer.outbox.mu) {
    Outbox& box = peer.outbox;
    while (box.size > 0 && box.blocked != Blocked::kFailed) {
      absl::StatusOr<Blocked> blocked = Advance(peer, box.at(0));
      if (!blocked.ok()) {
        box.blocked = Blocked::kFailed;
        box.failed = blocked.status();
        return;
      }
      if (*blocked != Blocked::kNothing) {
        box.blocked = *blocked;
        return;
      }
      Pop(box);
    }
    if (box.size == 0 && box.backlogged.exchange(false, std::memory_order_acq_rel)) {
      backlogged_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  // Receive thread: drains every backlogged outbox, and settles heads that
  // cannot go: a frame the peer never advertised a slot for within the
  // timeout (or whose slot is now too small) is dropped and reported to the
  // sink as an error frame of that peer's; a peer whose credits or send
  // queue have not moved for the timeout is lost.
  void ServiceOutboxes(TransportSink& sink) {
    const size_t count = peer_count_.load(std::memory_order_acquire);
    const int64_t timeout_ns = absl::ToInt64Nanoseconds(options_.timeout);
    for (size_t i = 0; i < count; ++i) {
      Peer& peer = *peers_[i];
      if (!peer.outbox.backlogged.load(std::memory_order_acquire) || peer.lost) continue;
      for (;;) {
        FrameHeader dropped;
        absl::Status why;
        {
          Outbox& box = peer.outbox;
          MutexLock lock(&peer.outbox.mu);
          DrainOutbox(peer);
          if (box.size == 0) break;
          const int64_t waited = absl::GetCurrentTimeNanos() - box.head_since_ns;
          if (box.blocked == Blocked::kFailed) {
            why = box.failed;
          } else if (waited <= timeout_ns) {
            break;
          } else if (box.blocked == Blocked::kAdvert) {
            why = absl::DeadlineExceededError(absl::StrCat(
                "rdma: ", PeerName(peer.id), " never advertised a receive region for key ",
                box.at(0).header.key, " (waited ", absl::FormatDuration(options_.timeout),
                "); the frame was not sent"));
          } else {
            peer.failure.Record(
                absl::DeadlineExceededError(absl::StrCat(
                    "rdma: ", PeerName(peer.id), " returned no receive credits within ",
                    absl::FormatDuration(options_.timeout), " (", box.size,
                    " frames queued, waiting for ", BlockedOn(box.blocked, 0), ")")),
                FailureRecord::kCause);
            break;
          }
          if (!peer.usable()) break;
          dropped = box.at(0).header;
          box.failed = absl::OkStatus();
          Pop(box);
        }
        // Outside the lock: the sink may queue work of its own.
        dropped.type = FrameType::kError;
        dropped.src = peer.id;
        dropped.dst = self_;
        dropped.payload_bytes = 0;
        dropped.status_code = static_cast<uint32_t>(why.code());
        sink.OnFrame(peer.id, dropped, nullptr, std::move(why));
      }
    }
    ReportFailures(sink);
  }

  // Frames still queued when the connection goes are dropped with it.
  void ClearOutbox(Peer& peer) {
    Outbox& box = peer.outbox;
    MutexLock lock(&box.mu);
    while (box.size > 0) Pop(box);
    box.failed = absl::OkStatus();
    if (box.backlogged.exchange(false, std::memory_order_acq_rel)) {
      backlogged_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  // Shutdown: queued frames go out first, while the peers return credits,
  // until `deadline`.
  void FlushOutboxes(absl::Time deadline) {
    while (backlogged_.load(std::memory_order_acquire) > 0 && absl::Now() < deadline) {
      const size_t count = peer_count_.load(std::memory_order_acquire);
      for (size_t i = 0; i < count; ++i) {
        Peer& peer = *peers_[i];
        if (!peer.outbox.backlogged.load(std::memory_order_acquire)) continue;
        if (!peer.usable()) {
          ClearOutbox(peer);
          continue;
        }
        for (uint32_t q = 0; q < peer.num_qps; ++q) peer.qps[q].sq.Reap(peer.failure);
        MutexLock lock(&peer.outbox.mu);
        DrainOutbox(peer);
      }
      absl::SleepFor(absl::Microseconds(50));
    }
  }

  // Moves `frame` on as far as the peer allows: Blocked::kNothing once it is
  // wholly posted. Errors: the frame can never go (OUT_OF_RANGE), or the peer
  // is gone.
  absl::StatusOr<Blocked> Advance(Peer& peer, QueuedFrame& frame)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer.outbox.mu) {
    for (int attempt = 0; attempt < 3; ++attempt) {
      if (!peer.usable()) return Gone(peer);
      if (!frame.started) {
        frame.dst = RouteView{};
        if (frame.route != nullptr) {
          frame.dst = ReadRoute(*frame.route);
          if (!frame.dst.live) return Blocked::kAdvert;
          if (frame.bytes > frame.dst.bytes) {
            return absl::OutOfRangeError(absl::StrCat(
                "rdma: ", frame.bytes, " bytes for key ", frame.header.key,
                " exceed the peer's slot of ", frame.dst.bytes, "; the frame was not sent"));
          }
        }
        frame.chunk = 0;
        if (frame.route != nullptr && peer.num_qps > 1 &&
            frame.bytes >= static_cast<size_t>(rdma_.stripe_min_bytes)) {
          frame.chunk = (frame.bytes / 2) & ~(kPageBytes - 1);
        }
        if (!HasCredit(peer, peer.qps[0]) || (frame.chunk > 0 && !HasCredit(peer, peer.qps[1]))) {
          return Blocked::kCredit;
        }
        frame.started = true;
        frame.chunk_posted = 0;
        frame.chunk_sent = false;
        frame.payload_posted = 0;
      }
      absl::StatusOr<bool> posted = PostStarted(peer, frame);
      if (posted.ok()) return *posted ? Blocked::kNothing : Blocked::kSendQueue;
      if (!absl::IsAborted(posted.status())) return posted.status();
      frame.started = false;  // the route changed under it: again, at the new place
    }
    return Blocked::kSendQueue;  // the route keeps changing: try again later
  }

  // Posts what is left of a started frame: the striped chunk (QP 1) with
  // its immediate, then the payload and the frame itself, a WRITE_WITH_IMM of
  // the header (and a small payload) into the peer's ring on QP 0. RC
  // ordering within a QP makes the payload visible before the frame's
  // completion. False: a send queue is full (the progress is kept).
  absl::StatusOr<bool> PostStarted(Peer& peer, QueuedFrame& frame)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer.outbox.mu) {
    const Route* route = frame.route;
    const uint32_t seq = frame.dst.seq;
    auto valid = [route, seq] {
      return route == nullptr || route->seq.load(std::memory_order_acquire) == seq;
    };
    const RouteView& dst = frame.dst;
    if (frame.chunk > 0 && !frame.chunk_sent) {
      QueuePair& qp = peer.qps[1];
      const size_t chunk = frame.chunk;
      // The chunk's last piece carries the immediate that counts it.
      const size_t head = chunk > max_wr_bytes_ ? chunk - (chunk - 1) % max_wr_bytes_ - 1 : 0;
      const std::byte* chunk_src = frame.src + frame.bytes - chunk;
      const uint64_t chunk_remote = dst.addr + frame.bytes - chunk;
      ibv_sge sge{reinterpret_cast<uintptr_t>(chunk_src + head),
                  static_cast<uint32_t>(chunk - head), frame.lkey};
      ibv_send_wr wr{};
      wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wr.imm_data = htonl(rdma::ChunkImm(peer.stripes_sent));
      wr.wr.rdma.remote_addr = chunk_remote + head;
      wr.wr.rdma.rkey = dst.rkey;
      STEPMESH_ASSIGN_OR_RETURN(
          const bool all, PostPieces(peer, qp, chunk_src, chunk_remote, dst.rkey, frame.lkey, head,
                                     &frame.chunk_posted, &wr, &sge, valid));
      if (!all) return false;
      ++qp.frames_sent;
      ++peer.stripes_sent;
      frame.chunk_sent = true;
    }
    QueuePair& qp = peer.qps[0];
    const bool small = frame.route == nullptr;  // error text (or nothing) rides in the ring
    const std::byte* small_src =
        frame.src != nullptr ? frame.src : reinterpret_cast<const std::byte*>(frame.copy.data());
    const size_t small_bytes = small ? frame.bytes : 0;
    const uint32_t ring_slot = static_cast<uint32_t>(qp.frames_sent % peer.depth);
    std::byte* staged = qp.send_ring + ring_slot * kRingStride;
    EncodeFrame(frame.header, staged);
    if (small_bytes > 0) std::memcpy(staged + kFrameBytes, small_src, small_bytes);
    const uint32_t frame_len = static_cast<uint32_t>(kFrameBytes + small_bytes);
    ibv_sge sge{reinterpret_cast<uintptr_t>(staged), frame_len, peer.local_mr->lkey};
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.imm_data = htonl(rdma::FrameImm(ring_slot, peer.stripes_sent));
    wr.wr.rdma.remote_addr = qp.remote_ring + ring_slot * kRingStride;
    wr.wr.rdma.rkey = peer.remote_rkey;
    if (frame_len <= qp.max_inline) wr.send_flags = IBV_SEND_INLINE;
    const size_t payload = small ? 0 : frame.bytes - frame.chunk;
    STEPMESH_ASSIGN_OR_RETURN(
        const bool all, PostPieces(peer, qp, frame.src, dst.addr, dst.rkey, frame.lkey, payload,
                                   &frame.payload_posted, &wr, &sge, valid));
    if (!all) return false;
    ++qp.frames_sent;
    return true;
  }

  // A payload's pieces (each at most max_msg_sz) from `*done` on, in chains
  // of at most kMaxChain (and never more than the queue holds); the last
  // chain ends with `tail` (a WRITE_WITH_IMM). True once the tail is posted;
  // false when the send queue is full (`*done` says how far it got).
  template <typename Valid>
  absl::StatusOr<bool> PostPieces(Peer& peer, QueuePair& qp, const std::byte* src, uint64_t remote,
                                  uint32_t rkey, uint32_t lkey, size_t bytes, size_t* done,
                                  ibv_send_wr* tail, ibv_sge* tail_sge, Valid& valid) {
    ibv_sge sges[kMaxChain];
    ibv_send_wr wrs[kMaxChain];
    const int room =
        static_cast<int>(std::min<uint32_t>(kMaxChain, std::max(qp.sq.data_slots(), 2u))) - 1;
    for (;;) {
      const int n = FillPieces(src + *done, remote + *done, rkey, lkey, bytes - *done,
                               max_wr_bytes_, sges, wrs, room);
      size_t filled = 0;
      for (int i = 0; i < n; ++i) filled += sges[i].length;
      int count = n;
      const bool last = *done + filled == bytes;
      if (last) {
        wrs[count] = *tail;
        sges[count] = *tail_sge;
        ++count;
      }
      Link(sges, wrs, count);
      absl::StatusOr<bool> posted = qp.sq.TryPost(wrs, count, peer.failure, valid);
      if (!posted.ok() && peer.failure.failed()) {
        Wake();  // the receive thread reports the loss now
        return Gone(peer);
      }
      if (!posted.ok() || !*posted) return posted;
      *done += filled;
      if (last) return true;
    }
  }

  enum class Drain { kDone, kPeerGone, kTimedOut };

  // A fence behind everything posted on each of `peer`'s QPs: the watermarks
  // to wait for.
  std::array<uint64_t, rdma::kMaxQpsPerPeer> FencePeer(Peer& peer, absl::Time deadline) {
    std::array<uint64_t, rdma::kMaxQpsPerPeer> marks{};
    for (uint32_t q = 0; q < peer.num_qps; ++q) {
      absl::StatusOr<uint64_t> mark = peer.qps[q].sq.Fence(deadline, peer.failure);
      marks[q] = mark.ok() ? *mark : 0;  // a failed fence failed the peer
    }
    return marks;
  }

  // Fences every usable peer's QPs, then waits for all of them; per peer
  // (unusable ones: kDone).
  std::vector<Drain> DrainAll(absl::Time deadline) {
    const size_t count = peer_count_.load(std::memory_order_acquire);
    std::vector<std::array<uint64_t, rdma::kMaxQpsPerPeer>> marks(count);
    for (size_t i = 0; i < count; ++i) {
      if (peers_[i]->usable()) marks[i] = FencePeer(*peers_[i], deadline);
    }
    std::vector<Drain> drained(count, Drain::kDone);
    for (size_t i = 0; i < count; ++i) {
      if (peers_[i]->usable()) drained[i] = AwaitDrained(*peers_[i], marks[i], deadline);
    }
    return drained;
  }

  // Before a region is deregistered: every send that may read it completed.
  void DrainSends(absl::Time deadline, const std::string& why) {
    const std::vector<Drain> drained = DrainAll(deadline);
    for (size_t i = 0; i < drained.size(); ++i) {
      Peer& peer = *peers_[i];
      if (drained[i] == Drain::kDone) continue;
      if (drained[i] == Drain::kPeerGone) {
        ErrorQps(peer);  // nobody acknowledges; the receive thread reports the loss
        continue;
      }
      peer.failure.Record(absl::DeadlineExceededError(absl::StrCat(
                              "rdma: sends to ", PeerName(peer.id), " did not complete within ",
                              absl::FormatDuration(options_.timeout), " (", why, ")")),
                          FailureRecord::kCause);
      ErrorQps(peer);  // flushed: the NIC stops reading our memory
      Wake();
    }
  }

  // Whether every QP of `peer` completed up to `marks` by `deadline` (polling
  // the send CQs here: nobody else has to). A peer that hung up its bootstrap
  // connection will acknowledge nothing more (its QPs may be gone): waiting
  // for it would only run into the retry budget.
  Drain AwaitDrained(Peer& peer, const std::array<uint64_t, rdma::kMaxQpsPerPeer>& marks,
                     absl::Time deadline) {
    for (int round = 0;; ++round) {
      bool done = true;
      for (uint32_t q = 0; q < peer.num_qps; ++q) {
        peer.qps[q].sq.Reap(peer.failure);
        done = done && peer.qps[q].sq.Drained(marks[q]);
      }
      if (done) return Drain::kDone;
      if (peer.lost.load() && !shut_down_.load()) return Drain::kDone;  // QPs in ERR: flushed
      if ((round & 15) == 0 && HungUp(peer)) return Drain::kPeerGone;
      if (absl::Now() > deadline) return Drain::kTimedOut;
      absl::SleepFor(absl::Microseconds(20));
    }
  }

  // The peer closed its end of the bootstrap connection (left or died).
  static bool HungUp(const Peer& peer) {
    pollfd p{peer.socket.get(), POLLRDHUP, 0};
    return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
  }

  // ---- Withdrawing receive slots ----

  void WithdrawSlots(const RegionInfo& info, absl::Time deadline) {
    std::vector<Peer*> writers;
    {
      MutexLock lock(&acks_mu_);
      for (NodeId owner : info.slot_peers) {
        Peer* peer = FindPeer(owner);
        if (peer == nullptr || !peer->usable()) continue;
        ++awaited_acks_[{peer->token, info.key}];
        writers.push_back(peer);
      }
    }
    std::byte msg[rdma::kBootHeaderBytes + rdma::kMaxBootBody];
    const size_t n = rdma::EncodeWithdraw(info.key, msg);
    for (Peer* peer : writers) WriteControl(*peer, msg, n);
    MutexLock lock(&acks_mu_);
    auto settled = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(acks_mu_) {
      for (Peer* peer : writers) {
        if (awaited_acks_.contains({peer->token, info.key}) && peer->usable() &&
            !shut_down_.load()) {
          return false;
        }
      }
      return true;
    };
    acks_mu_.AwaitWithDeadline(settled, deadline);
    for (Peer* peer : writers) {
      auto it = awaited_acks_.find({peer->token, info.key});
      if (it == awaited_acks_.end()) continue;
      if (--it->second == 0) awaited_acks_.erase(it);
      if (!peer->usable() || shut_down_.load()) continue;
      // It may still write with the old rkey: cut it off before the MR goes.
      peer->failure.Record(
          absl::DeadlineExceededError(absl::StrCat(
              "rdma: ", PeerName(peer->id), " did not acknowledge the withdrawal ", "of key ",
              info.key, " within ", absl::FormatDuration(options_.timeout))),
          FailureRecord::kCause);
      ErrorQps(*peer);
      Wake();
    }
  }

  void WakeAckWaiters() { MutexLock lock(&acks_mu_); }  // unlocking re-evaluates the waits

  // ---- Receive path ----

  absl::Status PostReceive(QueuePair& qp, uint32_t q) {
    ibv_recv_wr wr{};
    wr.wr_id = q;
    ibv_recv_wr* bad = nullptr;
    if (const int rc = verbs_->PostRecv(qp.qp.get(), &wr, &bad); rc != 0) {
      return absl::InternalError(ErrnoMessage("rdma: ibv_post_recv", rc));
    }
    return absl::OkStatus();
  }

  void ArmAll() {
    const size_t count = peer_count_.load(std::memory_order_acquire);
    for (size_t i = 0; i < count; ++i) {
      Peer& peer = *peers_[i];
      if (!peer.lost) verbs_->ReqNotifyCq(peer.recv_cq.get(), 0);
    }
  }

  void ConsumeCqEvents() {
    if (!channel_) return;
    ibv_cq* cq;
    void* context;
    while (verbs_->GetCqEvent(channel_.get(), &cq, &context) == 0) verbs_->AckCqEvents(cq, 1);
  }

  // Reaps send CQs (the first real error of a QP is found here, not as a
  // flush later), acknowledges withdrawals whose fences completed, returns
  // credits that could not be written earlier, and reports failures.
  void Housekeep(TransportSink& sink) {
    const size_t count = peer_count_.load(std::memory_order_acquire);
    for (size_t i = 0; i < count; ++i) {
      Peer& peer = *peers_[i];
      if (peer.lost) continue;
      for (uint32_t q = 0; q < peer.num_qps; ++q) {
        peer.qps[q].sq.Reap(peer.failure);
        if (!peer.failure.failed()) MaybeReturnCredits(peer, peer.qps[q], /*any=*/false);
      }
      if (!peer.pending_acks.empty()) ServiceAcks(peer);
    }
    ReportFailures(sink);
  }

  void ServiceAcks(Peer& peer) {
    auto& acks = peer.pending_acks;
    for (size_t i = 0; i < acks.size();) {
      bool drained = true;
      for (uint32_t q = 0; q < peer.num_qps; ++q) {
        drained = drained && peer.qps[q].sq.Drained(acks[i].watermarks[q]);
      }
      if (!drained && peer.usable()) {
        ++i;
        continue;
      }
      if (peer.usable()) {
        std::byte msg[rdma::kBootHeaderBytes + rdma::kMaxBootBody];
        WriteControl(peer, msg, rdma::EncodeWithdrawAck(acks[i].key, msg));
      }
      acks.erase(acks.begin() + static_cast<ptrdiff_t>(i));
      pending_acks_.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  void ReportFailures(TransportSink& sink) {
    const size_t count = peer_count_.load(std::memory_order_acquire);
    for (size_t i = 0; i < count; ++i) {
      Peer& peer = *peers_[i];
      if (peer.lost || !peer.failure.failed()) continue;
      // A flush or an event says little: the request that failed first may
      // wait in a send CQ.
      if (peer.failure.rank() < FailureRecord::kCause) {
        for (uint32_t q = 0; q < peer.num_qps; ++q) peer.qps[q].sq.Reap(peer.failure);
      }
      Lose(peer, sink, peer.failure.status());
    }
  }

  int DrainCompletions(TransportSink& sink) {
    int work = 0;
    bool failed = false;
    const size_t count = peer_count_.load(std::memory_order_acquire);
    for (size_t i = 0; i < count; ++i) {
      Peer& peer = *peers_[i];
      if (peer.lost || peer.failure.failed()) continue;
      work += DrainPeer(peer, sink);
      failed = failed || peer.failure.failed();
    }
    if (failed) ReportFailures(sink);
    return work;
  }

  int DrainPeer(Peer& peer, TransportSink& sink) {
    ibv_wc wc[kPollBatch];
    const int n = verbs_->PollCq(peer.recv_cq.get(), kPollBatch, wc);
    if (n < 0) {
      peer.failure.Record(absl::InternalError("rdma: receive CQ overrun"), FailureRecord::kEvent);
      return 0;
    }
    for (int k = 0; k < n && !peer.failure.failed(); ++k) OnReceive(peer, wc[k], sink);
    return n;
  }

  void Fail(Peer& peer, absl::Status why) {
    peer.failure.Record(std::move(why), FailureRecord::kCause);
  }

  void OnReceive(Peer& peer, const ibv_wc& wc, TransportSink& sink) {
    if (wc.status != IBV_WC_SUCCESS) {
      return peer.failure.Record(CompletionError(wc, "receive"), wc.status == IBV_WC_WR_FLUSH_ERR
                                                                     ? FailureRecord::kFlush
                                                                     : FailureRecord::kCause);
    }
    const uint32_t q = static_cast<uint32_t>(wc.wr_id);
    if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(wc.wc_flags & IBV_WC_WITH_IMM) ||
        q >= peer.num_qps) {
      return Fail(peer, absl::DataLossError("rdma: unexpected receive completion"));
    }
    QueuePair& qp = peer.qps[q];
    const uint32_t imm = ntohl(wc.imm_data);
    if (rdma::ImmIsChunk(imm)) {
      if (q == 0 || (imm & rdma::kImmChunkMask) != (peer.stripes_seen & rdma::kImmChunkMask)) {
        return Fail(peer, absl::DataLossError("rdma: stripe chunk out of order"));
      }
      // A chunk is consumed on arrival (its bytes are in the slot already):
      // its receive and credit go back at once.
      ++peer.stripes_seen;
      ++qp.frames_received;
      Consumed(peer, qp, q);
      return DeliverReady(peer, sink);
    }
    const uint32_t slot = static_cast<uint32_t>(qp.frames_received % peer.depth);
    if (q != 0 || rdma::ImmRingSlot(imm) != slot || wc.byte_len < kFrameBytes) {
      return Fail(peer, absl::DataLossError("rdma: frame outside the header ring order"));
    }
    peer.arrivals[slot] = Arrival{rdma::ImmStripes(imm), wc.byte_len};
    ++qp.frames_received;
    DeliverReady(peer, sink);
  }

  // Delivers QP 0's frames in order while their stripes are in. A frame
  // waiting for a stripe stays in its ring slot, its receive and credit held
  // back: the sender cannot get further ahead than its credit window.
  void DeliverReady(Peer& peer, TransportSink& sink) {
    QueuePair& qp = peer.qps[0];
    while (qp.delivered < qp.frames_received && !peer.failure.failed()) {
      const uint32_t slot = static_cast<uint32_t>(qp.delivered % peer.depth);
      const Arrival& arrival = peer.arrivals[slot];
      if (!rdma::StripesArrived(peer.stripes_seen, arrival.stripes_needed)) return;
      const std::byte* ring = qp.recv_ring + slot * kRingStride;
      absl::StatusOr<FrameHeader> header = DecodeFrame(absl::MakeConstSpan(ring, kFrameBytes));
      if (!header.ok()) {
        return Fail(
            peer, absl::DataLossError(absl::StrCat("rdma: malformed frame from ", PeerName(peer.id),
                                                   ": ", header.status().message())));
      }
      const size_t small = IsDataFrame(header->type) ? 0 : header->payload_bytes;
      if (small > kSmallPayloadMax || arrival.byte_len != kFrameBytes + small) {
        return Fail(peer, absl::DataLossError("rdma: frame length disagrees with its header"));
      }
      if (header->src != peer.id) {
        return Fail(peer, absl::PermissionDeniedError("rdma: frame claims another sender"));
      }
      Deliver(peer, *header, absl::MakeConstSpan(ring + kFrameBytes, small), sink);
      Consumed(peer, qp, 0);
    }
  }

  // Re-posts a consumed receive and, every quarter window, tells the peer.
  void Consumed(Peer& peer, QueuePair& qp, uint32_t q) {
    ++qp.delivered;
    if (absl::Status st = PostReceive(qp, q); !st.ok()) return Fail(peer, std::move(st));
    MaybeReturnCredits(peer, qp, /*any=*/false);
  }

  void MaybeReturnCredits(Peer& peer, QueuePair& qp, bool any) {
    const uint64_t owed = qp.delivered - qp.credits_returned;
    if (owed == 0 || (!any && owed < std::max<uint32_t>(1, peer.depth / 4))) return;
    std::atomic_ref<uint64_t>(*qp.credit_word).store(qp.delivered, std::memory_order_release);
    ibv_sge sge{reinterpret_cast<uintptr_t>(qp.credit_word), sizeof(uint64_t), peer.local_mr->lkey};
    ibv_send_wr wr{};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = qp.remote_mailbox;
    wr.wr.rdma.rkey = peer.remote_rkey;
    if (sizeof(uint64_t) <= qp.max_inline) wr.send_flags = IBV_SEND_INLINE;
    // A full credit share is retried by Housekeep; the value is cumulative.
    if (qp.sq.PostCredit(wr, peer.failure)) qp.credits_returned = qp.delivered;
  }

  void Deliver(Peer& peer, const FrameHeader& header, absl::Span<const std::byte> small,
               TransportSink& sink) {
    switch (header.type) {
      case FrameType::kPush:
      case FrameType::kReply: {
        Destination dest;
        core::FrameContext context = nullptr;
        absl::Status status = sink.Resolve(peer.id, header, dest, &context);
        if (status.ok() && header.payload_bytes > 0) status = CheckLanding(peer.id, header, dest);
        sink.OnFrame(peer.id, header, context, status);
        return;
      }
      case FrameType::kError:
        sink.OnFrame(
            peer.id, header, nullptr,
            absl::Status(static_cast<absl::StatusCode>(header.status_code),
                         std::string(reinterpret_cast<const char*>(small.data()), small.size())));
        return;
      default:
        return;  // heartbeats, goodbyes, credits, control: nothing to deliver
    }
  }

  // The payload already sits in this node's slot for (key, writer); the core's
  // destination must be exactly that slot.
  absl::Status CheckLanding(NodeId writer, const FrameHeader& header, const Destination& dest) {
    if (dest.capacity < header.payload_bytes) {
      return absl::OutOfRangeError("destination smaller than payload");
    }
    MutexLock lock(&recv_mu_);
    auto it = receive_slots_.find({header.key, writer});
    if (it == receive_slots_.end()) {
      return absl::NotFoundError(
          absl::StrCat("rdma: no receive slot for key ", header.key, " from ", PeerName(writer)));
    }
    if (dest.data != it->second.data || header.payload_bytes > it->second.bytes) {
      return absl::FailedPreconditionError(absl::StrCat("rdma: the destination for key ",
                                                        header.key, " is not ", PeerName(writer),
                                                        "'s advertised slot"));
    }
    return absl::OkStatus();
  }

  // ---- Asynchronous events ----

  void HandleAsyncEvents(TransportSink& sink) {
    ibv_async_event event;
    while (verbs_->GetAsyncEvent(port_.context.get(), &event) == 0) {
      const ibv_event_type type = event.event_type;
      Peer* peer = nullptr;
      absl::Status everyone;  // not OK: every peer is lost, for this reason
      switch (type) {
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR:
          peer = static_cast<Peer*>(event.element.qp->qp_context);
          break;
        case IBV_EVENT_CQ_ERR:
          peer = static_cast<Peer*>(event.element.cq->cq_context);
          break;
        case IBV_EVENT_DEVICE_FATAL:
          everyone = absl::UnavailableError(
              absl::StrCat("rdma: ", port_.device_name, " reported a fatal device error"));
          break;
        case IBV_EVENT_PORT_ERR:
        case IBV_EVENT_PORT_ACTIVE:
        case IBV_EVENT_LID_CHANGE:
        case IBV_EVENT_GID_CHANGE:
        case IBV_EVENT_PKEY_CHANGE:
        case IBV_EVENT_SM_CHANGE:
        case IBV_EVENT_CLIENT_REREGISTER:
          // Port events name their port: the other port of a dual-port HCA is
          // none of this transport's business.
          if (event.element.port_num != port_.port) {
            STEPMESH_LOG(kInfo, "rdma: ", port_.device_name, " port ", int{event.element.port_num},
                         " event ", static_cast<int>(type), " ignored (this transport uses port ",
                         int{port_.port}, ")");
            break;
          }
          everyone = PortEvent(type);
          break;
        default:
          STEPMESH_LOG(kInfo, "rdma: async event ", static_cast<int>(type));
          break;
      }
      verbs_->AckAsyncEvent(&event);
      if (peer != nullptr) {
        peer->failure.Record(
            absl::UnavailableError(absl::StrCat("rdma: asynchronous error event ",
                                                static_cast<int>(type), " on ", port_.device_name)),
            FailureRecord::kEvent);
      }
      if (!everyone.ok()) {
        const size_t count = peer_count_.load(std::memory_order_acquire);
        for (size_t i = 0; i < count; ++i)
          peers_[i]->failure.Record(everyone, FailureRecord::kCause);
      }
    }
    ReportFailures(sink);
  }

  // An event on our own port: OK when it changes nothing peers depend on.
  absl::Status PortEvent(ibv_event_type type) {
    const std::string where = absl::StrCat(port_.device_name, " port ", int{port_.port});
    switch (type) {
      case IBV_EVENT_PORT_ERR:
        return absl::UnavailableError(absl::StrCat("rdma: ", where, " went down"));
      case IBV_EVENT_GID_CHANGE: {
        // Peers address this node by the GID it sent them.
        ibv_gid_entry entry{};
        const int rc = verbs_->QueryGidEx(port_.context.get(), port_.port,
                                          static_cast<uint32_t>(port_.gid_index), &entry);
        if (rc == 0 && std::memcmp(&entry.gid, &port_.gid, sizeof(ibv_gid)) == 0) {
          return absl::OkStatus();
        }
        return absl::UnavailableError(absl::StrCat(
            "rdma: GID index ", port_.gid_index, " of ", where, " changed (was ",
            GidToString(port_.gid), ", now ", rc == 0 ? GidToString(entry.gid) : "gone",
            "): peers can no longer reach this node's address"));
      }
      case IBV_EVENT_LID_CHANGE: {
        if (port_.roce()) return absl::OkStatus();
        ibv_port_attr attr{};
        if (verbs_->QueryPort(port_.context.get(), port_.port, &attr) == 0 &&
            attr.lid == port_.lid) {
          return absl::OkStatus();
        }
        return absl::UnavailableError(absl::StrCat("rdma: the LID of ", where, " changed"));
      }
      default:
        STEPMESH_LOG(kInfo, "rdma: ", where, " event ", static_cast<int>(type));
        return absl::OkStatus();
    }
  }

  // ---- Peer loss ----

  void ErrorQps(Peer& peer) {
    for (uint32_t q = 0; q < peer.num_qps; ++q) {
      if (!peer.qps[q].qp) continue;
      ibv_qp_attr attr{};
      attr.qp_state = IBV_QPS_ERR;
      verbs_->ModifyQp(peer.qps[q].qp.get(), &attr, IBV_QP_STATE);  // flushes what is posted
    }
  }

  void Lose(Peer& peer, TransportSink& sink, absl::Status why) {
    if (peer.lost.exchange(true)) return;
    ErrorQps(peer);
    ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, peer.socket.get(), nullptr);
    ::shutdown(peer.socket.get(), SHUT_RDWR);
    pending_acks_.fetch_sub(peer.pending_acks.size(), std::memory_order_relaxed);
    peer.pending_acks.clear();
    ClearOutbox(peer);
    WakeRouteWaiters(peer);
    WakeAckWaiters();
    sink.OnPeerLost(peer.id, std::move(why));
    peer.loss_reported.store(true);
  }

  void WakeRouteWaiters(Peer& peer) {
    MutexLock lock(&peer.route_mu);  // unlocking re-evaluates the waiters' conditions
  }

  Peer* FindPeer(NodeId id) {
    MutexLock lock(&peers_mu_);
    auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : it->second;
  }

  // ---- Control messages (bootstrap socket) ----

  void SendAdvert(Peer& peer, const LocalRegion& region, uint32_t slot) {
    rdma::Advert advert;
    advert.key = region.info.key;
    advert.addr = reinterpret_cast<uintptr_t>(region.info.base) + slot * region.info.slot_bytes;
    advert.bytes = region.info.slot_bytes;
    advert.rkey = region.slot_mrs[slot]->rkey;
    std::byte msg[rdma::kBootHeaderBytes + rdma::kMaxBootBody];
    WriteControl(peer, msg, rdma::EncodeAdvert(advert, msg));
  }

  void WriteControl(Peer& peer, const std::byte* msg, size_t n) {
    absl::Status st;
    {
      MutexLock lock(&peer.write_mu);
      st = WriteFully(peer.socket.get(), msg, n, absl::Now() + options_.timeout);
    }
    if (st.ok()) return;
    peer.failure.Record(
        absl::UnavailableError(absl::StrCat("rdma: bootstrap connection to ", PeerName(peer.id),
                                            " failed: ", st.message())),
        FailureRecord::kCause);
    Wake();
  }

  void ReadControl(Peer& peer, TransportSink& sink) {
    for (;;) {
      const size_t want = peer.rx_got < rdma::kBootHeaderBytes
                              ? rdma::kBootHeaderBytes - peer.rx_got
                              : rdma::kBootHeaderBytes + BodyBytes(peer) - peer.rx_got;
      if (want == 0) {
        HandleControl(peer, sink);
        peer.rx_got = 0;
        if (peer.lost) return;
        continue;
      }
      const ssize_t n = ::recv(peer.socket.get(), peer.rx.data() + peer.rx_got, want, MSG_DONTWAIT);
      if (n == 0) {
        // What the peer posted before closing has been placed (it drained
        // before its goodbye): deliver it before reporting the loss.
        while (!peer.failure.failed() && DrainPeer(peer, sink) > 0) {
        }
        // CANCELLED: an orderly departure (see TransportSink::OnPeerLost).
        Lose(peer, sink,
             peer.failure.failed() ? peer.failure.status()
             : peer.said_goodbye   ? absl::CancelledError(absl::StrCat(PeerName(peer.id), " left"))
                                   : absl::UnavailableError(
                                         absl::StrCat(PeerName(peer.id), " closed its connection")));
        return;
      }
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
          Lose(peer, sink, absl::UnavailableError(ErrnoMessage("rdma: bootstrap recv", errno)));
        }
        return;
      }
      peer.rx_got += static_cast<size_t>(n);
      if (peer.rx_got == rdma::kBootHeaderBytes) {
        absl::StatusOr<rdma::BootHeader> h = rdma::DecodeBootHeader(peer.rx.data());
        if (!h.ok()) {
          Lose(peer, sink, h.status());
          return;
        }
      }
    }
  }

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

  void HandleControl(Peer& peer, TransportSink& sink) {
    const rdma::BootHeader h = *rdma::DecodeBootHeader(peer.rx.data());
    const std::byte* body = peer.rx.data() + rdma::kBootHeaderBytes;
    switch (h.type) {
      case rdma::BootType::kAdvert: {
        absl::StatusOr<rdma::Advert> a = rdma::DecodeAdvert(body, h.body_bytes);
        if (!a.ok()) return Lose(peer, sink, a.status());
        MutexLock lock(&peer.route_mu);
        std::unique_ptr<Route>& route = peer.routes[a->key];
        if (route == nullptr) route = std::make_unique<Route>();
        ChangeRoute(peer, *route, a->addr, a->bytes, a->rkey, true);
        return;
      }
      case rdma::BootType::kWithdraw: {
        absl::StatusOr<uint64_t> key = rdma::DecodeWithdraw(body, h.body_bytes);
        if (!key.ok()) return Lose(peer, sink, key.status());
        {
          MutexLock lock(&peer.route_mu);
          if (auto it = peer.routes.find(*key); it != peer.routes.end()) {
            ChangeRoute(peer, *it->second, 0, 0, 0, false);
          }
        }
        // No post uses the slot from here on; a fence behind those already
        // posted tells when the slot's owner may release it (ServiceAcks).
        peer.pending_acks.push_back({*key, FencePeer(peer, absl::Now() + options_.timeout)});
        pending_acks_.fetch_add(1, std::memory_order_relaxed);
        ServiceAcks(peer);
        return;
      }
      case rdma::BootType::kWithdrawAck: {
        absl::StatusOr<uint64_t> key = rdma::DecodeWithdraw(body, h.body_bytes);
        if (!key.ok()) return Lose(peer, sink, key.status());
        MutexLock lock(&acks_mu_);
        if (auto it = awaited_acks_.find({peer.token, *key});
            it != awaited_acks_.end() && --it->second == 0) {
          awaited_acks_.erase(it);
        }
        return;
      }
      case rdma::BootType::kGoodbye:
        peer.said_goodbye = true;
        return;
      default:
        return Lose(peer, sink, absl::DataLossError("rdma: unexpected bootstrap message"));
    }
  }

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
  UniqueFd epoll_fd_;
  UniqueFd wake_fd_;
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

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateRdmaTransport(const MeshOptions& options,
                                                               std::shared_ptr<VerbsApi> verbs) {
  if (verbs == nullptr) {
    STEPMESH_ASSIGN_OR_RETURN(verbs, MakeRealVerbsApi());
  }
  auto transport = std::make_unique<RdmaTransport>(options, std::move(verbs));
  STEPMESH_RETURN_IF_ERROR(transport->Open());
  return transport;
}

bool RdmaDeviceAvailable() {
  absl::StatusOr<std::shared_ptr<VerbsApi>> verbs = MakeRealVerbsApi();
  return verbs.ok() && OpenPort(**verbs, MeshOptions()).ok();
}

}  // namespace stepmesh::rdma
