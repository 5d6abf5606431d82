#include "src/transport/rdma/rdma_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
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
#include "src/transport/rdma/rdma_wire.h"
#include "src/transport/rdma/verbs_resources.h"
#include "stepmesh/status.h"

namespace stepmesh::rdma {
namespace {

using base::AcceptTcp;
using base::ConnectTcp;
using base::ErrnoMessage;
using base::HostPort;
using base::ListenTcp;
using base::LocalPort;
using base::Mutex;
using base::MutexLock;
using base::ParseHostPort;
using base::ReadFully;
using base::SetNoDelay;
using base::SetNonBlocking;
using base::UniqueFd;
using base::WriteFully;
using core::AcceptHandshake;
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

constexpr size_t kMaxPeers = 1024;  // connections over a transport's life (rejoins included)
constexpr int kPollBatch = 32;
constexpr size_t kPageBytes = 4096;
constexpr uint32_t kInlineTries[] = {256, 128, 64, 0};

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }
bool IsDataFrame(FrameType type) { return type == FrameType::kPush || type == FrameType::kReply; }

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};
using AlignedBytes = std::unique_ptr<std::byte, FreeDeleter>;

absl::Status WcError(const ibv_wc& wc, const char* what) {
  const std::string text =
      absl::StrCat("rdma ", what, " completion failed: ", WcStatusName(wc.status), " (",
                   static_cast<int>(wc.status), ", vendor ", wc.vendor_err, ")");
  switch (wc.status) {
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_LOC_PROT_ERR:
      return absl::PermissionDeniedError(text);
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return absl::ResourceExhaustedError(text);
    case IBV_WC_WR_FLUSH_ERR:
    case IBV_WC_RETRY_EXC_ERR:
      return absl::UnavailableError(text);
    default:
      return absl::InternalError(text);
  }
}

// The peer's receive slot for one key (from its advert).
struct RemoteSlot {
  uint64_t addr = 0;
  uint64_t bytes = 0;
  uint32_t rkey = 0;
};

// One RC QP to a peer. Send-side fields are guarded by `mu` (the send thread
// posts data, the receive thread posts credit returns); receive-side fields
// belong to the receive thread; `frames_sent` belongs to the send thread.
struct QueuePair {
  CqHandle send_cq;
  QpHandle qp;  // after its CQ: destroyed first
  uint32_t max_send_wr = 0;
  uint32_t max_inline = 0;
  uint32_t signal_interval = 1;

  Mutex mu;
  uint64_t posted = 0;     // WRs posted; wr_id = this count after posting
  uint64_t completed = 0;  // WRs whose slots a polled signalled completion released
  uint32_t since_signal = 0;

  uint64_t frames_sent = 0;  // WRITE_WITH_IMMs sent (credits used)

  uint64_t frames_received = 0;
  uint64_t reposted = 0;          // receives re-posted after the initial window
  uint64_t credits_returned = 0;  // `reposted` as last written to the peer

  // Local memory (inside the peer's control block).
  std::byte* recv_ring = nullptr;
  std::byte* send_ring = nullptr;
  uint64_t* mailbox = nullptr;      // the peer writes its `reposted` for our sends here
  uint64_t* credit_word = nullptr;  // source of credit writes when inline is impossible

  // The peer's ring and mailbox for this QP.
  uint64_t remote_ring = 0;
  uint64_t remote_mailbox = 0;
  uint32_t local_psn = 0;
};

// A frame that must wait for stripe chunks (copied out of the ring).
struct ParkedFrame {
  FrameHeader header;
  uint32_t stripes_needed = 0;
  uint32_t small_bytes = 0;
  std::array<std::byte, kSmallPayloadMax> small{};
};

struct Peer {
  NodeId id = kNoNode;
  uint64_t token = 0;
  uint32_t num_qps = 1;
  uint32_t depth = 0;

  UniqueFd socket;
  Mutex write_mu;

  // Control block: [remote part: rings, mailboxes][local part: send rings, credit words].
  AlignedBytes memory;
  size_t remote_bytes = 0;
  MrHandle remote_mr;  // LOCAL_WRITE | REMOTE_WRITE, rkey given to this peer only
  MrHandle local_mr;   // LOCAL_WRITE
  uint32_t remote_rkey = 0;  // the peer's control-block rkey

  CqHandle recv_cq;
  std::array<QueuePair, rdma::kMaxQpsPerPeer> qps;  // after recv_cq: destroyed first

  Mutex advert_mu;
  absl::flat_hash_map<uint64_t, RemoteSlot> adverts ABSL_GUARDED_BY(advert_mu);

  std::atomic<bool> lost{false};    // reported (or shut down); receive thread sets it
  std::atomic<bool> failed{false};  // a send-side failure waits to be reported
  Mutex fail_mu;
  absl::Status failure ABSL_GUARDED_BY(fail_mu);
  bool said_goodbye = false;

  // Receive thread: bootstrap bytes being assembled, stripes, parked frames.
  std::array<std::byte, rdma::kBootHeaderBytes + rdma::kMaxBootBody> rx{};
  size_t rx_got = 0;
  uint64_t stripes_sent = 0;  // send thread
  uint64_t stripes_seen = 0;
  std::vector<ParkedFrame> parked;  // ring of `depth` entries (2-QP peers only)
  size_t parked_head = 0;
  size_t parked_count = 0;

  void RecordFailure(absl::Status why) {
    MutexLock lock(&fail_mu);
    if (failed.load()) return;
    failure = std::move(why);
    failed.store(true, std::memory_order_release);
  }
};

struct ReceiveSlot {
  std::byte* data = nullptr;
  size_t bytes = 0;
};

struct LocalRegion {
  RegionInfo info;
  MrHandle local_mr;
  std::vector<MrHandle> slot_mrs;  // remote_writable: one MR per slot
};

class RdmaTransport final : public Transport {
 public:
  RdmaTransport(const MeshOptions& options, std::shared_ptr<VerbsApi> verbs,
                const RdmaTuning& tuning)
      : verbs_(std::move(verbs)), options_(options), tuning_(tuning), peers_(kMaxPeers) {}

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
    if (tuning_.recv_depth < 4 || tuning_.recv_depth > rdma::kMaxRecvDepth) {
      return absl::InvalidArgumentError("rdma: recv_depth must be in [4, 8192]");
    }
    if (options_.rdma_qps_per_peer < 1 || options_.rdma_qps_per_peer > rdma::kMaxQpsPerPeer) {
      return absl::InvalidArgumentError("rdma: rdma_qps_per_peer must be 1 or 2");
    }
    STEPMESH_ASSIGN_OR_RETURN(port_, OpenPort(*verbs_, options_));
    pd_ = PdHandle(verbs_.get(), verbs_->AllocPd(port_.context.get()));
    if (!pd_) return absl::InternalError(ErrnoMessage("rdma: ibv_alloc_pd", errno));
    channel_ = ChannelHandle(verbs_.get(), verbs_->CreateCompChannel(port_.context.get()));
    if (!channel_) return absl::InternalError(ErrnoMessage("rdma: ibv_create_comp_channel", errno));
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
    STEPMESH_ASSIGN_OR_RETURN(listener_, ListenTcp(options_.bind_host, 0));
    STEPMESH_LOG(kInfo, "rdma: using ", port_.device_name, " port ", int{port_.port},
                 " GID index ", port_.gid_index, " (", GidToString(port_.gid), ")");
    // A bonded (LAG) device: each of a peer's QPs gets its own physical port
    // (BringUp), so striped payloads use both links instead of one hash bucket.
    if (uint8_t lag = 0; options_.rdma_qps_per_peer > 1 &&
                         verbs_->QueryLagPorts(port_.context.get(), &lag) == 0 && lag > 1) {
      lag_ports_ = lag;
      STEPMESH_LOG(kInfo, "rdma: ", port_.device_name, " bonds ", int{lag},
                   " ports; QP q of each peer goes out on LAG port 1 + q % ", int{lag});
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> LocalEndpoint() override {
    STEPMESH_ASSIGN_OR_RETURN(uint16_t port, LocalPort(listener_.get()));
    return absl::StrCat(options_.bind_host, ":", port, "|", GidToString(port_.gid), "|",
                        port_.device_name, "/", int{port_.port});
  }

  absl::Status Connect(NodeId self, absl::Span<const PeerInfo> peers,
                       absl::Time deadline) override {
    self_ = self;
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
      absl::StatusOr<UniqueFd> fd = AcceptTcp(listener_.get(), deadline);
      if (!fd.ok()) {
        return absl::DeadlineExceededError(absl::StrCat(
            "rdma: ", expected.size(), " peer(s) never connected: ", fd.status().message()));
      }
      // Who dials, and (with a secret) proof of it, before any verbs resource is built.
      absl::StatusOr<NodeId> from =
          AcceptHandshake(fd->get(), self_, expected, options_.auth_token,
                          std::min(deadline, absl::Now() + absl::Seconds(5)));
      if (!from.ok()) {
        STEPMESH_LOG(kWarning, "rdma: refused a bootstrap connection: ", from.status().ToString());
        continue;
      }
      expected.erase(std::find(expected.begin(), expected.end(), *from));
      STEPMESH_RETURN_IF_ERROR(Handshake(*from, *std::move(fd), deadline));
    }
    return absl::OkStatus();
  }

  bool CanAccess(const Device& device) const override {
    return device.kind == DeviceKind::kCpu || options_.rdma_gpudirect != GpuDirect::kOff;
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
    region->local_mr = RegisterPart(info, info.base, info.bytes(), IBV_ACCESS_LOCAL_WRITE);
    if (!region->local_mr) return absl::InternalError(ErrnoMessage(what, errno));
    if (info.remote_writable) {
      for (uint32_t slot = 0; slot < info.num_slots; ++slot) {
        MrHandle mr = RegisterPart(info, static_cast<std::byte*>(info.base) + slot * info.slot_bytes,
                                   info.slot_bytes,
                                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
        if (!mr) return absl::InternalError(ErrnoMessage(absl::StrCat(what, ", slot ", slot), errno));
        region->slot_mrs.push_back(std::move(mr));
      }
    }
    MutexLock lock(&regions_mu_);
    if (regions_.contains(info.id)) {
      return absl::AlreadyExistsError(absl::StrCat("rdma: region ", info.id, " registered twice"));
    }
    for (NodeId writer : info.slot_peers) {
      if (receive_slots_.contains({info.key, writer})) {
        return absl::AlreadyExistsError(absl::StrCat(
            "rdma: ", PeerName(writer), " already has a receive slot for key ", info.key));
      }
    }
    LocalRegion* raw = region.get();
    regions_.emplace(info.id, std::move(region));
    if (info.remote_writable) {
      for (uint32_t slot = 0; slot < info.num_slots; ++slot) {
        receive_slots_[{info.key, info.slot_peers[slot]}] = ReceiveSlot{
            static_cast<std::byte*>(info.base) + slot * info.slot_bytes, info.slot_bytes};
      }
      for (uint32_t slot = 0; slot < info.num_slots; ++slot) {
        if (Peer* peer = FindPeer(info.slot_peers[slot]); peer != nullptr && !peer->lost) {
          SendAdvert(*peer, *raw, slot);
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status UnregisterRegion(RegionId id) override {
    std::unique_ptr<LocalRegion> region;
    {
      MutexLock lock(&regions_mu_);
      auto it = regions_.find(id);
      if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("rdma: no region ", id));
      region = std::move(it->second);
      regions_.erase(it);
      const RegionInfo& info = region->info;
      if (info.remote_writable) {
        for (NodeId writer : info.slot_peers) receive_slots_.erase({info.key, writer});
        std::byte msg[rdma::kBootHeaderBytes + rdma::kMaxBootBody];
        const size_t n = rdma::EncodeWithdraw(info.key, msg);
        for (NodeId owner : info.slot_peers) {
          if (Peer* peer = FindPeer(owner); peer != nullptr && !peer->lost) {
            WriteControl(*peer, msg, n);
          }
        }
      }
    }
    return absl::OkStatus();  // the MRs are deregistered as `region` goes
  }

  absl::Status Send(NodeId peer_id, const FrameHeader& header, const void* src,
                    RegionId src_region, size_t bytes) override {
    Peer* peer = FindPeer(peer_id);
    if (peer == nullptr) {
      return absl::NotFoundError(absl::StrCat("rdma: no connection to node 0x", absl::Hex(peer_id)));
    }
    if (peer->lost || peer->failed) {
      return absl::UnavailableError(absl::StrCat("rdma: ", PeerName(peer_id), " is gone"));
    }
    const absl::Time deadline = absl::Now() + options_.timeout;
    FrameHeader frame = header;
    const auto* source = static_cast<const std::byte*>(src);
    RemoteSlot dst;
    uint32_t lkey = 0;
    size_t small = 0;
    if (IsDataFrame(frame.type)) {
      if (frame.payload_bytes != bytes) {
        return absl::InvalidArgumentError("rdma: header.payload_bytes differs from the payload");
      }
      if (bytes > 0) {
        STEPMESH_ASSIGN_OR_RETURN(dst, WaitForAdvert(*peer, frame.key, deadline));
        if (bytes > dst.bytes) {
          return absl::OutOfRangeError(absl::StrCat("rdma: ", bytes, " bytes for key ", frame.key,
                                                    " exceed the peer's slot of ", dst.bytes));
        }
        STEPMESH_ASSIGN_OR_RETURN(lkey, SourceKey(src_region, source, bytes));
      }
    } else {
      small = std::min(bytes, kSmallPayloadMax);  // error text beyond this is cut
      frame.payload_bytes = small;
    }
    size_t chunk = 0;
    if (peer->num_qps > 1 && bytes >= tuning_.stripe_min_bytes && IsDataFrame(frame.type)) {
      chunk = (bytes / 2) & ~(kPageBytes - 1);
    }
    if (chunk > 0) {
      QueuePair& qp = peer->qps[1];
      STEPMESH_RETURN_IF_ERROR(AwaitCredit(*peer, qp, deadline));
      ibv_sge sge{reinterpret_cast<uintptr_t>(source + bytes - chunk), static_cast<uint32_t>(chunk),
                  lkey};
      ibv_send_wr wr{};
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wr.imm_data = htonl(rdma::ChunkImm(peer->stripes_sent));
      wr.wr.rdma.remote_addr = dst.addr + bytes - chunk;
      wr.wr.rdma.rkey = dst.rkey;
      STEPMESH_RETURN_IF_ERROR(Post(*peer, qp, &wr, 1, deadline));
      ++qp.frames_sent;
      ++peer->stripes_sent;
    }
    QueuePair& qp = peer->qps[0];
    STEPMESH_RETURN_IF_ERROR(AwaitCredit(*peer, qp, deadline));
    const uint32_t ring_slot = static_cast<uint32_t>(qp.frames_sent % peer->depth);
    std::byte* staged = qp.send_ring + ring_slot * kRingStride;
    EncodeFrame(frame, staged);
    if (small > 0) std::memcpy(staged + kFrameBytes, source, small);
    const uint32_t frame_len = static_cast<uint32_t>(kFrameBytes + small);

    ibv_sge sges[2];
    ibv_send_wr wrs[2]{};
    int n = 0;
    if (bytes - chunk > 0 && IsDataFrame(frame.type)) {
      sges[n] = {reinterpret_cast<uintptr_t>(source), static_cast<uint32_t>(bytes - chunk), lkey};
      wrs[n].opcode = IBV_WR_RDMA_WRITE;
      wrs[n].wr.rdma.remote_addr = dst.addr;
      wrs[n].wr.rdma.rkey = dst.rkey;
      ++n;
    }
    sges[n] = {reinterpret_cast<uintptr_t>(staged), frame_len, peer->local_mr->lkey};
    wrs[n].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wrs[n].imm_data = htonl(rdma::FrameImm(ring_slot, peer->stripes_sent));
    wrs[n].wr.rdma.remote_addr = qp.remote_ring + ring_slot * kRingStride;
    wrs[n].wr.rdma.rkey = peer->remote_rkey;
    if (frame_len <= qp.max_inline) wrs[n].send_flags = IBV_SEND_INLINE;
    ++n;
    for (int i = 0; i < n; ++i) {
      wrs[i].sg_list = &sges[i];
      wrs[i].num_sge = 1;
      wrs[i].next = i + 1 < n ? &wrs[i + 1] : nullptr;
    }
    STEPMESH_RETURN_IF_ERROR(Post(*peer, qp, wrs, n, deadline));
    ++qp.frames_sent;
    return absl::OkStatus();
  }

  absl::Status Poll(TransportSink& sink, absl::Duration max_wait) override {
    int work = ReportFailures(sink) + DrainCompletions(sink);
    int timeout_ms = 0;
    if (work == 0 && max_wait > absl::ZeroDuration()) {
      // Arm, then look once more: a completion between the drain and the arm
      // would otherwise sleep until the next one.
      ArmAll();
      work = DrainCompletions(sink);
      if (work == 0) {
        timeout_ms = static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(max_wait)));
      }
    } else if (work > 0 && (++busy_polls_ & 63) != 0) {
      return absl::OkStatus();  // busy: look at sockets and events every 64th call only
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
      ReportFailures(sink);
      DrainCompletions(sink);
    }
    return absl::OkStatus();
  }

  void Wake() override {
    const uint64_t one = 1;
    if (wake_fd_.valid()) (void)!::write(wake_fd_.get(), &one, sizeof(one));
  }

  void Shutdown() override {
    if (shut_down_.exchange(true)) return;
    std::byte bye[rdma::kBootHeaderBytes];
    const size_t n = rdma::EncodeEmpty(rdma::BootType::kGoodbye, bye);
    const size_t count = peer_count_.load(std::memory_order_acquire);
    for (size_t i = 0; i < count; ++i) {
      Peer& peer = *peers_[i];
      if (peer.lost.exchange(true)) continue;
      {
        MutexLock lock(&peer.write_mu);
        (void)::send(peer.socket.get(), bye, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, peer.socket.get(), nullptr);
        ::shutdown(peer.socket.get(), SHUT_RDWR);
      }
      ErrorQps(peer);
      WakeAdvertWaiters(peer);
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
  // memory needs the peer-memory kernel module (nvidia-peermem).
  MrHandle RegisterPart(const RegionInfo& region, void* addr, size_t bytes, int access) {
    if (region.dmabuf_fd < 0) return Register(addr, bytes, access);
    const uint64_t offset = region.dmabuf_offset + static_cast<uint64_t>(
                                static_cast<std::byte*>(addr) - static_cast<std::byte*>(region.base));
    return MrHandle(verbs_.get(),
                    verbs_->RegDmabufMr(pd_.get(), offset, bytes, reinterpret_cast<uintptr_t>(addr),
                                        region.dmabuf_fd, access));
  }
  MrHandle Register(void* addr, size_t bytes, int access) {
    return MrHandle(verbs_.get(), verbs_->RegMr(pd_.get(), addr, bytes, access));
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

  // Builds the peer's QPs and memory, swaps hellos,
  // brings the QPs to RTS, swaps "ready", then publishes the peer.
  absl::Status Handshake(NodeId peer_id, UniqueFd fd, absl::Time deadline) {
    auto peer = std::make_unique<Peer>();
    peer->id = peer_id;
    peer->num_qps = static_cast<uint32_t>(options_.rdma_qps_per_peer);
    peer->depth = tuning_.recv_depth;
    rdma::Hello mine;
    STEPMESH_RETURN_IF_ERROR(BuildPeer(*peer, mine));
    std::byte msg[rdma::kBootHeaderBytes + rdma::kMaxBootBody];
    const size_t len = rdma::EncodeHello(mine, msg);
    // Both ends write, then read: the hellos are small enough for the socket buffers.
    STEPMESH_RETURN_IF_ERROR(WriteFully(fd.get(), msg, len, deadline));
    STEPMESH_ASSIGN_OR_RETURN(rdma::Hello theirs, ReadHello(fd.get(), deadline));
    if (theirs.node != peer_id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rdma: expected ", PeerName(peer_id), ", reached ", PeerName(theirs.node)));
    }
    if (theirs.num_qps != peer->num_qps || theirs.recv_depth != peer->depth) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rdma: ", PeerName(peer_id), " uses ", theirs.num_qps, " QPs x ", theirs.recv_depth,
          " receives, this node ", peer->num_qps, " x ", peer->depth,
          " (rdma_qps_per_peer must match across the mesh)"));
    }
    STEPMESH_RETURN_IF_ERROR(BringUp(*peer, theirs));
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
    return Publish(std::move(peer));
  }

  absl::Status BuildPeer(Peer& peer, rdma::Hello& hello) {
    const uint32_t q_count = peer.num_qps;
    const size_t ring_bytes = size_t{peer.depth} * kRingStride;
    peer.remote_bytes = RoundUp(q_count * (ring_bytes + kMailboxStride), kPageBytes);
    const size_t local_bytes = RoundUp(q_count * (ring_bytes + kMailboxStride), kPageBytes);
    peer.memory.reset(
        static_cast<std::byte*>(std::aligned_alloc(kPageBytes, peer.remote_bytes + local_bytes)));
    if (peer.memory == nullptr) return absl::ResourceExhaustedError("rdma: control block");
    std::byte* base = peer.memory.get();
    std::memset(base, 0, peer.remote_bytes + local_bytes);
    peer.remote_mr = Register(base, peer.remote_bytes,
                              IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    peer.local_mr = Register(base + peer.remote_bytes, local_bytes, IBV_ACCESS_LOCAL_WRITE);
    if (!peer.remote_mr || !peer.local_mr) {
      return absl::InternalError(ErrnoMessage("rdma: registering a control block", errno));
    }
    const int cqe = static_cast<int>(q_count * peer.depth + 16);
    peer.recv_cq = CqHandle(verbs_.get(), verbs_->CreateCq(port_.context.get(), cqe, &peer,
                                                           channel_.get(), 0));
    if (!peer.recv_cq) return absl::InternalError(ErrnoMessage("rdma: ibv_create_cq", errno));
    std::uniform_int_distribution<uint32_t> psn(0, 0xFFFFFF);
    hello.node = self_;
    hello.num_qps = q_count;
    hello.recv_depth = peer.depth;
    hello.mtu = static_cast<uint8_t>(port_.active_mtu);
    hello.ring_addr = reinterpret_cast<uintptr_t>(base);
    hello.ring_rkey = peer.remote_mr->rkey;
    for (uint32_t q = 0; q < q_count; ++q) {
      QueuePair& qp = peer.qps[q];
      qp.recv_ring = base + q * ring_bytes;
      qp.mailbox = reinterpret_cast<uint64_t*>(base + q_count * ring_bytes + q * kMailboxStride);
      std::byte* local = base + peer.remote_bytes;
      qp.send_ring = local + q * ring_bytes;
      qp.credit_word =
          reinterpret_cast<uint64_t*>(local + q_count * ring_bytes + q * kMailboxStride);
      STEPMESH_RETURN_IF_ERROR(CreateQp(peer, qp));
      STEPMESH_RETURN_IF_ERROR(ToInit(qp));
      for (uint32_t r = 0; r < peer.depth; ++r) STEPMESH_RETURN_IF_ERROR(PostReceive(qp, q));
      hello.qps[q].qpn = qp.qp->qp_num;
      qp.local_psn = psn(rng_);
      hello.qps[q].psn = qp.local_psn;
      std::memcpy(hello.qps[q].gid.data(), port_.gid.raw, 16);
    }
    return absl::OkStatus();
  }

  absl::Status CreateQp(Peer& peer, QueuePair& qp) {
    const uint32_t send_depth = 4 * peer.depth;
    qp.send_cq = CqHandle(verbs_.get(), verbs_->CreateCq(port_.context.get(),
                                                         static_cast<int>(send_depth + 16),
                                                         &peer, nullptr, 0));
    if (!qp.send_cq) return absl::InternalError(ErrnoMessage("rdma: ibv_create_cq", errno));
    // Ask for a generous inline cap and step down; what the provider grants
    // (written back into attr.cap) is what the send path trusts.
    for (uint32_t inline_bytes : kInlineTries) {
      ibv_qp_init_attr attr{};
      attr.qp_context = &peer;
      attr.send_cq = qp.send_cq.get();
      attr.recv_cq = peer.recv_cq.get();
      attr.qp_type = IBV_QPT_RC;
      attr.cap.max_send_wr = send_depth;
      attr.cap.max_recv_wr = peer.depth;
      attr.cap.max_send_sge = 1;
      attr.cap.max_recv_sge = 1;
      attr.cap.max_inline_data = inline_bytes;
      qp.qp = QpHandle(verbs_.get(), verbs_->CreateQp(pd_.get(), &attr));
      if (qp.qp) {
        qp.max_send_wr = attr.cap.max_send_wr;
        qp.max_inline = attr.cap.max_inline_data;
        qp.signal_interval = std::max<uint32_t>(1, qp.max_send_wr / 4);
        return absl::OkStatus();
      }
    }
    return absl::InternalError(ErrnoMessage("rdma: ibv_create_qp", errno));
  }

  absl::Status ToInit(QueuePair& qp) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = port_.port;
    attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    return Modify(qp, attr,
                  IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT");
  }

  absl::Status BringUp(Peer& peer, const rdma::Hello& theirs) {
    peer.remote_rkey = theirs.ring_rkey;
    const size_t ring_bytes = size_t{peer.depth} * kRingStride;
    ibv_mtu mtu = std::min(port_.active_mtu, static_cast<ibv_mtu>(theirs.mtu));
    if (tuning_.path_mtu > 0) mtu = std::min(mtu, static_cast<ibv_mtu>(tuning_.path_mtu));
    for (uint32_t q = 0; q < peer.num_qps; ++q) {
      QueuePair& qp = peer.qps[q];
      qp.remote_ring = theirs.ring_addr + q * ring_bytes;
      qp.remote_mailbox = theirs.ring_addr + peer.num_qps * ring_bytes + q * kMailboxStride;
      ibv_qp_attr rtr{};
      rtr.qp_state = IBV_QPS_RTR;
      rtr.path_mtu = mtu;
      rtr.dest_qp_num = theirs.qps[q].qpn;
      rtr.rq_psn = theirs.qps[q].psn;
      rtr.max_dest_rd_atomic = 1;
      rtr.min_rnr_timer = tuning_.min_rnr_timer;
      rtr.ah_attr.is_global = 1;
      std::memcpy(rtr.ah_attr.grh.dgid.raw, theirs.qps[q].gid.data(), 16);
      rtr.ah_attr.grh.sgid_index = static_cast<uint8_t>(port_.gid_index);
      rtr.ah_attr.grh.hop_limit = 64;
      rtr.ah_attr.grh.traffic_class = static_cast<uint8_t>(options_.rdma_traffic_class);
      rtr.ah_attr.dlid = theirs.qps[q].lid;
      rtr.ah_attr.sl = static_cast<uint8_t>(options_.rdma_service_level);
      rtr.ah_attr.port_num = port_.port;
      STEPMESH_RETURN_IF_ERROR(
          Modify(qp, rtr,
                 IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                 "RTR"));
      ibv_qp_attr rts{};
      rts.qp_state = IBV_QPS_RTS;
      rts.timeout = tuning_.timeout;
      rts.retry_cnt = tuning_.retry_cnt;
      rts.rnr_retry = tuning_.rnr_retry;
      rts.sq_psn = qp.local_psn;
      rts.max_rd_atomic = 1;
      STEPMESH_RETURN_IF_ERROR(Modify(qp, rts,
                                      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                          IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                          IBV_QP_MAX_QP_RD_ATOMIC,
                                      "RTS"));
      if (lag_ports_ > 1) PinLagPort(peer, q);
    }
    if (peer.num_qps > 1) peer.parked.resize(peer.depth);
    return absl::OkStatus();
  }

  // Best effort: a QP left to the bond's hash still works, only less evenly.
  void PinLagPort(Peer& peer, uint32_t q) {
    ibv_qp* qp = peer.qps[q].qp.get();
    const uint8_t want = static_cast<uint8_t>(1 + q % lag_ports_);
    uint8_t configured = 0, active = 0;
    if (const int rc = verbs_->ModifyQpLagPort(qp, want); rc != 0) {
      STEPMESH_LOG(kWarning, "rdma: ", PeerName(peer.id), " QP ", q, " stays on the bond's hash: ",
                   ErrnoMessage("mlx5dv_modify_qp_lag_port", rc));
    } else if (verbs_->QueryQpLagPort(qp, &configured, &active) == 0 && active != want) {
      STEPMESH_LOG(kInfo, "rdma: ", PeerName(peer.id), " QP ", q, " pinned to LAG port ",
                   int{want}, " but sends on port ", int{active}, " (a link of the bond is down?)");
    }
  }

  absl::Status Modify(QueuePair& qp, ibv_qp_attr& attr, int mask, const char* state) {
    if (const int rc = verbs_->ModifyQp(qp.qp.get(), &attr, mask); rc != 0) {
      return absl::InternalError(ErrnoMessage(absl::StrCat("rdma: QP to ", state), rc));
    }
    return absl::OkStatus();
  }

  absl::Status Publish(std::unique_ptr<Peer> peer) {
    MutexLock regions_lock(&regions_mu_);
    Peer* raw = peer.get();
    {
      MutexLock lock(&peers_mu_);
      const size_t slot = peer_count_.load(std::memory_order_relaxed);
      if (slot >= kMaxPeers) return absl::ResourceExhaustedError("rdma: too many connections");
      raw->token = slot;
      if (auto it = by_id_.find(raw->id); it != by_id_.end() && !it->second->lost.exchange(true)) {
        ErrorQps(*it->second);  // a rejoin replaces a connection never reported lost
        WakeAdvertWaiters(*it->second);
      }
      by_id_[raw->id] = raw;
      peers_[slot] = std::move(peer);
      peer_count_.store(slot + 1, std::memory_order_release);
    }
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
    MutexLock lock(&peer.write_mu);
    absl::Status st = WriteFully(peer.socket.get(), msg, n, absl::Now() + options_.timeout);
    if (!st.ok()) peer.RecordFailure(absl::UnavailableError(absl::StrCat(
        "rdma: bootstrap connection to ", PeerName(peer.id), " failed: ", st.message())));
    if (!st.ok()) Wake();
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
        // CANCELLED: an orderly departure (see TransportSink::OnPeerLost).
        Lose(peer, sink,
             peer.said_goodbye
                 ? absl::CancelledError(absl::StrCat(PeerName(peer.id), " left"))
                 : absl::UnavailableError(absl::StrCat(PeerName(peer.id), " closed its connection")));
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

  void HandleControl(Peer& peer, TransportSink& sink) {
    const rdma::BootHeader h = *rdma::DecodeBootHeader(peer.rx.data());
    const std::byte* body = peer.rx.data() + rdma::kBootHeaderBytes;
    switch (h.type) {
      case rdma::BootType::kAdvert: {
        absl::StatusOr<rdma::Advert> a = rdma::DecodeAdvert(body, h.body_bytes);
        if (!a.ok()) return Lose(peer, sink, a.status());
        MutexLock lock(&peer.advert_mu);
        peer.adverts[a->key] = RemoteSlot{a->addr, a->bytes, a->rkey};
        return;
      }
      case rdma::BootType::kWithdraw: {
        absl::StatusOr<uint64_t> key = rdma::DecodeWithdraw(body, h.body_bytes);
        if (!key.ok()) return Lose(peer, sink, key.status());
        MutexLock lock(&peer.advert_mu);
        peer.adverts.erase(*key);
        return;
      }
      case rdma::BootType::kGoodbye:
        peer.said_goodbye = true;
        return;
      default:
        return Lose(peer, sink, absl::DataLossError("rdma: unexpected bootstrap message"));
    }
  }

  absl::StatusOr<RemoteSlot> WaitForAdvert(Peer& peer, uint64_t key, absl::Time deadline) {
    MutexLock lock(&peer.advert_mu);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer.advert_mu) {
      return peer.adverts.contains(key) || peer.lost.load() || shut_down_.load();
    };
    peer.advert_mu.AwaitWithDeadline(ready, deadline);
    auto it = peer.adverts.find(key);
    if (it != peer.adverts.end()) return it->second;
    if (peer.lost) return absl::UnavailableError(absl::StrCat("rdma: ", PeerName(peer.id), " is gone"));
    return absl::DeadlineExceededError(absl::StrCat(
        "rdma: ", PeerName(peer.id), " never advertised a receive region for key ", key,
        " (waited ", absl::FormatDuration(options_.timeout), ")"));
  }

  void WakeAdvertWaiters(Peer& peer) {
    MutexLock lock(&peer.advert_mu);  // unlocking re-evaluates the waiters' conditions
  }

  absl::StatusOr<uint32_t> SourceKey(RegionId id, const std::byte* src, size_t bytes) {
    MutexLock lock(&regions_mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("rdma: source region ", id, " is not registered"));
    }
    const auto* base = static_cast<const std::byte*>(it->second->info.base);
    if (src < base || src + bytes > base + it->second->info.bytes()) {
      return absl::OutOfRangeError(absl::StrCat("rdma: source outside region ", id));
    }
    return it->second->local_mr->lkey;
  }

  // ---- Send path ----

  // Waits (without holding the QP lock: the receive thread returns credits on
  // the same QP) until the peer has a free receive for one more frame.
  absl::Status AwaitCredit(Peer& peer, QueuePair& qp, absl::Time deadline) {
    for (int spins = 0;; ++spins) {
      const uint64_t returned = std::atomic_ref<uint64_t>(*qp.mailbox).load(std::memory_order_acquire);
      if (qp.frames_sent - returned < peer.depth) return absl::OkStatus();
      if (peer.lost || peer.failed) {
        return absl::UnavailableError(absl::StrCat("rdma: ", PeerName(peer.id), " is gone"));
      }
      if ((spins & 1023) == 1023 && absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "rdma: ", PeerName(peer.id), " returned no receive credits within ",
            absl::FormatDuration(options_.timeout)));
      }
      std::this_thread::yield();
    }
  }

  // Posts a chain of `count` WRs, reserving send-queue slots and signalling
  // every signal_interval-th WR so slots keep coming back.
  absl::Status Post(Peer& peer, QueuePair& qp, ibv_send_wr* wrs, int count, absl::Time deadline) {
    MutexLock lock(&qp.mu);
    while (qp.posted - qp.completed + count > qp.max_send_wr) {
      STEPMESH_RETURN_IF_ERROR(ReapSends(peer, qp));
      if (qp.posted - qp.completed + count <= qp.max_send_wr) break;
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError("rdma: send queue did not drain");
      }
    }
    for (int i = 0; i < count; ++i) {
      wrs[i].wr_id = qp.posted + i + 1;
      if (++qp.since_signal >= qp.signal_interval) {
        wrs[i].send_flags |= IBV_SEND_SIGNALED;
        qp.since_signal = 0;
      }
    }
    ibv_send_wr* bad = nullptr;
    if (const int rc = verbs_->PostSend(qp.qp.get(), wrs, &bad); rc != 0) {
      absl::Status why = absl::UnavailableError(ErrnoMessage("rdma: ibv_post_send", rc));
      peer.RecordFailure(why);
      Wake();
      return why;
    }
    qp.posted += count;
    return absl::OkStatus();
  }

  absl::Status ReapSends(Peer& peer, QueuePair& qp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp.mu) {
    ibv_wc wc[16];
    const int n = verbs_->PollCq(qp.send_cq.get(), 16, wc);
    if (n < 0) {
      absl::Status why = absl::InternalError("rdma: polling the send CQ failed (overrun)");
      peer.RecordFailure(why);
      Wake();
      return why;
    }
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        absl::Status why = WcError(wc[i], "send");
        peer.RecordFailure(why);
        Wake();
        return why;
      }
      qp.completed = std::max(qp.completed, wc[i].wr_id);
    }
    return absl::OkStatus();
  }

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

  int ReportFailures(TransportSink& sink) {
    int reported = 0;
    const size_t count = peer_count_.load(std::memory_order_acquire);
    for (size_t i = 0; i < count; ++i) {
      Peer& peer = *peers_[i];
      if (!peer.failed.load(std::memory_order_acquire) || peer.lost) continue;
      absl::Status why;
      {
        MutexLock lock(&peer.fail_mu);
        why = peer.failure;
      }
      Lose(peer, sink, why);
      ++reported;
    }
    return reported;
  }

  int DrainCompletions(TransportSink& sink) {
    int work = 0;
    const size_t count = peer_count_.load(std::memory_order_acquire);
    for (size_t i = 0; i < count; ++i) {
      Peer& peer = *peers_[i];
      if (peer.lost) continue;
      ibv_wc wc[kPollBatch];
      const int n = verbs_->PollCq(peer.recv_cq.get(), kPollBatch, wc);
      if (n < 0) {
        Lose(peer, sink, absl::InternalError("rdma: receive CQ overrun"));
        continue;
      }
      for (int k = 0; k < n && !peer.lost; ++k) OnReceive(peer, wc[k], sink);
      work += n;
    }
    return work;
  }

  void OnReceive(Peer& peer, const ibv_wc& wc, TransportSink& sink) {
    if (wc.status != IBV_WC_SUCCESS) return Lose(peer, sink, WcError(wc, "receive"));
    const uint32_t q = static_cast<uint32_t>(wc.wr_id);
    if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(wc.wc_flags & IBV_WC_WITH_IMM) ||
        q >= peer.num_qps) {
      return Lose(peer, sink, absl::DataLossError("rdma: unexpected receive completion"));
    }
    QueuePair& qp = peer.qps[q];
    const uint32_t imm = ntohl(wc.imm_data);
    const uint32_t slot = static_cast<uint32_t>(qp.frames_received % peer.depth);
    ++qp.frames_received;
    if (rdma::ImmIsChunk(imm)) {
      if (q == 0 || (imm & rdma::kImmChunkMask) != (peer.stripes_seen & rdma::kImmChunkMask)) {
        return Lose(peer, sink, absl::DataLossError("rdma: stripe chunk out of order"));
      }
      ++peer.stripes_seen;
      Replenish(peer, qp, q);
      return DeliverParked(peer, sink);
    }
    if (q != 0 || rdma::ImmRingSlot(imm) != slot || wc.byte_len < kFrameBytes) {
      return Lose(peer, sink, absl::DataLossError("rdma: frame outside the header ring order"));
    }
    const std::byte* ring = qp.recv_ring + slot * kRingStride;
    absl::StatusOr<FrameHeader> header = DecodeFrame(absl::MakeConstSpan(ring, kFrameBytes));
    if (!header.ok()) {
      return Lose(peer, sink, absl::DataLossError(absl::StrCat("rdma: malformed frame from ",
                                                               PeerName(peer.id), ": ",
                                                               header.status().message())));
    }
    const size_t small = IsDataFrame(header->type) ? 0 : header->payload_bytes;
    if (small > kSmallPayloadMax || wc.byte_len != kFrameBytes + small) {
      return Lose(peer, sink, absl::DataLossError("rdma: frame length disagrees with its header"));
    }
    const uint32_t needed = rdma::ImmStripes(imm);
    if (peer.parked_count == 0 && rdma::StripesArrived(peer.stripes_seen, needed)) {
      Deliver(peer, *header, absl::MakeConstSpan(ring + kFrameBytes, small), sink);
    } else if (peer.parked_count < peer.parked.size()) {
      ParkedFrame& p = peer.parked[(peer.parked_head + peer.parked_count) % peer.parked.size()];
      p.header = *header;
      p.stripes_needed = needed;
      p.small_bytes = static_cast<uint32_t>(small);
      std::memcpy(p.small.data(), ring + kFrameBytes, small);
      ++peer.parked_count;
    } else {
      return Lose(peer, sink, absl::DataLossError("rdma: frame waits for stripes it cannot get"));
    }
    if (!peer.lost) Replenish(peer, qp, q);
  }

  void DeliverParked(Peer& peer, TransportSink& sink) {
    while (peer.parked_count > 0 && !peer.lost) {
      ParkedFrame& p = peer.parked[peer.parked_head];
      if (!rdma::StripesArrived(peer.stripes_seen, p.stripes_needed)) return;
      peer.parked_head = (peer.parked_head + 1) % peer.parked.size();
      --peer.parked_count;
      Deliver(peer, p.header, absl::MakeConstSpan(p.small.data(), p.small_bytes), sink);
    }
  }

  void Deliver(Peer& peer, const FrameHeader& header, absl::Span<const std::byte> small,
               TransportSink& sink) {
    if (header.src != peer.id) {
      return Lose(peer, sink, absl::PermissionDeniedError("rdma: frame claims another sender"));
    }
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
    MutexLock lock(&regions_mu_);
    auto it = receive_slots_.find({header.key, writer});
    if (it == receive_slots_.end()) {
      return absl::NotFoundError(absl::StrCat("rdma: no receive slot for key ", header.key,
                                              " from ", PeerName(writer)));
    }
    if (dest.data != it->second.data || header.payload_bytes > it->second.bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rdma: the destination for key ", header.key, " is not ", PeerName(writer),
          "'s advertised slot"));
    }
    return absl::OkStatus();
  }

  // Re-posts the consumed receive and, every quarter window, tells the peer.
  void Replenish(Peer& peer, QueuePair& qp, uint32_t q) {
    if (absl::Status st = PostReceive(qp, q); !st.ok()) {
      peer.RecordFailure(st);
      return;
    }
    ++qp.reposted;
    if (qp.reposted - qp.credits_returned < std::max<uint32_t>(1, peer.depth / 4)) return;
    qp.credits_returned = qp.reposted;
    std::atomic_ref<uint64_t>(*qp.credit_word).store(qp.reposted, std::memory_order_release);
    ibv_sge sge{reinterpret_cast<uintptr_t>(qp.credit_word), sizeof(uint64_t), peer.local_mr->lkey};
    ibv_send_wr wr{};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = qp.remote_mailbox;
    wr.wr.rdma.rkey = peer.remote_rkey;
    if (sizeof(uint64_t) <= qp.max_inline) wr.send_flags = IBV_SEND_INLINE;
    (void)Post(peer, qp, &wr, 1, absl::Now() + options_.timeout);  // failures are recorded
  }

  void HandleAsyncEvents(TransportSink& sink) {
    ibv_async_event event;
    while (verbs_->GetAsyncEvent(port_.context.get(), &event) == 0) {
      Peer* peer = nullptr;
      bool everyone = false;
      switch (event.event_type) {
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR:
          peer = static_cast<Peer*>(event.element.qp->qp_context);
          break;
        case IBV_EVENT_CQ_ERR:
          peer = static_cast<Peer*>(event.element.cq->cq_context);
          break;
        case IBV_EVENT_PORT_ERR:
        case IBV_EVENT_DEVICE_FATAL:
          everyone = true;
          break;
        default:
          STEPMESH_LOG(kInfo, "rdma: async event ", static_cast<int>(event.event_type));
          break;
      }
      const absl::Status why = absl::UnavailableError(
          absl::StrCat("rdma: asynchronous error event ", static_cast<int>(event.event_type),
                       " on ", port_.device_name));
      verbs_->AckAsyncEvent(&event);
      if (peer != nullptr) Lose(*peer, sink, why);
      if (everyone) {
        const size_t count = peer_count_.load(std::memory_order_acquire);
        for (size_t i = 0; i < count; ++i) Lose(*peers_[i], sink, why);
      }
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
    WakeAdvertWaiters(peer);
    sink.OnPeerLost(peer.id, std::move(why));
  }

  Peer* FindPeer(NodeId id) {
    MutexLock lock(&peers_mu_);
    auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : it->second;
  }

  const std::shared_ptr<VerbsApi> verbs_;  // first: every handle below releases through it
  const MeshOptions options_;
  const RdmaTuning tuning_;
  PortChoice port_;
  PdHandle pd_;
  ChannelHandle channel_;
  UniqueFd listener_;
  UniqueFd epoll_fd_;
  UniqueFd wake_fd_;
  NodeId self_ = kNoNode;
  std::mt19937 rng_{std::random_device{}()};
  uint8_t lag_ports_ = 0;  // > 1: a bonded device, QPs pinned per port
  std::atomic<bool> shut_down_{false};
  uint64_t busy_polls_ = 0;

  Mutex regions_mu_;  // before peers_mu_ and any peer's write_mu
  absl::flat_hash_map<RegionId, std::unique_ptr<LocalRegion>> regions_ ABSL_GUARDED_BY(regions_mu_);
  // Where each (key, writer) pair's payloads land: the slot advertised to it.
  absl::flat_hash_map<std::pair<uint64_t, NodeId>, ReceiveSlot> receive_slots_
      ABSL_GUARDED_BY(regions_mu_);

  Mutex peers_mu_;
  absl::flat_hash_map<NodeId, Peer*> by_id_ ABSL_GUARDED_BY(peers_mu_);
  // Fixed-size: slots below peer_count_ never move, so the receive thread reads
  // them without the lock; a replaced peer stays until the transport goes.
  std::vector<std::unique_ptr<Peer>> peers_;
  std::atomic<size_t> peer_count_{0};
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateRdmaTransport(const MeshOptions& options,
                                                               std::shared_ptr<VerbsApi> verbs,
                                                               const RdmaTuning& tuning) {
  if (verbs == nullptr) verbs = MakeRealVerbsApi();
  auto transport = std::make_unique<RdmaTransport>(options, std::move(verbs), tuning);
  STEPMESH_RETURN_IF_ERROR(transport->Open());
  return transport;
}

absl::StatusOr<std::unique_ptr<Transport>> CreateRdmaTransport(const MeshOptions& options,
                                                               std::shared_ptr<VerbsApi> verbs) {
  return CreateRdmaTransport(options, std::move(verbs), RdmaTuning());
}

bool RdmaDeviceAvailable() {
  std::shared_ptr<VerbsApi> verbs = MakeRealVerbsApi();
  return OpenPort(*verbs, MeshOptions()).ok();
}

}  // namespace stepmesh::rdma
