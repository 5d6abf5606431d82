// Set-up, the control connection, the receive path and shutdown of the
// libfabric transport (the send path is send_path.cc).

#include "src/transport/libfabric/libfabric_transport.h"

#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <sys/epoll.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/core/protocol.h"
#include "src/transport/libfabric/transport_impl.h"
#include "stepmesh/status.h"

namespace stepmesh::libfabric {

using base::MutexLock;
using core::Destination;
using core::FrameHeader;
using core::FrameType;
using core::NodeId;
using core::PeerName;

namespace {

// The longest Poll sleeps in the control connection while nothing is in
// flight: libfabric's tcp and shm providers progress manually, so a write
// aimed at this node moves only while someone reads its CQ.
constexpr absl::Duration kIdleSlice = absl::Milliseconds(1);
// Shutdown gives posted writes at most this long (or the timeout) to finish.
constexpr absl::Duration kShutdownFlush = absl::Seconds(2);
// A goodbye with frames still counting: their writes get this long to land.
constexpr absl::Duration kDrainOnLoss = absl::Seconds(2);

// The RDMA path's rule (docs/rdma.md, GPUDirect RDMA): device tensors in
// place unless STEPMESH_RDMA_GPUDIRECT=off; only a CUDA participant asks.
bool WantsHmem(const MeshOptions& options) {
  return options.backend == "cuda" && options.rdma.gpudirect != GpuDirect::kOff;
}

uint64_t RandomEpoch() {
  std::random_device rd;
  uint64_t e = 0;
  while (e == 0) e = (uint64_t{rd()} << 32) ^ rd();
  return e;
}

// The control connection's frames: carriers become OnControl; losses reach
// the core after this transport forgot the peer's frames.
class ControlSink final : public core::TransportSink {
 public:
  ControlSink(LibfabricTransport& transport, core::TransportSink& core)
      : transport_(transport), core_(core) {}
  absl::Status Resolve(NodeId peer, const FrameHeader& header, Destination& out,
                       core::FrameContext* context) override {
    return absl::InvalidArgumentError("libfabric: data frames never travel on the control path");
  }
  void OnFrame(NodeId peer, const FrameHeader& header, core::FrameContext context,
               absl::Status status) override {
    if (header.type != FrameType::kError || header.key != kCarrierKey) return;
    transport_.OnControl(peer, status.message(), core_);
  }
  void OnPeerLost(NodeId peer, absl::Status why) override {
    transport_.OnPeerLost(peer, std::move(why), core_);
  }

 private:
  LibfabricTransport& transport_;
  core::TransportSink& core_;
};

}  // namespace

LibfabricTransport::LibfabricTransport(const MeshOptions& options,
                                       std::unique_ptr<core::Transport> control,
                                       std::vector<std::unique_ptr<FabricEndpoint>> rails,
                                       LibfabricHooks hooks)
    : options_(options),
      hooks_(std::move(hooks)),
      control_(std::move(control)),
      rails_(std::move(rails)),
      poster_(hooks_.poster ? hooks_.poster() : MakeDirectPoster()),
      epoch_(RandomEpoch()),
      stripe_min_bytes_(static_cast<size_t>(std::max<int64_t>(4096, options.fi_stripe_min_bytes))),
      hmem_wanted_(WantsHmem(options)) {
  // Large chunks: every chunk is one completion at the receiver.
  chunk_bytes_ = hooks_.chunk_bytes > 0 ? hooks_.chunk_bytes : size_t{4} << 20;
  for (const auto& rail : rails_) {
    if (rail->max_msg_size() > 0) chunk_bytes_ = std::min(chunk_bytes_, rail->max_msg_size());
  }
  SetUpWaitFds();
}

void LibfabricTransport::SetUpWaitFds() {
  if (options_.threads.poll_mode == PollMode::kSpin || control_->WaitFd() < 0) return;
  for (const auto& rail : rails_) {
    if (rail->wait_fd() < 0) return;  // shm: polled (kIdleSlice)
  }
  base::UniqueFd ep(::epoll_create1(EPOLL_CLOEXEC));
  if (!ep.valid()) return;
  auto watch = [&](int fd) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    return ::epoll_ctl(ep.get(), EPOLL_CTL_ADD, fd, &ev) == 0;
  };
  if (!watch(control_->WaitFd())) return;
  for (const auto& rail : rails_) {
    if (!watch(rail->wait_fd())) return;
  }
  wait_epoll_ = std::move(ep);
}

LibfabricTransport::~LibfabricTransport() {
  Shutdown();
  control_.reset();
  {
    MutexLock lock(&regions_mu_);
    regions_.clear();  // MRs before the domain
  }
  rails_.clear();  // closing the endpoints cancels what is still posted
  MutexLock lock(&tx_mu_);
  for (OpContext* ctx : live_) delete ctx;
  live_.clear();
}

absl::StatusOr<std::string> LibfabricTransport::LocalEndpoint() {
  STEPMESH_ASSIGN_OR_RETURN(std::string control, control_->LocalEndpoint());
  std::vector<std::string> hex;
  for (const auto& rail : rails_) hex.push_back(HexEncode(rail->address()));
  return absl::StrCat(control, "|", first().provider(), "|", absl::StrJoin(hex, ","));
}

absl::Status LibfabricTransport::Connect(NodeId self, absl::Span<const core::PeerInfo> peers,
                                         absl::Time deadline) {
  self_.store(self, std::memory_order_release);
  std::vector<core::PeerInfo> control_peers;
  for (const core::PeerInfo& peer : peers) {
    std::vector<std::string> parts = absl::StrSplit(peer.endpoint, '|');
    if (parts.size() != 3) {
      return absl::InvalidArgumentError(absl::StrCat(
          "libfabric: ", PeerName(peer.id), " published '", peer.endpoint,
          "', not a libfabric endpoint (host:port|provider|address,...): every participant "
          "must use the same transport"));
    }
    if (parts[1] != first().provider()) {
      return absl::FailedPreconditionError(absl::StrCat("libfabric: ", PeerName(peer.id),
                                                        " uses provider '", parts[1],
                                                        "', this node '", first().provider(), "'"));
    }
    // The published address goes into the address vector when the peer's
    // hello confirms it over its live control connection (OnHello), not
    // here: a peer that dies before it connects is never inserted (libfabric
    // 1.17's shm provider faults inserting the name of an endpoint that its
    // process has closed meanwhile).
    std::vector<std::string> addresses;
    for (absl::string_view hex : absl::StrSplit(parts[2], ',')) {
      absl::StatusOr<std::string> raw = HexDecode(hex);
      if (!raw.ok() || addresses.size() >= kMaxWireRails) {
        return absl::InvalidArgumentError(
            absl::StrCat(raw.ok() ? "libfabric: more than 32 rails" : raw.status().message(), " (",
                         PeerName(peer.id), "'s endpoint)"));
      }
      addresses.push_back(*std::move(raw));
    }
    {
      MutexLock lock(&av_mu_);
      published_[peer.id] = std::move(addresses);
    }
    control_peers.push_back({peer.id, parts[0]});
  }
  STEPMESH_RETURN_IF_ERROR(control_->Connect(self, control_peers, deadline));
  // Both ends say hello once connected; each answers a hello it has not
  // answered, so a restarted peer (a new epoch) is greeted again.
  for (const core::PeerInfo& peer : control_peers) {
    absl::Status st = SendControl(peer.id, HelloFor(peer.id));
    if (!st.ok())
      STEPMESH_LOG(kDebug, "libfabric: hello to ", PeerName(peer.id), ": ", st.ToString());
  }
  return absl::OkStatus();
}

absl::Status LibfabricTransport::SendControl(NodeId peer, const std::string& body) {
  FrameHeader h;
  h.type = FrameType::kError;
  h.src = self_.load(std::memory_order_acquire);
  h.dst = peer;
  h.key = kCarrierKey;
  h.status_code = static_cast<uint32_t>(absl::StatusCode::kUnknown);
  h.payload_bytes = body.size();
  MutexLock lock(&ctl_mu_);
  return control_->Send(peer, h, body.data(), 0, body.size());
}

std::string LibfabricTransport::HelloFor(NodeId peer) {
  Hello hello;
  hello.epoch = epoch_;
  hello.provider = first().provider();
  for (const auto& rail : rails_) hello.addresses.push_back(rail->address());
  MutexLock lock(&recv_mu_);
  RecvPeer& rp = recv_peers_[peer];  // may exist already: a frame came before any hello
  if (!rp.has_tag) {
    for (uint32_t i = 0; i < kMaxTags; ++i) {
      const uint32_t tag = (next_tag_ + i) % kMaxTags;
      if (tag_owner_[tag] == core::kNoNode) {
        tag_owner_[tag] = peer;
        rp.tag = tag;
        rp.has_tag = true;
        next_tag_ = tag + 1;
        break;
      }
    }
    // kMaxTags (4096) writers at once is the mesh's limit of workers per
    // server; beyond it a writer's immediates could not be told apart.
    if (!rp.has_tag) STEPMESH_LOG(kError, "libfabric: no writer tag left for ", PeerName(peer));
  }
  hello.your_tag = rp.tag;
  hello.your_epoch = rp.epoch;
  return EncodeHello(hello);
}

void LibfabricTransport::OnHello(NodeId peer, const Hello& hello) {
  if (hello.your_epoch != 0 && hello.your_epoch != epoch_) {
    // Made for the process this one replaced (the peer's Connect for a
    // rejoiner can read its state before the rejoiner's hello arrives): its
    // tag is that process's, released since. The peer answers this
    // process's hello with one of its own.
    STEPMESH_LOG(kDebug, "libfabric: ", PeerName(peer),
                 "'s hello was made for this rank's previous process; ignored");
    return;
  }
  if (hello.provider != first().provider()) {
    STEPMESH_LOG_LIMITED(warnings_, kWarning, "libfabric: ", PeerName(peer), " uses provider '",
                         hello.provider, "', this node '", first().provider(),
                         "'; ignoring its hello");
    return;
  }
  // Rail r writes to the peer's rail r, on the rails both ends have (a
  // peer with fewer NICs is striped over fewer).
  std::vector<fi_addr_t> addrs;
  {
    MutexLock lock(&av_mu_);
    auto published = published_.find(peer);
    if (published != published_.end() && published->second != hello.addresses) {
      // It restarted since the roster we were given: its hello is the live one.
      STEPMESH_LOG(kInfo, "libfabric: ", PeerName(peer),
                   " says hello from another fabric address than it published");
    }
    const size_t shared = std::min(rails_.size(), hello.addresses.size());
    for (size_t r = 0; r < shared; ++r) {
      absl::StatusOr<fi_addr_t> addr = rails_[r]->Resolve(hello.addresses[r]);
      if (!addr.ok()) {
        STEPMESH_LOG_LIMITED(warnings_, kWarning, "libfabric: ", PeerName(peer), ": ",
                             addr.status().ToString());
        return;
      }
      addrs.push_back(*addr);
    }
  }
  bool answer = false;
  {
    MutexLock lock(&recv_mu_);
    RecvPeer& rp = recv_peers_[peer];
    if (rp.epoch != 0 && rp.epoch != hello.epoch) {
      // A restarted peer: its frame numbers start again, and its old writes
      // must not count towards the new ones, so it gets a new tag.
      if (rp.has_tag) tag_owner_[rp.tag] = core::kNoNode;
      recv_peers_.erase(peer);
    }
  }
  std::string ours = HelloFor(peer);
  {
    MutexLock lock(&recv_mu_);
    RecvPeer& rp = recv_peers_[peer];
    rp.epoch = hello.epoch;
    if (rp.expelled) rp.answered = 0;  // it reconnected: greet it again
    rp.expelled = false;
    answer = rp.answered != hello.epoch;
    rp.answered = hello.epoch;
  }
  std::shared_ptr<SendPeer> sp = PeerFor(peer);
  {
    MutexLock lock(&sp->mu);
    if (sp->epoch != hello.epoch) {
      sp->adverts.clear();
      sp->next_seq = 0;
      DropQueue(*sp);
    }
    sp->epoch = hello.epoch;
    sp->addrs = std::move(addrs);
    sp->tag = hello.your_tag;
    sp->hello = true;
    sp->expelled = false;
  }
  if (answer) {
    absl::Status st = SendControl(peer, ours);
    if (!st.ok()) STEPMESH_LOG(kDebug, "libfabric: hello to ", PeerName(peer), ": ", st.ToString());
  }
  SendAdverts(peer);
}

void LibfabricTransport::OnControl(NodeId peer, absl::string_view bytes,
                                   core::TransportSink& sink) {
  absl::StatusOr<ControlMessage> msg = DecodeControl(bytes);
  if (!msg.ok()) {
    STEPMESH_LOG_LIMITED(warnings_, kWarning, "libfabric: from ", PeerName(peer), ": ",
                         msg.status().ToString());
    return;
  }
  if (msg->type != ControlType::kHello) {
    MutexLock lock(&recv_mu_);
    auto it = recv_peers_.find(peer);
    if (it != recv_peers_.end() && it->second.expelled) return;
  }
  switch (msg->type) {
    case ControlType::kHello:
      OnHello(peer, msg->hello);
      return;
    case ControlType::kExpel: {
      {
        std::shared_ptr<SendPeer> sp = PeerFor(peer);
        MutexLock lock(&sp->mu);
        sp->expelled = true;
        DropQueue(*sp);
      }
      {
        MutexLock lock(&recv_mu_);
        RecvPeer& rp = recv_peers_[peer];
        rp.expelled = true;
        rp.frames = FrameAssembler();
      }
      sink.OnPeerLost(peer,
                      absl::UnavailableError(absl::StrCat("libfabric: ", PeerName(peer),
                                                          " dropped this node: ", msg->reason)));
      return;
    }
    case ControlType::kAdvert:
    case ControlType::kWithdraw: {
      std::shared_ptr<SendPeer> sp = PeerFor(peer);
      MutexLock lock(&sp->mu);
      if (msg->type == ControlType::kAdvert) {
        sp->adverts[msg->advert.key] = msg->advert;
      } else {
        sp->adverts.erase(msg->advert.key);
      }
      return;
    }
    case ControlType::kFrame: {
      const FrameHeader& h = msg->frame.header;
      const NodeId self = self_.load(std::memory_order_acquire);
      if (h.src != peer || h.dst != self) {
        return Expel(peer,
                     absl::PermissionDeniedError(
                         absl::StrCat("a frame claims to come from ", PeerName(h.src), " to ",
                                      PeerName(h.dst), " (this node is ", PeerName(self), ")")),
                     sink);
      }
      {
        MutexLock lock(&recv_mu_);
        recv_peers_[peer].frames.OnDescriptor(std::move(msg->frame), absl::Now());
      }
      DeliverReady(peer, sink);
      return;
    }
    case ControlType::kAbort: {
      {
        MutexLock lock(&recv_mu_);
        recv_peers_[peer].frames.OnAbort(
            msg->frame.seq,
            absl::DataLossError(absl::StrCat("libfabric: ", PeerName(peer),
                                             " could not write the payload: ", msg->reason)));
      }
      DeliverReady(peer, sink);
      return;
    }
  }
}

// A peer that broke the protocol is dropped as TCP drops its connection:
// it is told (so that its requests fail now), its frames are forgotten, and
// the core hears of the loss; it is heard again only after a new hello.
void LibfabricTransport::Expel(NodeId peer, absl::Status why, core::TransportSink& sink) {
  STEPMESH_LOG_LIMITED(warnings_, kWarning, "libfabric: ", PeerName(peer),
                       " broke the protocol: ", why.message(), "; dropping it");
  {
    MutexLock lock(&recv_mu_);
    RecvPeer& rp = recv_peers_[peer];
    rp.expelled = true;
    rp.frames = FrameAssembler();
  }
  {
    std::shared_ptr<SendPeer> sp = PeerFor(peer);
    MutexLock lock(&sp->mu);
    DropQueue(*sp);
  }
  (void)SendControl(peer, EncodeExpel(why.message()));
  sink.OnPeerLost(peer, std::move(why));
}

void LibfabricTransport::OnPeerLost(NodeId peer, absl::Status why, core::TransportSink& sink) {
  // Frames that were on their way before the goodbye get a moment to land.
  const absl::Time until = absl::Now() + std::min(kDrainOnLoss, options_.timeout);
  for (;;) {
    {
      MutexLock lock(&recv_mu_);
      auto it = recv_peers_.find(peer);
      if (it == recv_peers_.end() || !it->second.frames.waiting()) break;
    }
    if (absl::Now() >= until) break;
    Progress();
    ReadReceives(sink);
    std::this_thread::yield();
  }
  {
    MutexLock lock(&recv_mu_);
    auto it = recv_peers_.find(peer);
    if (it != recv_peers_.end()) it->second.frames = FrameAssembler();
  }
  {
    std::shared_ptr<SendPeer> sp = PeerFor(peer);
    MutexLock lock(&sp->mu);
    DropQueue(*sp);
  }
  sink.OnPeerLost(peer, std::move(why));
}

void LibfabricTransport::ReadReceives(core::TransportSink& sink) {
  for (const auto& rail : rails_) ReadReceives(*rail, sink);
}

// A stripe's writes land on the receiver's rail of the same number; they all
// carry the frame's immediate, so counting does not care which rail.
void LibfabricTransport::ReadReceives(FabricEndpoint& rail, core::TransportSink& sink) {
  fi_cq_data_entry entries[32];
  for (int round = 0; round < 16; ++round) {
    const ssize_t n = fi_cq_read(rail.rx_cq(), entries, 32);
    if (n == -FI_EAGAIN) return;
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      if (fi_cq_readerr(rail.rx_cq(), &err, 0) > 0) {
        STEPMESH_LOG_LIMITED(warnings_, kWarning, "libfabric ", rail.provider(), " ", rail.Name(),
                             ": receive completion error ", err.err, " (",
                             fi_cq_strerror(rail.rx_cq(), err.prov_errno, err.err_data, nullptr, 0),
                             ")");
      }
      continue;
    }
    if (n < 0) {
      STEPMESH_LOG_LIMITED(warnings_, kWarning, rail.Error("fi_cq_read", static_cast<int>(n)));
      return;
    }
    absl::flat_hash_set<NodeId> touched;
    {
      MutexLock lock(&recv_mu_);
      for (ssize_t i = 0; i < n; ++i) {
        if ((entries[i].flags & FI_REMOTE_CQ_DATA) == 0) continue;
        const NodeId writer = tag_owner_[ImmediateTag(entries[i].data)];
        if (writer == core::kNoNode) continue;  // a peer forgotten since (restarted)
        recv_peers_[writer].frames.OnChunk(ImmediateSeq(entries[i].data));
        touched.insert(writer);
      }
    }
    for (NodeId writer : touched) DeliverReady(writer, sink);
    if (n < 32) return;
  }
}

void LibfabricTransport::DeliverReady(NodeId peer, core::TransportSink& sink) {
  for (;;) {
    PendingFrame frame;
    {
      MutexLock lock(&recv_mu_);
      auto it = recv_peers_.find(peer);
      if (it == recv_peers_.end()) return;
      PendingFrame* ready = it->second.frames.Ready();
      if (ready == nullptr) return;
      frame = std::move(*ready);
      it->second.frames.Pop();
    }
    Deliver(peer, frame, sink);
  }
}

void LibfabricTransport::Deliver(NodeId peer, PendingFrame& frame, core::TransportSink& sink) {
  const FrameHeader& header = frame.header;
  switch (header.type) {
    case FrameType::kPush:
    case FrameType::kReply: {
      Destination dest;
      core::FrameContext context = nullptr;
      absl::Status status = sink.Resolve(peer, header, dest, &context);
      if (status.ok() && !frame.failure.ok()) status = frame.failure;
      if (status.ok() && header.payload_bytes > 0) {
        if (dest.capacity < header.payload_bytes) {
          status = absl::OutOfRangeError("destination smaller than payload");
        } else if (frame.chunks == 0) {
          std::memcpy(dest.data, frame.inline_bytes.data(), header.payload_bytes);
        } else {
          status = CheckLanding(peer, header, dest);
        }
      }
      sink.OnFrame(peer, header, context, status);
      return;
    }
    case FrameType::kError:
      sink.OnFrame(
          peer, header, nullptr,
          absl::Status(static_cast<absl::StatusCode>(header.status_code), frame.inline_bytes));
      return;
    default:
      return;
  }
}

absl::Status LibfabricTransport::CheckLanding(NodeId writer, const FrameHeader& header,
                                              const Destination& dest) {
  MutexLock lock(&recv_mu_);
  auto it = receive_slots_.find({header.key, writer});
  if (it == receive_slots_.end()) {
    return absl::NotFoundError(absl::StrCat("libfabric: no receive slot for key ", header.key,
                                            " from ", PeerName(writer)));
  }
  if (dest.data != it->second.data || header.payload_bytes > it->second.bytes) {
    return absl::FailedPreconditionError(absl::StrCat("libfabric: the destination for key ",
                                                      header.key, " is not ", PeerName(writer),
                                                      "'s advertised slot"));
  }
  return absl::OkStatus();
}

// A frame whose writes have not all landed within the timeout fails (its
// writer may have died between descriptor and payload); later ones move on.
void LibfabricTransport::ExpireWaiting(core::TransportSink& sink) {
  const absl::Time stale = absl::Now() - options_.timeout;
  std::vector<NodeId> expired;
  {
    MutexLock lock(&recv_mu_);
    for (auto& [peer, rp] : recv_peers_) {
      if (rp.frames.oldest() < stale) {
        rp.frames.FailOldest(absl::DeadlineExceededError(
            absl::StrCat("libfabric: the payload from ", PeerName(peer), " did not land within ",
                         absl::FormatDuration(options_.timeout))));
        expired.push_back(peer);
      }
    }
  }
  for (NodeId peer : expired) DeliverReady(peer, sink);
}

bool LibfabricTransport::Busy() {
  if (outstanding_.load(std::memory_order_relaxed) > 0) return true;
  MutexLock lock(&recv_mu_);
  for (const auto& [peer, rp] : recv_peers_) {
    if (rp.frames.waiting()) return true;
  }
  return false;
}

absl::Status LibfabricTransport::Poll(core::TransportSink& sink, absl::Duration max_wait) {
  ControlSink control(*this, sink);
  Progress();
  ReadReceives(sink);
  ExpireWaiting(sink);
  const bool busy = Busy() || poster_->Progress();
  absl::Duration control_wait = absl::ZeroDuration();
  if (!busy && max_wait > absl::ZeroDuration() && !SleepInWaitFds(max_wait)) {
    control_wait = std::min(max_wait, kIdleSlice);  // no wait object: poll the CQs every slice
  }
  absl::Status st = control_->Poll(control, control_wait);
  ReadReceives(sink);
  return st;
}

// Sleeps until a CQ or the control connection has something, Wake, or
// `max_wait` -- with libfabric's fi_trywait protocol: it says whether the
// wait fds may be slept on (nothing already queued, the provider's progress
// armed), so a completion cannot slip in between the last read and the sleep.
bool LibfabricTransport::SleepInWaitFds(absl::Duration max_wait) {
  if (!wait_epoll_.valid()) return false;
  sleeping_.store(true);
  // A write posted before `sleeping_` was set is seen here; one after it
  // wakes this thread (WakeSleeper).
  bool may_sleep = outstanding_.load() == 0;
  for (const auto& rail : rails_) {
    if (!may_sleep) break;
    fid* cq = &rail->rx_cq()->fid;
    may_sleep = fi_trywait(rail->fabric(), &cq, 1) == FI_SUCCESS;
  }
  if (may_sleep) {
    epoll_event events[kMaxRails + 1];
    const int timeout_ms =
        static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(max_wait), 1, 1000));
    (void)::epoll_wait(wait_epoll_.get(), events, kMaxRails + 1, timeout_ms);
  }
  sleeping_.store(false);
  return true;
}

void LibfabricTransport::Shutdown() {
  if (shut_down_.exchange(true)) return;
  const absl::Time until = absl::Now() + std::min(kShutdownFlush, options_.timeout);
  while (outstanding_.load() > 0 && absl::Now() < until) {
    Progress();
    poster_->Progress();
    std::this_thread::yield();
  }
  control_->Shutdown();
}

absl::StatusOr<std::unique_ptr<core::Transport>> CreateLibfabricTransport(
    const MeshOptions& options, core::TransportFactory control, LibfabricHooks hooks) {
  const FabricApi* api = hooks.api;
  if (api == nullptr) {
    STEPMESH_ASSIGN_OR_RETURN(api, LoadFabricApi());
  }
  EndpointConfig config;
  config.provider = options.fi_provider;
  config.host = options.bind_host;
  config.nics = options.fi_nics;
  config.wait_fd = options.threads.poll_mode != PollMode::kSpin;
  config.hmem = WantsHmem(options);
  STEPMESH_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<FabricEndpoint>> rails,
                            FabricEndpoint::OpenRails(*api, config));
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<core::Transport> inner, control(options));
  std::vector<std::string> nics;
  for (const auto& rail : rails) nics.push_back(rail->domain_name());
  STEPMESH_LOG(kInfo, "libfabric: provider ", rails.front()->provider(), ", cq data ",
               rails.front()->cq_data_size(), " bytes, ", rails.size(), " rail(s) on ",
               absl::StrJoin(nics, ", "),
               rails.front()->wait_fd() >= 0 ? ", CQ wait fd" : ", CQs polled",
               rails.front()->hmem() ? ", FI_HMEM" : "");
  return std::make_unique<LibfabricTransport>(options, std::move(inner), std::move(rails),
                                              std::move(hooks));
}

}  // namespace stepmesh::libfabric
