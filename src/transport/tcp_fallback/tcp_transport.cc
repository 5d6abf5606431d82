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
#include <map>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/base/net.h"
#include "src/base/sync.h"
#include "src/core/handshake.h"
#include "src/core/protocol.h"
#include "stepmesh/status.h"

namespace stepmesh::tcp {
namespace {

using core::AcceptHandshake;
using core::DecodeFrame;
using core::Destination;
using core::DialHandshake;
using core::EncodeFrame;
using core::FrameBytes;
using core::FrameHeader;
using core::FrameType;
using core::kFrameBytes;
using core::kMaxErrorTextBytes;
using core::kNoNode;
using core::NodeId;
using core::PeerInfo;
using core::RegionId;
using core::RegionInfo;
using core::Transport;
using core::TransportSink;

// A dialler gets this long to complete its handshake, so one silent client
// cannot hold up the acceptance of the real peers until the Connect deadline.
constexpr absl::Duration kHandshakeTimeout = absl::Seconds(5);
constexpr int kSocketBufferBytes = 8 << 20;
// The most SO_RCVLOWAT asks for (see SetLowWater): large payloads still wake
// the receive thread every 256 KiB, so its copy-out trails the sender's
// copy-in by at most that much. The kernel also caps it at half the receive
// buffer and reports readable anyway under memory pressure or a closing
// window, so a low water mark above what can arrive never stalls a frame.
constexpr size_t kLowWaterCap = 256 << 10;

// One peer's connection and the state of the frame being received on it.
struct Connection {
  enum class Stage { kHeader, kPayload, kDiscard };

  NodeId peer = kNoNode;
  base::UniqueFd fd;
  std::atomic<bool> alive{true};
  std::atomic<bool> superseded{false};  // replaced by a newer connection to the same peer
  bool said_goodbye = false;

  Stage stage = Stage::kHeader;
  FrameBytes header_bytes{};
  size_t header_got = 0;
  FrameHeader header;
  std::byte* dest = nullptr;   // kPayload: where the payload goes
  core::FrameContext context = nullptr;  // the core's, from Resolve to OnFrame
  size_t payload_got = 0;
  absl::Status rejection;      // kDiscard: why
  std::string error_text;      // kError payloads are read here
  int lowat = 1;               // the socket's SO_RCVLOWAT (receive thread only)
};

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const MeshOptions& options) : options_(options) {}
  ~TcpTransport() override { Shutdown(); }

  absl::string_view name() const override { return "tcp"; }

  absl::StatusOr<std::string> LocalEndpoint() override {
    if (!listener_.valid()) {
      STEPMESH_ASSIGN_OR_RETURN(listener_, base::ListenTcp(options_.bind_host, 0));
    }
    STEPMESH_ASSIGN_OR_RETURN(uint16_t port, base::LocalPort(listener_.get()));
    return absl::StrCat(options_.bind_host, ":", port);
  }

  absl::Status Connect(NodeId self, absl::Span<const PeerInfo> peers,
                       absl::Time deadline) override {
    // Connect may run again (a peer rejoined) while the receive thread polls:
    // the epoll set, the tables and each Connection stay valid throughout.
    {
      base::MutexLock lock(&mu_);
      if (self_ != self) self_ = self;
      if (!epoll_fd_.valid()) {
        epoll_fd_.Reset(::epoll_create1(EPOLL_CLOEXEC));
        wake_fd_.Reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
        if (!epoll_fd_.valid() || !wake_fd_.valid()) {
          return absl::InternalError(base::ErrnoMessage("epoll/eventfd", errno));
        }
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u64 = kWakeToken;
        ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, wake_fd_.get(), &ev);
      }
    }
    // Workers dial; servers accept. The hello names the dialler.
    std::vector<NodeId> expected;
    for (const PeerInfo& peer : peers) {
      if (core::IsWorker(self)) {
        STEPMESH_RETURN_IF_ERROR(Dial(self, peer, deadline));
      } else {
        expected.push_back(peer.id);
      }
    }
    while (!expected.empty()) {
      absl::StatusOr<base::UniqueFd> fd = base::AcceptTcp(listener_.get(), deadline);
      if (!fd.ok()) {
        return absl::DeadlineExceededError(absl::StrCat(
            expected.size(), " peer(s) never connected: ", fd.status().message()));
      }
      absl::StatusOr<NodeId> from =
          AcceptHandshake(fd->get(), self, expected, options_.auth_token,
                          std::min(deadline, absl::Now() + kHandshakeTimeout));
      if (!from.ok()) {
        STEPMESH_LOG(kWarning, "tcp: refused a data connection: ", from.status().ToString());
        continue;  // fd closes; keep waiting for the real peers
      }
      expected.erase(std::find(expected.begin(), expected.end(), *from));
      STEPMESH_RETURN_IF_ERROR(Adopt(*from, *std::move(fd)));
    }
    return absl::OkStatus();
  }

  absl::Status RegisterRegion(const RegionInfo&) override { return absl::OkStatus(); }
  absl::Status UnregisterRegion(RegionId) override { return absl::OkStatus(); }

  absl::Status Send(NodeId peer, const FrameHeader& header, const void* src, RegionId,
                    size_t bytes) override {
    Connection* conn = Find(peer);
    if (conn == nullptr) {
      return absl::NotFoundError(absl::StrCat("no connection to node 0x", absl::Hex(peer)));
    }
    if (!conn->alive) return absl::UnavailableError("connection to peer is closed");
    FrameBytes frame = EncodeFrame(header);
    iovec iov[2] = {{frame.data(), frame.size()}, {const_cast<void*>(src), bytes}};
    int iovcnt = bytes > 0 ? 2 : 1;
    iovec* next = iov;
    const absl::Time deadline = absl::Now() + options_.timeout;
    while (iovcnt > 0) {
      msghdr msg{};
      msg.msg_iov = next;
      msg.msg_iovlen = iovcnt;
      const ssize_t n = ::sendmsg(conn->fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          absl::StatusOr<bool> writable = WaitWritable(conn->fd.get(), deadline);
          if (!writable.ok()) return writable.status();
          if (!*writable) {
            return absl::DeadlineExceededError(absl::StrCat(
                "peer 0x", absl::Hex(peer), " did not drain its socket within ",
                absl::FormatDuration(options_.timeout)));
          }
          continue;
        }
        return absl::UnavailableError(base::ErrnoMessage("send to peer", errno));
      }
      size_t left = static_cast<size_t>(n);
      while (iovcnt > 0 && left >= next->iov_len) {
        left -= next->iov_len;
        ++next;
        --iovcnt;
      }
      if (iovcnt > 0) {
        next->iov_base = static_cast<char*>(next->iov_base) + left;
        next->iov_len -= left;
      }
    }
    return absl::OkStatus();
  }

  absl::Status Poll(TransportSink& sink, absl::Duration max_wait) override {
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
      if (events[i].data.u64 == kWakeToken) {
        uint64_t drain;
        (void)!::read(wake_fd_.get(), &drain, sizeof(drain));
        continue;
      }
      // Connections live as long as the transport, so the pointer stays valid
      // even when Connect adds or supersedes connections concurrently.
      auto* conn = static_cast<Connection*>(events[i].data.ptr);
      if (conn->alive) ReadFrom(*conn, sink);
    }
    return absl::OkStatus();
  }

  void Wake() override {
    const uint64_t one = 1;
    if (wake_fd_.valid()) (void)!::write(wake_fd_.get(), &one, sizeof(one));
  }

  void Shutdown() override {
    base::MutexLock lock(&mu_);
    for (auto& conn : connections_) {
      if (conn->alive && conn->fd.valid()) {
        FrameHeader bye;
        bye.type = FrameType::kGoodbye;
        bye.src = self_;
        bye.dst = conn->peer;
        FrameBytes frame = EncodeFrame(bye);
        (void)::send(conn->fd.get(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        ::shutdown(conn->fd.get(), SHUT_RDWR);
      }
      conn->alive = false;
    }
  }

 private:
  static constexpr uint64_t kWakeToken = ~uint64_t{0};

  static absl::StatusOr<bool> WaitWritable(int fd, absl::Time deadline) {
    pollfd pfd{fd, POLLOUT, 0};
    for (;;) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return false;
      const int rc = ::poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(left) + 1));
      if (rc > 0) return true;
      if (rc == 0) return false;
      if (errno != EINTR) return absl::InternalError(base::ErrnoMessage("poll", errno));
    }
  }

  // Worker side: connects to `peer`, completes the handshake, adopts the connection.
  absl::Status Dial(NodeId self, const PeerInfo& peer, absl::Time deadline) {
    STEPMESH_ASSIGN_OR_RETURN(base::HostPort where, base::ParseHostPort(peer.endpoint));
    absl::StatusOr<base::UniqueFd> fd = base::ConnectTcp(where, deadline);
    if (!fd.ok()) {
      return absl::UnavailableError(absl::StrCat("connecting to peer ", core::NodeRank(peer.id),
                                                 " at ", peer.endpoint, ": ",
                                                 fd.status().message()));
    }
    STEPMESH_RETURN_IF_ERROR(DialHandshake(fd->get(), self, peer.id, options_.auth_token,
                                           deadline));
    return Adopt(peer.id, *std::move(fd));
  }

  absl::Status Adopt(NodeId peer, base::UniqueFd fd) {
    STEPMESH_RETURN_IF_ERROR(base::SetNoDelay(fd.get()));
    STEPMESH_RETURN_IF_ERROR(base::SetBufferSizes(fd.get(), kSocketBufferBytes));
    STEPMESH_RETURN_IF_ERROR(base::SetNonBlocking(fd.get(), true));
    auto conn = std::make_unique<Connection>();
    conn->peer = peer;
    conn->fd = std::move(fd);
    base::MutexLock lock(&mu_);
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.ptr = conn.get();
    if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, conn->fd.get(), &ev) != 0) {
      return absl::InternalError(base::ErrnoMessage("epoll_ctl", errno));
    }
    auto old = by_peer_.find(peer);
    if (old != by_peer_.end()) {
      // A rejoined peer replaces its old connection; closing the old one must
      // not report the (new) peer as lost, hence `superseded` before `alive`.
      Connection& stale = *old->second;
      stale.superseded = true;
      if (stale.alive.exchange(false)) {
        ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, stale.fd.get(), nullptr);
        ::shutdown(stale.fd.get(), SHUT_RDWR);
      }
    }
    by_peer_[peer] = conn.get();
    connections_.push_back(std::move(conn));
    return absl::OkStatus();
  }

  Connection* Find(NodeId peer) {
    base::MutexLock lock(&mu_);
    auto it = by_peer_.find(peer);
    return it == by_peer_.end() ? nullptr : it->second;
  }

  void Lose(Connection& conn, TransportSink& sink, absl::Status why) {
    {
      base::MutexLock lock(&mu_);
      if (!conn.alive.exchange(false)) return;
      ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, conn.fd.get(), nullptr);
      ::shutdown(conn.fd.get(), SHUT_RDWR);
      if (conn.superseded) return;  // the peer is on a newer connection
    }
    sink.OnPeerLost(conn.peer, std::move(why));
  }

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
      if (n == 0) {
        Lose(conn, sink,
             absl::UnavailableError(
                 absl::StrCat(core::PeerName(conn.peer),
                              conn.said_goodbye ? " left" : " closed its connection")));
        return;
      }
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          SetLowWater(conn);
          return;
        }
        Lose(conn, sink, absl::UnavailableError(base::ErrnoMessage("recv from peer", errno)));
        return;
      }
      if (conn.stage == Connection::Stage::kHeader) {
        conn.header_got += static_cast<size_t>(n);
        if (conn.header_got == kFrameBytes) OnHeader(conn, sink);
      } else {
        if (conn.stage == Connection::Stage::kDiscard &&
            conn.header.type == FrameType::kError) {
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

  void OnHeader(Connection& conn, TransportSink& sink) {
    conn.header_got = 0;
    absl::StatusOr<FrameHeader> header = DecodeFrame(conn.header_bytes);
    if (!header.ok()) {
      // The byte stream cannot be resynchronised after a bad header.
      Lose(conn, sink, absl::DataLossError(absl::StrCat("malformed frame from peer: ",
                                                        header.status().message())));
      return;
    }
    if (header->src != conn.peer) {
      Lose(conn, sink, absl::PermissionDeniedError("frame claims another sender"));
      return;
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
          Lose(conn, sink, absl::DataLossError("oversized error frame"));
          return;
        }
        conn.stage = Connection::Stage::kDiscard;
        break;
      case FrameType::kGoodbye:
        conn.said_goodbye = true;
        [[fallthrough]];
      default:
        conn.stage = Connection::Stage::kDiscard;  // no payload expected; drain any
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
  NodeId self_ ABSL_GUARDED_BY(mu_) = kNoNode;
  base::UniqueFd listener_;
  base::UniqueFd epoll_fd_;
  base::UniqueFd wake_fd_;
  base::Mutex mu_;  // guards the tables; Connect may add connections while Poll runs
  std::vector<std::unique_ptr<Connection>> connections_;
  absl::flat_hash_map<NodeId, Connection*> by_peer_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(const MeshOptions& options) {
  return std::make_unique<TcpTransport>(options);
}

}  // namespace stepmesh::tcp
