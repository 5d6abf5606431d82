#include "src/transport/tcp_fallback/tcp_transport.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "src/base/admission.h"
#include "src/base/logging.h"
#include "src/base/net.h"
#include "src/base/rate_limit.h"
#include "src/base/sync.h"
#include "src/base/tsan.h"
#include "src/core/handshake.h"
#include "src/core/protocol.h"
#include "stepmesh/status.h"

namespace stepmesh::tcp {
namespace {

using core::DecodeFrame;
using core::Destination;
using core::DialHandshake;
using core::EncodeFrame;
using core::FrameBytes;
using core::FrameHeader;
using core::FrameType;
using core::HandshakeAcceptor;
using core::kFrameBytes;
using core::kMaxErrorTextBytes;
using core::kNoNode;
using core::NodeId;
using core::PeerInfo;
using core::PeerName;
using core::RegionId;
using core::RegionInfo;
using core::Transport;
using core::TransportSink;

// A dialler gets this long from accept to the end of its handshake, so one
// silent client costs a descriptor for a while, never a real peer's place.
constexpr absl::Duration kHandshakeTimeout = absl::Seconds(5);
// Connections still in their handshake, per source address and in total (at
// least these, room for every participant: CapsForPeers); the oldest goes
// first when a new one would exceed either.
constexpr size_t kMaxPendingPerAddress = 32;
constexpr size_t kMaxPending = 128;
constexpr int kSocketBufferBytes = 8 << 20;
// The most SO_RCVLOWAT asks for (see SetLowWater): large payloads still wake
// the receive thread every 256 KiB, so its copy-out trails the sender's
// copy-in by at most that much. The kernel also caps it at half the receive
// buffer and reports readable anyway under memory pressure or a closing
// window, so a low water mark above what can arrive never stalls a frame.
constexpr size_t kLowWaterCap = 256 << 10;
// Frames waiting for one peer's socket to drain. A healthy peer needs a few
// (a worker's pushes of its requests in flight; a server's replies to the
// batches it answered); the ring grows on demand up to this, then Send fails
// RESOURCE_EXHAUSTED naming the peer.
constexpr size_t kMaxQueuedFrames = 4096;
constexpr size_t kInitialQueueFrames = 16;
// Shutdown gives queued frames at most this long (or the timeout) to go out
// before the goodbye.
constexpr absl::Duration kShutdownFlush = absl::Seconds(2);

// epoll tokens besides Connection pointers.
constexpr uint64_t kWakeToken = ~uint64_t{0};
constexpr uint64_t kAcceptToken = ~uint64_t{0} - 1;
constexpr uint64_t kListenerToken = ~uint64_t{0} - 2;

// One frame waiting for its peer's socket: the encoded header, then the
// payload straight from registered memory (or `copy`, for the small
// unregistered payloads of error frames).
struct OutFrame {
  FrameBytes header{};
  const std::byte* payload = nullptr;
  size_t bytes = 0;
  size_t sent = 0;  // of kFrameBytes + bytes
  RegionId region = 0;
  std::string copy;
};

struct PeerSlot;

// One peer's connection: the frame being received (receive thread only) and
// the frames waiting to be sent (under the slot's lock).
struct Connection {
  enum class Stage { kHeader, kPayload, kDiscard };

  PeerSlot* slot = nullptr;
  NodeId peer = kNoNode;
  std::string address;  // the remote end, for logs
  base::UniqueFd fd;    // closed when the connection is destroyed (Reap), exactly once
  // The peer's half of "it answered, so the kernel is done with my bytes", for
  // ThreadSanitizer builds (empty otherwise): see WriteSome and ReadFrom.
  [[no_unique_address]] base::SocketCausality causality;
  std::atomic<bool> alive{true};
  bool superseded = false;  // replaced by a newer connection to the same peer
  bool said_goodbye = false;

  Stage stage = Stage::kHeader;
  FrameBytes header_bytes{};
  size_t header_got = 0;
  FrameHeader header;
  std::byte* dest = nullptr;             // kPayload: where the payload goes
  core::FrameContext context = nullptr;  // the core's, from Resolve to OnFrame
  size_t payload_got = 0;
  absl::Status rejection;  // kDiscard: why
  std::string error_text;  // kError payloads are read here
  int lowat = 1;           // the socket's SO_RCVLOWAT (receive thread only)

  // Send side, under slot->mu.
  std::vector<OutFrame> ring;
  size_t head = 0;
  size_t queued = 0;
  bool out_armed = false;    // EPOLLOUT requested
  absl::Time last_progress;  // the queue last moved (or started)
  absl::Status broken;       // a send failed: the receive thread loses it
  OutFrame& at(size_t i) { return ring[(head + i) % ring.size()]; }
};

// The connection to one peer rank; Send finds it without a lookup table and
// holds `mu` while it writes, so the connection cannot be replaced or closed
// under it.
struct PeerSlot {
  std::mutex mu;
  Connection* conn = nullptr;  // owned by the transport's connections_ list
};

// A connection in its handshake (accepted, not yet a peer's).
struct Pending {
  base::UniqueFd fd;
  std::string address;
  HandshakeAcceptor handshake;
  absl::Time deadline;
  bool parked = false;  // its hello names a peer not expected (yet)
  bool done = false;    // adopted, refused or dropped: freed at the end of the pump
  explicit Pending(std::string secret) : handshake(std::move(secret)) {}
};

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const MeshOptions& options)
      : options_(options),
        worker_slots_(static_cast<size_t>(options.num_workers)),
        server_slots_(static_cast<size_t>(options.num_servers)),
        handshake_caps_(base::CapsForPeers(
            static_cast<size_t>(options.num_workers) + static_cast<size_t>(options.num_servers),
            {kMaxPendingPerAddress, kMaxPending})) {}
  ~TcpTransport() override {
    Shutdown();
    // Every connection and handshake closes its descriptor as it is destroyed.
  }

  absl::Status Init() {
    epoll_fd_.Reset(::epoll_create1(EPOLL_CLOEXEC));
    accept_epoll_fd_.Reset(::epoll_create1(EPOLL_CLOEXEC));
    wake_fd_.Reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!epoll_fd_.valid() || !accept_epoll_fd_.valid() || !wake_fd_.valid()) {
      return absl::InternalError(base::ErrnoMessage("tcp: epoll/eventfd", errno));
    }
    STEPMESH_RETURN_IF_ERROR(Watch(epoll_fd_.get(), wake_fd_.get(), EPOLLIN, kWakeToken));
    // The handshakes have an epoll set of their own, watched by the receive
    // thread's as one descriptor: Connect can run them before that thread
    // exists, and the data path never iterates over them.
    return Watch(epoll_fd_.get(), accept_epoll_fd_.get(), EPOLLIN, kAcceptToken);
  }

  absl::string_view name() const override { return "tcp"; }

  absl::StatusOr<std::string> LocalEndpoint() override {
    std::lock_guard<std::mutex> lock(accept_mu_);
    if (!acceptor_.valid()) {
      STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd listener, base::ListenTcp(options_.bind_host, 0));
      // Accepted sockets inherit the buffer sizes, and with them a window
      // scale negotiated for 8 MiB (set after the handshake, it is too late).
      STEPMESH_RETURN_IF_ERROR(base::SetBufferSizes(listener.get(), kSocketBufferBytes));
      STEPMESH_ASSIGN_OR_RETURN(acceptor_, base::Acceptor::Create(std::move(listener)));
      STEPMESH_RETURN_IF_ERROR(
          Watch(accept_epoll_fd_.get(), acceptor_.fd(), EPOLLIN, kListenerToken));
    }
    STEPMESH_ASSIGN_OR_RETURN(uint16_t port, base::LocalPort(acceptor_.fd()));
    return absl::StrCat(core::AdvertisedHost(options_), ":", port);
  }

  absl::Status Connect(NodeId self, absl::Span<const PeerInfo> peers,
                       absl::Time deadline) override {
    self_.store(self, std::memory_order_release);
    // Workers dial; servers accept. The hello names the dialler.
    if (core::IsWorker(self)) {
      for (const PeerInfo& peer : peers) STEPMESH_RETURN_IF_ERROR(Dial(self, peer, deadline));
      return absl::OkStatus();
    }
    std::vector<NodeId> mine;
    {
      std::lock_guard<std::mutex> lock(accept_mu_);
      for (const PeerInfo& peer : peers) {
        expected_.insert(peer.id);
        mine.push_back(peer.id);
      }
    }
    // The handshakes run in the pump: here until the receive thread polls,
    // and on whichever thread gets the pump first afterwards.
    for (;;) {
      if (accept_mu_.try_lock()) {
        Pump(absl::ZeroDuration());
        accept_mu_.unlock();
      }
      std::vector<NodeId> missing;
      {
        std::lock_guard<std::mutex> lock(accept_mu_);
        for (NodeId id : mine) {
          if (expected_.contains(id)) missing.push_back(id);
        }
        if (missing.empty()) return absl::OkStatus();
        if (absl::Now() >= deadline || shut_down_.load()) {
          for (NodeId id : missing) expected_.erase(id);
          std::vector<std::string> names;
          for (NodeId id : missing) names.push_back(PeerName(id));
          return absl::DeadlineExceededError(absl::StrCat(
              missing.size(), " peer(s) never connected: ", absl::StrJoin(names, ", ")));
        }
      }
      pollfd pfd{accept_epoll_fd_.get(), POLLIN, 0};
      (void)::poll(&pfd, 1, 5);
    }
  }

  absl::Status RegisterRegion(const RegionInfo&) override { return absl::OkStatus(); }

  absl::Status UnregisterRegion(RegionId id) override {
    // Frames still queued read their payload from the region when the socket
    // drains: it must stay until they are out.
    for (auto* slots : {&worker_slots_, &server_slots_}) {
      for (PeerSlot& slot : *slots) {
        std::lock_guard<std::mutex> lock(slot.mu);
        Connection* c = slot.conn;
        if (c == nullptr) continue;
        for (size_t i = 0; i < c->queued; ++i) {
          if (c->at(i).region == id) {
            return absl::FailedPreconditionError(
                absl::StrCat("region ", id, " still has frames queued to ", PeerName(c->peer),
                             " (slow to read); try again"));
          }
        }
      }
    }
    return absl::OkStatus();
  }

  bool SendNeverWaits() const override { return true; }  // a full queue is RESOURCE_EXHAUSTED

  absl::Status Send(NodeId peer, const FrameHeader& header, const void* src, RegionId region,
                    size_t bytes) override {
    PeerSlot* slot = SlotOf(peer);
    if (slot == nullptr) {
      return absl::NotFoundError(absl::StrCat("tcp: no connection to ", PeerName(peer)));
    }
    std::lock_guard<std::mutex> lock(slot->mu);
    Connection* c = slot->conn;
    if (c == nullptr || !c->alive.load(std::memory_order_relaxed) || !c->broken.ok()) {
      return absl::UnavailableError(
          absl::StrCat("tcp: the connection to ", PeerName(peer), " is closed"));
    }
    FrameBytes frame = EncodeFrame(header);
    size_t sent = 0;
    if (c->queued == 0) {
      // Nothing waiting: write now. A socket with room takes the whole frame
      // (the usual case, no queueing at all); what it does not take waits in
      // the queue for writability, so this thread moves on to other peers.
      iovec iov[2] = {{frame.data(), frame.size()}, {const_cast<void*>(src), bytes}};
      absl::Status written = WriteSome(*c, iov, bytes > 0 ? 2 : 1, &sent);
      if (!written.ok()) return written;
      if (sent == kFrameBytes + bytes) return absl::OkStatus();
    }
    if (c->queued == kMaxQueuedFrames) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "tcp: the send queue to ", PeerName(peer), " is full (", kMaxQueuedFrames,
          " frames waiting: it has not read its socket for ",
          absl::FormatDuration(absl::Trunc(absl::Now() - c->last_progress, absl::Milliseconds(1))),
          ")"));
    }
    if (c->queued == c->ring.size()) Grow(*c);
    OutFrame& out = c->at(c->queued);
    out.header = frame;
    out.sent = sent;
    out.bytes = bytes;
    out.region = region;
    if (region == 0 && bytes > 0) {
      out.copy.assign(static_cast<const char*>(src), bytes);  // error texts: small, rare
      out.payload = reinterpret_cast<const std::byte*>(out.copy.data());
    } else {
      out.payload = static_cast<const std::byte*>(src);
    }
    if (c->queued++ == 0) {
      c->last_progress = absl::Now();
      ArmWritable(*c, true);
      backlogged_.fetch_add(1, std::memory_order_relaxed);
    }
    return absl::OkStatus();
  }

  absl::Status Poll(TransportSink& sink, absl::Duration max_wait) override {
    if (retired_.load(std::memory_order_acquire)) Reap();
    if (attention_.load(std::memory_order_acquire)) LoseBroken(sink);
    if (backlogged_.load(std::memory_order_relaxed) > 0 ||
        pending_count_.load(std::memory_order_relaxed) > 0 || accept_paused_.load()) {
      Housekeeping(sink);
    }
    epoll_event events[32];
    const int timeout_ms =
        max_wait <= absl::ZeroDuration()
            ? 0
            : static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(max_wait)));
    const int n = ::epoll_wait(epoll_fd_.get(), events, 32, timeout_ms);
    if (n < 0) {
      if (errno == EINTR) return absl::OkStatus();
      return absl::InternalError(base::ErrnoMessage("epoll_wait", errno));
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t token = events[i].data.u64;
      if (token == kWakeToken) {
        uint64_t drain;
        (void)!::read(wake_fd_.get(), &drain, sizeof(drain));
        continue;
      }
      if (token == kAcceptToken) {
        if (accept_mu_.try_lock()) {
          Pump(absl::ZeroDuration());
          accept_mu_.unlock();
        }
        continue;
      }
      // Connections are destroyed only by Reap (above, on this thread), so
      // the pointer stays valid even when Connect supersedes it meanwhile.
      auto* conn = static_cast<Connection*>(events[i].data.ptr);
      if (!conn->alive.load(std::memory_order_acquire)) continue;
      if (events[i].events & EPOLLOUT) Flush(*conn, sink);
      if (conn->alive.load(std::memory_order_relaxed) &&
          (events[i].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))) {
        ReadFrom(*conn, sink);
      }
    }
    return absl::OkStatus();
  }

  void Wake() override {
    const uint64_t one = 1;
    if (wake_fd_.valid()) (void)!::write(wake_fd_.get(), &one, sizeof(one));
  }
  int WaitFd() const override { return epoll_fd_.valid() ? epoll_fd_.get() : -1; }

  void Shutdown() override {
    if (shut_down_.exchange(true)) return;
    // Frames already queued go out first (the send thread has stopped), so
    // that the goodbye ends the stream on a frame boundary; a peer that does
    // not read within the bound gets no goodbye and sees the close as a loss.
    const absl::Time deadline = absl::Now() + std::min(options_.timeout, kShutdownFlush);
    const NodeId self = self_.load(std::memory_order_acquire);
    for (auto* slots : {&worker_slots_, &server_slots_}) {
      for (PeerSlot& slot : *slots) {
        std::lock_guard<std::mutex> lock(slot.mu);
        Connection* c = slot.conn;
        if (c == nullptr || !c->alive.load()) continue;
        while (c->queued > 0 && c->broken.ok() && absl::Now() < deadline) {
          pollfd pfd{c->fd.get(), POLLOUT, 0};
          (void)::poll(&pfd, 1, 10);
          DrainQueue(*c);
        }
        if (c->queued == 0 && c->broken.ok()) {
          FrameHeader bye;
          bye.type = FrameType::kGoodbye;
          bye.src = self;
          bye.dst = c->peer;
          FrameBytes frame = EncodeFrame(bye);
          (void)::send(c->fd.get(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        ::shutdown(c->fd.get(), SHUT_RDWR);
        c->alive.store(false);
      }
    }
  }

 private:
  static absl::Status Watch(int epoll_fd, int fd, uint32_t events, uint64_t token) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = token;
    if (::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return absl::InternalError(base::ErrnoMessage("tcp: epoll_ctl", errno));
    }
    return absl::OkStatus();
  }

  PeerSlot* SlotOf(NodeId peer) {
    auto& slots = core::IsWorker(peer) ? worker_slots_ : server_slots_;
    if (!core::IsWorker(peer) && !core::IsServer(peer)) return nullptr;
    const uint32_t rank = core::NodeRank(peer);
    return rank < slots.size() ? &slots[rank] : nullptr;
  }

  // --- sending ---

  // sendmsg without blocking until the iovecs are out or the socket is full;
  // adds what went out to *sent. A failure marks the connection broken.
  absl::Status WriteSome(Connection& c, iovec* iov, int iovcnt, size_t* sent) {
    while (iovcnt > 0) {
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = iovcnt;
      // The kernel reads registered memory here, and the application rewrites
      // it once the peer has answered: in TSan builds the connection carries
      // this thread's past and the kernel's read to whoever receives from it
      // (src/base/tsan.h). Nothing is suppressed in these functions.
      const ssize_t n = c.causality.SendMsg(c.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::OkStatus();
        c.broken = absl::UnavailableError(base::ErrnoMessage("send", errno));
        attention_.store(true, std::memory_order_release);
        Wake();
        return absl::UnavailableError(
            absl::StrCat("tcp: sending to ", PeerName(c.peer), ": ", c.broken.message()));
      }
      *sent += static_cast<size_t>(n);
      base::SkipWritten(static_cast<size_t>(n), &iov, &iovcnt);
    }
    return absl::OkStatus();
  }

  // Writes queued frames while the socket takes them (slot lock held).
  void DrainQueue(Connection& c) {
    while (c.queued > 0 && c.broken.ok()) {
      OutFrame& f = c.at(0);
      iovec iov[2];
      int iovcnt = 0;
      if (f.sent < kFrameBytes) {
        iov[iovcnt++] = {f.header.data() + f.sent, kFrameBytes - f.sent};
        if (f.bytes > 0) iov[iovcnt++] = {const_cast<std::byte*>(f.payload), f.bytes};
      } else {
        iov[iovcnt++] = {const_cast<std::byte*>(f.payload) + (f.sent - kFrameBytes),
                         kFrameBytes + f.bytes - f.sent};
      }
      const size_t before = f.sent;
      if (!WriteSome(c, iov, iovcnt, &f.sent).ok()) return;
      if (f.sent != before) c.last_progress = absl::Now();
      if (f.sent < kFrameBytes + f.bytes) return;  // the socket is full again
      f.copy.clear();
      f.payload = nullptr;
      c.head = (c.head + 1) % c.ring.size();
      --c.queued;
    }
    if (c.queued == 0 && c.out_armed) {
      ArmWritable(c, false);
      backlogged_.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  // Receive thread, on writability.
  void Flush(Connection& conn, TransportSink& sink) {
    {
      std::lock_guard<std::mutex> lock(conn.slot->mu);
      if (conn.slot->conn != &conn) return;
      DrainQueue(conn);
      if (conn.broken.ok()) return;
    }
    LoseBroken(sink);
  }

  void ArmWritable(Connection& c, bool on) {
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP | (on ? uint32_t{EPOLLOUT} : 0u);
    ev.data.ptr = &c;
    ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
    c.out_armed = on;
  }

  // Doubles a full ring (only while a peer is slow; steady state never grows it).
  static void Grow(Connection& c) {
    std::vector<OutFrame> bigger(
        std::min(kMaxQueuedFrames, std::max<size_t>(c.ring.size() * 2, kInitialQueueFrames)));
    for (size_t i = 0; i < c.queued; ++i) bigger[i] = std::move(c.at(i));
    c.ring = std::move(bigger);
    c.head = 0;
  }

  // --- losing connections ---

  // Receive thread: reports connections a send found broken.
  void LoseBroken(TransportSink& sink) {
    attention_.store(false, std::memory_order_release);
    for (auto* slots : {&worker_slots_, &server_slots_}) {
      for (PeerSlot& slot : *slots) {
        Connection* broken = nullptr;
        absl::Status why;
        {
          std::lock_guard<std::mutex> lock(slot.mu);
          if (slot.conn != nullptr && !slot.conn->broken.ok()) {
            broken = slot.conn;
            why = broken->broken;
          }
        }
        if (broken != nullptr) Lose(*broken, sink, why);
      }
    }
  }

  // Closes a connection (the descriptor itself at the next Reap) and reports
  // the peer lost unless a newer connection superseded it.
  void Lose(Connection& conn, TransportSink& sink, absl::Status why) {
    {
      std::lock_guard<std::mutex> lock(conn.slot->mu);
      if (!conn.alive.exchange(false)) return;
      Retire(conn);
      if (conn.superseded) return;  // the peer is on a newer connection
    }
    sink.OnPeerLost(conn.peer, std::move(why));
  }

  // Takes `conn` out of the epoll set and its slot (slot lock held); the
  // receive thread destroys it, closing its descriptor, at its next Poll.
  void Retire(Connection& conn) {
    ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, conn.fd.get(), nullptr);
    ::shutdown(conn.fd.get(), SHUT_RDWR);
    if (conn.out_armed) backlogged_.fetch_sub(1, std::memory_order_relaxed);
    conn.out_armed = false;
    conn.queued = 0;
    conn.ring.clear();
    if (conn.slot->conn == &conn) conn.slot->conn = nullptr;
    std::lock_guard<std::mutex> lock(connections_mu_);
    for (auto it = connections_.begin(); it != connections_.end(); ++it) {
      if (it->get() == &conn) {
        retired_list_.splice(retired_list_.end(), connections_, it);
        break;
      }
    }
    retired_.store(true, std::memory_order_release);
  }

  // Receive thread, before it waits: destroys retired connections. No event
  // of this thread's can name them any more (the previous epoll batch is done).
  void Reap() {
    std::list<std::unique_ptr<Connection>> dead;
    {
      std::lock_guard<std::mutex> lock(connections_mu_);
      dead.swap(retired_list_);
      retired_.store(false, std::memory_order_release);
    }
  }

  // Receive thread: peers whose queue has not moved for the timeout are lost;
  // handshakes past their deadline are dropped; a paused listener is resumed.
  void Housekeeping(TransportSink& sink) {
    const absl::Time now = absl::Now();
    if (now < next_housekeeping_) return;
    next_housekeeping_ = now + absl::Milliseconds(50);
    if (backlogged_.load(std::memory_order_relaxed) > 0) {
      for (auto* slots : {&worker_slots_, &server_slots_}) {
        for (PeerSlot& slot : *slots) {
          Connection* stalled = nullptr;
          absl::Status why;
          {
            std::lock_guard<std::mutex> lock(slot.mu);
            Connection* c = slot.conn;
            if (c != nullptr && c->queued > 0 && now - c->last_progress > options_.timeout) {
              stalled = c;
              size_t unsent = 0;
              for (size_t i = 0; i < c->queued; ++i) {
                unsent += kFrameBytes + c->at(i).bytes - c->at(i).sent;
              }
              why = absl::DeadlineExceededError(absl::StrCat(
                  "did not read its socket for ", absl::FormatDuration(options_.timeout), " (",
                  c->queued, " frames, ", unsent, " bytes waiting to be sent)"));
            }
          }
          if (stalled != nullptr) {
            STEPMESH_LOG(kWarning, "tcp: ", PeerName(stalled->peer), " (", stalled->address, ") ",
                         why.message(), "; closing the connection");
            Lose(*stalled, sink, why);
          }
        }
      }
    }
    if (accept_mu_.try_lock()) {
      Pump(absl::ZeroDuration());
      accept_mu_.unlock();
    }
  }

  // --- accepting (servers) ---

  // Runs the listener and the handshakes: accepts, advances every handshake
  // that has bytes, re-examines parked ones, expires overdue ones. Never
  // blocks longer than `max_wait`. accept_mu_ held.
  void Pump(absl::Duration max_wait) {
    if (!acceptor_.valid()) return;
    const absl::Time now_before = absl::Now();
    if (accept_paused_.load() && now_before >= acceptor_.paused_until()) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = kListenerToken;
      ::epoll_ctl(accept_epoll_fd_.get(), EPOLL_CTL_MOD, acceptor_.fd(), &ev);
      accept_paused_.store(false);
    }
    epoll_event events[64];
    const int n = ::epoll_wait(accept_epoll_fd_.get(), events, 64,
                               static_cast<int>(absl::ToInt64Milliseconds(max_wait)));
    for (int i = 0; i < n; ++i) {
      if (events[i].data.u64 == kListenerToken) {
        AcceptAll();
        continue;
      }
      auto* p = static_cast<Pending*>(events[i].data.ptr);
      if (!p->done) Advance(*p);
    }
    const absl::Time now = absl::Now();
    for (auto& p : pending_) {
      if (p->done) continue;
      if (p->parked) {
        Decide(*p);
        if (!p->parked) Answer(*p);
      }
      if (!p->done && now >= p->deadline) {
        Refuse(*p,
               absl::DeadlineExceededError(absl::StrCat(
                   p->parked ? absl::StrCat("its hello claims ", PeerName(p->handshake.claimed()),
                                            ", which is not expected here (",
                                            ConnectedFrom(p->handshake.claimed()), ")")
                             : std::string("did not finish its handshake"),
                   " within ", absl::FormatDuration(kHandshakeTimeout))));
      }
    }
    pending_.remove_if([](const std::unique_ptr<Pending>& p) { return p->done; });
    pending_count_.store(pending_.size(), std::memory_order_relaxed);
  }

  void AcceptAll() {
    for (int i = 0; i < 64; ++i) {
      base::Acceptor::Accepted a;
      switch (acceptor_.Accept(&a)) {
        case base::Acceptor::Outcome::kNone:
          return;
        case base::Acceptor::Outcome::kExhausted: {
          STEPMESH_LOG_LIMITED(
              exhausted_, kWarning, "tcp: out of file descriptors (",
              base::ErrnoMessage("accept", acceptor_.exhausted_errno()),
              "): closed a new data connection unserved; accepting again in 100 ms");
          epoll_event ev{};
          ev.events = 0;  // unwatched until paused_until (level-triggered: it would spin)
          ev.data.u64 = kListenerToken;
          ::epoll_ctl(accept_epoll_fd_.get(), EPOLL_CTL_MOD, acceptor_.fd(), &ev);
          accept_paused_.store(true);
          return;
        }
        case base::Acceptor::Outcome::kAccepted:
          break;
      }
      MakeRoomFor(a.peer);
      auto p = std::make_unique<Pending>(options_.auth_token);
      p->fd = std::move(a.fd);
      p->address = std::move(a.peer);
      p->deadline = absl::Now() + kHandshakeTimeout;
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLRDHUP;
      ev.data.ptr = p.get();
      if (::epoll_ctl(accept_epoll_fd_.get(), EPOLL_CTL_ADD, p->fd.get(), &ev) != 0) continue;
      Pending& added = *p;
      pending_.push_back(std::move(p));
      Advance(added);  // its hello is often there already
    }
  }

  // Makes room for one more handshake from `address` (base/admission.h).
  void MakeRoomFor(const std::string& address) {
    std::string why;
    std::unique_ptr<Pending>* evict = base::OldestOverCap(
        pending_, [](const std::unique_ptr<Pending>& p) { return !p->done; },
        [](const std::unique_ptr<Pending>& p) -> const std::string& { return p->address; }, address,
        handshake_caps_, &why);
    if (evict != nullptr) Drop(**evict, why);
  }

  void Advance(Pending& p) {
    while (p.handshake.step() == HandshakeAcceptor::Step::kRead) {
      std::byte in[core::kHelloBytes];
      const ssize_t n = ::recv(p.fd.get(), in, p.handshake.wanted(), MSG_DONTWAIT);
      if (n == 0) return Drop(p, "closed the connection during the handshake", /*quiet=*/true);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        return Drop(p, base::ErrnoMessage("recv", errno), /*quiet=*/true);
      }
      p.handshake.Received(absl::MakeConstSpan(in, static_cast<size_t>(n)));
      if (p.handshake.step() == HandshakeAcceptor::Step::kDecide) Decide(p);
      if (p.parked || !Answer(p)) return;
    }
  }

  // Whether the dialler may connect now: a peer of this mesh's other role
  // that a Connect expects. A hello for a peer not expected yet waits (its
  // rejoin notice may still be on the way) until its deadline, unwatched.
  void Decide(Pending& p) {
    if (p.handshake.step() != HandshakeAcceptor::Step::kDecide) return;
    const NodeId self = self_.load(std::memory_order_acquire);
    const NodeId from = p.handshake.claimed();
    const bool was_parked = p.parked;
    p.parked = false;
    if (self != kNoNode && core::IsWorker(self)) {
      p.handshake.Decide(
          self, absl::PermissionDeniedError(
                    "this node is a worker: it dials its peers and accepts no data connections"));
    } else if (!core::IsWorker(from) || core::NodeRank(from) >= worker_slots_.size()) {
      p.handshake.Decide(
          self, absl::PermissionDeniedError(absl::StrCat(
                    "its hello claims node 0x", absl::Hex(from), ", which is not one of the ",
                    worker_slots_.size(), " workers of this mesh")));
    } else if (self != kNoNode && expected_.contains(from)) {
      p.handshake.Decide(self, absl::OkStatus());
    } else {
      p.parked = true;
    }
    if (p.parked != was_parked) {
      // Parked, its socket is not watched: unread bytes would wake the pump forever.
      epoll_event ev{};
      ev.events = p.parked ? 0 : (EPOLLIN | EPOLLRDHUP);
      ev.data.ptr = &p;
      ::epoll_ctl(accept_epoll_fd_.get(), EPOLL_CTL_MOD, p.fd.get(), &ev);
    }
  }

  // Sends what the handshake has to say and acts on its outcome; false when
  // the handshake is over (adopted or refused).
  bool Answer(Pending& p) {
    if (p.done) return false;
    if (p.handshake.step() == HandshakeAcceptor::Step::kDone) {
      const NodeId from = p.handshake.claimed();
      if (!expected_.contains(from)) {
        // Another connection claiming the same peer finished first.
        p.handshake.Withdraw(absl::AlreadyExistsError(
            absl::StrCat("its hello claims ", PeerName(from), ", which is ", ConnectedFrom(from))));
      }
    }
    const std::string out = p.handshake.TakeOutput();
    if (!out.empty()) {
      const ssize_t n = ::send(p.fd.get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n != static_cast<ssize_t>(out.size())) {
        Drop(p, "does not take the handshake's reply");
        return false;
      }
    }
    switch (p.handshake.step()) {
      case HandshakeAcceptor::Step::kRead:
      case HandshakeAcceptor::Step::kDecide:
        return true;
      case HandshakeAcceptor::Step::kRefused:
        Refuse(p, p.handshake.refusal());
        return false;
      case HandshakeAcceptor::Step::kDone:
        break;
    }
    const NodeId from = p.handshake.claimed();
    ::epoll_ctl(accept_epoll_fd_.get(), EPOLL_CTL_DEL, p.fd.get(), nullptr);
    expected_.erase(from);
    absl::Status adopted = Adopt(from, std::move(p.fd), p.address);
    if (!adopted.ok()) {
      STEPMESH_LOG(kWarning, "tcp: cannot adopt the connection of ", PeerName(from), ": ",
                   adopted.ToString());
    }
    p.done = true;
    return false;
  }

  // "connected from ADDR" / "not connected" for a peer, for logs.
  std::string ConnectedFrom(NodeId peer) {
    PeerSlot* slot = SlotOf(peer);
    if (slot == nullptr) return "not a peer";
    std::lock_guard<std::mutex> lock(slot->mu);
    if (slot->conn == nullptr) return "not connected";
    return absl::StrCat("already connected from ", slot->conn->address);
  }

  void Refuse(Pending& p, const absl::Status& why) {
    if (p.handshake.step() != HandshakeAcceptor::Step::kRefused) {
      p.handshake.Withdraw(why);
      const std::string out = p.handshake.TakeOutput();
      (void)!::send(p.fd.get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    Drop(p, absl::StrCat("refused: ", why.message()));
  }

  // Ends a handshake: a protocol violation, logged (rate limited) with the
  // address and the reason unless `quiet` (a client that simply went away).
  void Drop(Pending& p, absl::string_view reason, bool quiet = false) {
    if (p.done) return;
    if (quiet) {
      STEPMESH_LOG(kInfo, "tcp: data connection from ", p.address, ": ", reason);
    } else {
      STEPMESH_LOG_LIMITED(violations_, kWarning, "tcp: data connection from ", p.address, ": ",
                           reason);
    }
    ::epoll_ctl(accept_epoll_fd_.get(), EPOLL_CTL_DEL, p.fd.get(), nullptr);
    p.fd.Reset();
    p.done = true;
  }

  // --- dialling (workers) ---

  absl::Status Dial(NodeId self, const PeerInfo& peer, absl::Time deadline) {
    STEPMESH_ASSIGN_OR_RETURN(base::HostPort where, base::ParseHostPort(peer.endpoint));
    absl::StatusOr<base::UniqueFd> fd = base::ConnectTcp(where, deadline);
    if (!fd.ok()) {
      return absl::UnavailableError(absl::StrCat("connecting to ", PeerName(peer.id), " at ",
                                                 peer.endpoint, ": ", fd.status().message()));
    }
    STEPMESH_RETURN_IF_ERROR(
        DialHandshake(fd->get(), self, peer.id, options_.auth_token, deadline));
    const std::string address = base::PeerAddress(fd->get());
    return Adopt(peer.id, *std::move(fd), address);
  }

  absl::Status Adopt(NodeId peer, base::UniqueFd fd, std::string address) {
    PeerSlot* slot = SlotOf(peer);
    if (slot == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(PeerName(peer), " is not in this mesh"));
    }
    STEPMESH_RETURN_IF_ERROR(base::SetNoDelay(fd.get()));
    STEPMESH_RETURN_IF_ERROR(base::SetBufferSizes(fd.get(), kSocketBufferBytes));
    STEPMESH_RETURN_IF_ERROR(base::SetNonBlocking(fd.get(), true));
    auto conn = std::make_unique<Connection>();
    conn->slot = slot;
    conn->peer = peer;
    conn->address = std::move(address);
    conn->fd = std::move(fd);
    conn->causality = base::SocketCausality::ForSocket(conn->fd.get());
    conn->ring.resize(kInitialQueueFrames);
    Connection* added = conn.get();
    {
      std::lock_guard<std::mutex> lock(connections_mu_);
      connections_.push_back(std::move(conn));
    }
    std::lock_guard<std::mutex> lock(slot->mu);
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.ptr = added;
    if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, added->fd.get(), &ev) != 0) {
      const absl::Status failed = absl::InternalError(base::ErrnoMessage("epoll_ctl", errno));
      added->alive.store(false);
      added->slot = slot;
      Retire(*added);
      return failed;
    }
    if (Connection* stale = slot->conn; stale != nullptr) {
      // A rejoined peer replaces its old connection; closing the old one must
      // not report the (new) peer as lost, hence `superseded` before `alive`.
      stale->superseded = true;
      if (stale->alive.exchange(false)) Retire(*stale);
    }
    slot->conn = added;
    return absl::OkStatus();
  }

  // --- receiving ---

  // Reads as much as is available, frame by frame, straight into destinations.
  void ReadFrom(Connection& conn, TransportSink& sink) {
    for (int rounds = 0; rounds < 64 && conn.alive; ++rounds) {
      void* into = nullptr;
      size_t want = 0;
      std::byte scratch[64 * 1024];
      switch (conn.stage) {
        case Connection::Stage::kHeader:
          into = conn.header_bytes.data() + conn.header_got;
          want = kFrameBytes - conn.header_got;
          break;
        case Connection::Stage::kPayload:
          into = conn.dest + conn.payload_got;
          want = conn.header.payload_bytes - conn.payload_got;
          break;
        case Connection::Stage::kDiscard:
          into = scratch;
          want = std::min(sizeof(scratch), conn.header.payload_bytes - conn.payload_got);
          break;
      }
      const ssize_t n = ::recv(conn.fd.get(), into, want, MSG_DONTWAIT);
      // What the peer did before sending these bytes (and what this process
      // sent before them) happened before their use here, and before the next
      // receive into the same memory: that one starts only after a header the
      // peer sent once it had this process's answer.
      if (n >= 0) conn.causality.Acquire();
      if (n == 0) {
        // CANCELLED: an orderly departure (see TransportSink::OnPeerLost).
        Lose(conn, sink,
             conn.said_goodbye ? absl::CancelledError("left")
                               : absl::UnavailableError("closed its connection"));
        return;
      }
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          SetLowWater(conn);
          return;
        }
        Lose(conn, sink, absl::UnavailableError(base::ErrnoMessage("recv", errno)));
        return;
      }
      if (conn.stage == Connection::Stage::kHeader) {
        conn.header_got += static_cast<size_t>(n);
        if (conn.header_got == kFrameBytes) OnHeader(conn, sink);
      } else {
        if (conn.stage == Connection::Stage::kDiscard && conn.header.type == FrameType::kError) {
          conn.error_text.append(reinterpret_cast<const char*>(scratch), static_cast<size_t>(n));
        }
        conn.payload_got += static_cast<size_t>(n);
        if (conn.payload_got == conn.header.payload_bytes) FinishFrame(conn, sink);
      }
    }
    // Out of rounds with bytes maybe still queued: the mark must fit the frame
    // now being read, or the rest of a short one would never be reported.
    if (conn.alive) SetLowWater(conn);
  }

  // Asks the kernel to report the connection readable (and wake the receive
  // thread) only once the rest of the current frame is there, or kLowWaterCap
  // of it. Without it, the receive thread chases the sender segment by
  // segment: a wake-up, an epoll round and a small copy per 64 KiB, with the
  // socket's lock and counters bouncing between the cores (measured in
  // docs/benchmarks.md). Set only when it changes, when leaving ReadFrom.
  void SetLowWater(Connection& conn) {
    size_t want = 0;
    switch (conn.stage) {
      case Connection::Stage::kHeader:
        want = kFrameBytes - conn.header_got;
        break;
      case Connection::Stage::kPayload:
      case Connection::Stage::kDiscard:
        want = conn.header.payload_bytes - conn.payload_got;
        break;
    }
    const int lowat = static_cast<int>(std::clamp<size_t>(want, 1, kLowWaterCap));
    if (lowat == conn.lowat) return;
    if (::setsockopt(conn.fd.get(), SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof(lowat)) == 0) {
      conn.lowat = lowat;
    }
  }

  // A peer broke the framing or lied about a header: the byte stream cannot
  // be trusted (or resynchronised) after it. Logged with the address.
  void Violation(Connection& conn, TransportSink& sink, absl::Status why) {
    STEPMESH_LOG_LIMITED(violations_, kWarning, "tcp: ", PeerName(conn.peer), " (", conn.address,
                         ") broke the protocol: ", why.message(), "; closing the connection");
    Lose(conn, sink, std::move(why));
  }

  void OnHeader(Connection& conn, TransportSink& sink) {
    conn.header_got = 0;
    absl::StatusOr<FrameHeader> header = DecodeFrame(conn.header_bytes);
    if (!header.ok()) {
      return Violation(
          conn, sink,
          absl::DataLossError(absl::StrCat("malformed frame (", header.status().message(), ")")));
    }
    if (header->src != conn.peer) {
      return Violation(conn, sink,
                       absl::PermissionDeniedError(absl::StrCat(
                           "a frame claims to come from node 0x", absl::Hex(header->src))));
    }
    const NodeId self = self_.load(std::memory_order_relaxed);
    if (header->dst != self) {
      return Violation(conn, sink,
                       absl::PermissionDeniedError(
                           absl::StrCat("a frame is addressed to node 0x", absl::Hex(header->dst),
                                        ", not to this node (0x", absl::Hex(self), ")")));
    }
    conn.header = *header;
    conn.payload_got = 0;
    conn.rejection = absl::OkStatus();
    conn.error_text.clear();
    switch (header->type) {
      case FrameType::kPush:
      case FrameType::kReply: {
        Destination dest;
        absl::Status resolved = sink.Resolve(conn.peer, conn.header, dest, &conn.context);
        if (resolved.ok() && dest.capacity < header->payload_bytes) {
          resolved = absl::OutOfRangeError("destination smaller than payload");
        }
        if (resolved.ok()) {
          conn.dest = dest.data;
          conn.stage = Connection::Stage::kPayload;
        } else {
          conn.rejection = std::move(resolved);
          conn.stage = Connection::Stage::kDiscard;
        }
        break;
      }
      case FrameType::kError:
        if (header->payload_bytes > kMaxErrorTextBytes) {
          return Violation(conn, sink, absl::DataLossError("oversized error frame"));
        }
        conn.stage = Connection::Stage::kDiscard;
        break;
      case FrameType::kGoodbye:
        conn.said_goodbye = true;
        [[fallthrough]];
      default:
        if (header->payload_bytes > 0) {
          return Violation(conn, sink,
                           absl::DataLossError(absl::StrCat(
                               "a frame of type ", static_cast<int>(header->type), " with ",
                               header->payload_bytes, " payload bytes (it carries none)")));
        }
        conn.stage = Connection::Stage::kDiscard;
        break;
    }
    if (conn.header.payload_bytes == 0) FinishFrame(conn, sink);
  }

  void FinishFrame(Connection& conn, TransportSink& sink) {
    const Connection::Stage stage = conn.stage;
    conn.stage = Connection::Stage::kHeader;
    switch (conn.header.type) {
      case FrameType::kPush:
      case FrameType::kReply:
        sink.OnFrame(conn.peer, conn.header, std::exchange(conn.context, nullptr),
                     stage == Connection::Stage::kPayload ? absl::OkStatus() : conn.rejection);
        break;
      case FrameType::kError:
        sink.OnFrame(
            conn.peer, conn.header, nullptr,
            absl::Status(static_cast<absl::StatusCode>(conn.header.status_code), conn.error_text));
        break;
      default:
        break;  // heartbeats and goodbyes need no delivery
    }
  }

  const MeshOptions options_;
  std::atomic<NodeId> self_{kNoNode};
  std::atomic<bool> shut_down_{false};
  base::UniqueFd epoll_fd_;
  base::UniqueFd accept_epoll_fd_;
  base::UniqueFd wake_fd_;

  // One slot per peer rank of each role; connections owned by connections_.
  std::vector<PeerSlot> worker_slots_;
  std::vector<PeerSlot> server_slots_;
  const base::AdmissionCaps handshake_caps_;
  std::mutex connections_mu_;
  std::list<std::unique_ptr<Connection>> connections_;   // live and superseded-but-open
  std::list<std::unique_ptr<Connection>> retired_list_;  // closed at the next Reap
  std::atomic<bool> retired_{false};
  std::atomic<bool> attention_{false};                   // a send found a connection broken
  std::atomic<int> backlogged_{0};                       // connections with frames waiting
  absl::Time next_housekeeping_ = absl::InfinitePast();  // receive thread only

  // The listener and the handshakes, run by whoever holds accept_mu_.
  std::mutex accept_mu_;
  base::Acceptor acceptor_;
  std::list<std::unique_ptr<Pending>> pending_;
  absl::flat_hash_set<NodeId> expected_;  // peers a Connect waits for
  std::atomic<size_t> pending_count_{0};
  std::atomic<bool> accept_paused_{false};

  base::RateLimiter violations_{10, absl::Seconds(10)};
  base::RateLimiter exhausted_{1, absl::Seconds(10)};
};

}  // namespace

absl::StatusOr<std::unique_ptr<core::Transport>> CreateTcpTransport(const MeshOptions& options) {
  auto transport = std::make_unique<TcpTransport>(options);
  STEPMESH_RETURN_IF_ERROR(transport->Init());
  return transport;
}

}  // namespace stepmesh::tcp
