#include "src/transport/tcp_fallback/tcp_transport.h"

#include <linux/sockios.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/base/sync.h"
#include "src/transport/tcp_fallback/tcp_transport_impl.h"
#include "stepmesh/status.h"

namespace stepmesh::tcp::internal {

absl::Status TcpTransport::Init() {
  if (!options_.tcp_rails.empty()) {
    STEPMESH_ASSIGN_OR_RETURN(rail_hosts_, ResolveRails(options_.tcp_rails));
  }
  stripe_min_bytes_ = static_cast<size_t>(std::max<int64_t>(4096, options_.tcp_stripe_min_bytes));
  runnable_.reserve(kMaxRails * (worker_slots_.size() + server_slots_.size()) + 1);
  absl::StatusOr<base::EventLoop> loop = base::EventLoop::Create();
  if (!loop.ok()) return absl::InternalError(absl::StrCat("tcp: ", loop.status().message()));
  loop_ = *std::move(loop);
  // The handshakes have a set of their own, watched by the receive thread's
  // as one descriptor: Connect can run them before that thread exists, and
  // the data path never iterates over them. Its waits never block (Pump):
  // it needs no wake of its own.
  loop = base::EventLoop::Create(base::EventLoop::Wakeable::kNo);
  if (!loop.ok()) return absl::InternalError(absl::StrCat("tcp: ", loop.status().message()));
  handshakes_ = *std::move(loop);
  return Check(loop_.WatchLoop(handshakes_, kAcceptToken));
}

absl::StatusOr<std::string> TcpTransport::LocalEndpoint() {
  std::lock_guard<std::mutex> lock(accept_mu_);
  if (acceptors_.empty()) {
    // Without rails one listener on bind_host; with them one per rail
    // address, so that the listener that accepts names the rail.
    std::vector<std::string> hosts = rail_hosts_;
    if (hosts.empty()) hosts.push_back(options_.bind_host);
    std::vector<base::Acceptor> made;
    for (const std::string& host : hosts) {
      STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd listener, base::ListenTcp(host, 0));
      // Accepted sockets inherit the buffer sizes, and with them a window
      // scale negotiated for 8 MiB (set after the handshake, it is too late).
      STEPMESH_RETURN_IF_ERROR(base::SetBufferSizes(listener.get(), kSocketBufferBytes));
      STEPMESH_ASSIGN_OR_RETURN(base::Acceptor acceptor,
                                base::Acceptor::Create(std::move(listener)));
      made.push_back(std::move(acceptor));
    }
    for (size_t r = 0; r < made.size(); ++r) {
      STEPMESH_RETURN_IF_ERROR(Check(handshakes_.Watch(made[r].fd(), EPOLLIN, kListenerToken - r)));
    }
    acceptors_ = std::move(made);
    acceptor_paused_.assign(acceptors_.size(), false);
  }
  if (rail_hosts_.empty()) {
    STEPMESH_ASSIGN_OR_RETURN(uint16_t port, base::LocalPort(acceptors_[0].fd()));
    return absl::StrCat(core::AdvertisedHost(options_), ":", port);
  }
  std::vector<std::string> parts;
  for (size_t r = 0; r < acceptors_.size(); ++r) {
    STEPMESH_ASSIGN_OR_RETURN(uint16_t port, base::LocalPort(acceptors_[r].fd()));
    const std::string& host = rail_hosts_[r];
    parts.push_back(host.find(':') == std::string::npos ? absl::StrCat(host, ":", port)
                                                        : absl::StrCat("[", host, "]:", port));
  }
  return absl::StrJoin(parts, ",");
}

absl::Status TcpTransport::Connect(NodeId self, absl::Span<const PeerInfo> peers,
                                   absl::Time deadline) {
  self_.store(self, std::memory_order_release);
  // Workers dial; servers accept. The hello names the dialler.
  if (core::IsWorker(self)) {
    return Dial(self, peers, deadline);
  }
  std::vector<uint64_t> mine;
  {
    std::lock_guard<std::mutex> lock(accept_mu_);
    for (const PeerInfo& peer : peers) {
      const int rails = PrepareRails(peer);
      for (int r = 0; r < rails; ++r) {
        expected_.insert(ExpectKey(peer.id, r));
        mine.push_back(ExpectKey(peer.id, r));
      }
    }
  }
  // The handshakes run in the pump: here until the receive thread polls,
  // and on whichever thread gets the pump first afterwards.
  for (;;) {
    if (accept_mu_.try_lock()) {
      Pump(absl::ZeroDuration());
      accept_mu_.unlock();
    }
    std::vector<uint64_t> missing;
    {
      std::lock_guard<std::mutex> lock(accept_mu_);
      for (uint64_t key : mine) {
        if (expected_.contains(key)) missing.push_back(key);
      }
      if (missing.empty()) return absl::OkStatus();
      if (absl::Now() >= deadline || shut_down_.load()) {
        for (uint64_t key : missing) expected_.erase(key);
        std::vector<std::string> names;
        for (uint64_t key : missing) {
          const NodeId id = static_cast<NodeId>(key >> 8);
          const int rail = static_cast<int>(key & 0xff);
          names.push_back(SlotOf(id) != nullptr && SlotOf(id)->rails > 1
                              ? absl::StrCat(PeerName(id), " (rail ", rail, ")")
                              : PeerName(id));
        }
        return absl::DeadlineExceededError(
            absl::StrCat(missing.size(), " peer(s) never connected: ", absl::StrJoin(names, ", ")));
      }
    }
    pollfd pfd{handshakes_.fd(), POLLIN, 0};
    (void)::poll(&pfd, 1, 5);
  }
}

absl::Status TcpTransport::Poll(TransportSink& sink, absl::Duration max_wait) {
  if (!runnable_.empty()) RunUnblocked(sink);
  if (retired_.load(std::memory_order_acquire)) Reap();
  if (attention_.load(std::memory_order_acquire)) LoseBroken(sink);
  if (backlogged_.load(std::memory_order_relaxed) > 0 ||
      pending_count_.load(std::memory_order_relaxed) > 0 || accept_paused_.load() ||
      railed_peers_.load(std::memory_order_relaxed) > 0) {
    Housekeeping(sink);
  }
  epoll_event events[32];
  const int timeout_ms =
      max_wait <= absl::ZeroDuration()
          ? 0
          : static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(max_wait)));
  absl::StatusOr<int> ready = loop_.Wait(events, 32, timeout_ms);
  if (!ready.ok()) return absl::InternalError(absl::StrCat("tcp: ", ready.status().message()));
  const int n = *ready;
  for (int i = 0; i < n; ++i) {
    const uint64_t token = events[i].data.u64;
    if (token == kAcceptToken) {
      if (accept_mu_.try_lock()) {
        Pump(absl::ZeroDuration());
        accept_mu_.unlock();
      }
      continue;
    }
    // Connections are destroyed only by Reap (above, on this thread), so
    // the pointer stays valid even when Connect supersedes it meanwhile.
    auto* conn = base::EventLoop::PointerOf<Connection>(token);
    if (!conn->alive.load(std::memory_order_acquire)) continue;
    if (events[i].events & EPOLLOUT) Flush(*conn, sink);
    if (!conn->alive.load(std::memory_order_relaxed)) continue;
    if (conn->railed) {
      // A waiting rail is not read, but a hang-up reported on it (which
      // epoll repeats) makes it read ahead: what is there is read, then the
      // end.
      if (conn->blocked && (events[i].events & (EPOLLHUP | EPOLLERR))) {
        ReadAhead(*conn);
        continue;
      }
      if (!conn->blocked && (events[i].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))) {
        ReadRails(*conn, sink);
      }
    } else if (events[i].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
      ReadFrom(*conn, sink);
    }
  }
  if (!runnable_.empty()) RunUnblocked(sink);
  return absl::OkStatus();
}

void TcpTransport::Wake() { loop_.Wake(); }

namespace {

// One connection on its way out (Shutdown).
struct Closing {
  enum class Stage { kFlushing, kAwaitingEnd, kDone };
  Connection* conn = nullptr;
  Stage stage = Stage::kFlushing;
  bool bye_queued = false;
  bool peer_ended = false;  // its FIN (or a reset) arrived: nothing more comes
};

// Reads and drops what the peer still sends, so that the close finds no
// unread bytes (Linux answers a close with unread data by a reset, and a
// reset makes the peer drop what it had not read yet). True once the peer's
// end arrived or the connection failed.
bool DiscardIncoming(int fd) {
  std::byte scratch[64 * 1024];
  for (int rounds = 0; rounds < 16; ++rounds) {
    const ssize_t n = ::recv(fd, scratch, sizeof(scratch), MSG_DONTWAIT);
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    return true;  // 0: its FIN; an error: it reset or is gone
  }
  return false;  // more may follow: the next round reads on
}

// Bytes written to the socket that the peer has not acknowledged.
int Unacknowledged(int fd) {
  int bytes = 0;
  return ::ioctl(fd, SIOCOUTQ, &bytes) == 0 ? bytes : -1;
}

}  // namespace

void TcpTransport::Shutdown() {
  if (shut_down_.exchange(true)) return;
  // An orderly close, per connection and all of them at once: what is queued
  // goes out, then the goodbye, then our FIN (SHUT_WR), and the connection
  // stays open, read and discarded, until the peer's FIN: the peer closes
  // once it has read our end, so nothing we sent is still on its way when
  // the descriptor closes, and nothing unread is left here to turn the close
  // into a reset. Bounded: a peer that does not read, or does not close its
  // end, is named in a warning and closed at the deadline.
  const absl::Duration bound = std::min(options_.timeout, kShutdownFlush);
  const absl::Time deadline = absl::Now() + bound;
  const NodeId self = self_.load(std::memory_order_acquire);
  std::vector<Closing> closing;
  for (auto* slots : {&worker_slots_, &server_slots_}) {
    for (PeerSlot& slot : *slots) {
      std::lock_guard<std::mutex> lock(slot.mu);
      for (Connection* c : {slot.conn, slot.rail[0], slot.rail[1], slot.rail[2], slot.rail[3]}) {
        // Not alive: the receive thread neither reads nor retires it, and
        // Send refuses it: from here on it is this thread's alone.
        if (c == nullptr || !c->alive.exchange(false)) continue;
        if (!c->broken.ok()) {
          ::shutdown(c->fd.get(), SHUT_RDWR);
          continue;
        }
        // Every byte wakes the poll below (a mark left for a large frame
        // would hide a small one until the close).
        const int one = 1;
        (void)::setsockopt(c->fd.get(), SOL_SOCKET, SO_RCVLOWAT, &one, sizeof(one));
        closing.push_back({.conn = c});
      }
    }
  }
  std::vector<pollfd> fds(closing.size());
  for (;;) {
    size_t open = 0;
    for (size_t i = 0; i < closing.size(); ++i) {
      Closing& k = closing[i];
      Connection& c = *k.conn;
      fds[i] = {-1, 0, 0};  // poll skips it
      if (k.stage == Closing::Stage::kDone) continue;
      // Read while flushing too: a peer that is itself shutting down may be
      // flushing to us and read only once it is done.
      if (!k.peer_ended) k.peer_ended = DiscardIncoming(c.fd.get());
      if (k.stage == Closing::Stage::kFlushing) {
        std::lock_guard<std::mutex> lock(c.slot->mu);
        DrainQueue(c);
        if (c.queued == 0 && c.broken.ok() && !k.bye_queued) {
          // The goodbye, behind everything queued (with rails every rail
          // says it, after what it carried).
          std::array<std::byte, kRailHeaderBytes> rail_bye;
          FrameBytes frame;
          if (c.railed) {
            RailHeader bye;
            bye.kind = RailKind::kGoodbye;
            bye.ack = c.slot->delivered.load(std::memory_order_relaxed);
            EncodeRailHeader(bye, rail_bye.data());
          } else {
            FrameHeader bye;
            bye.type = FrameType::kGoodbye;
            bye.src = self;
            bye.dst = c.peer;
            frame = EncodeFrame(bye);
          }
          (void)WriteOrQueue(c, c.railed ? rail_bye.data() : frame.data(),
                             c.railed ? rail_bye.size() : frame.size(), nullptr, 0, 0, false);
          k.bye_queued = true;
        }
        if (!c.broken.ok()) {
          k.stage = Closing::Stage::kDone;  // it reset or went: nothing to wait for
          continue;
        }
        if (c.queued == 0 && k.bye_queued) {
          ::shutdown(c.fd.get(), SHUT_WR);
          k.stage = Closing::Stage::kAwaitingEnd;
        }
      }
      if (k.stage == Closing::Stage::kAwaitingEnd && k.peer_ended) {
        k.stage = Closing::Stage::kDone;
        continue;
      }
      const bool flushing = k.stage == Closing::Stage::kFlushing;
      fds[i] = {c.fd.get(),
                static_cast<short>((k.peer_ended ? 0 : POLLIN) | (flushing ? POLLOUT : 0)), 0};
      ++open;
    }
    const absl::Duration left = deadline - absl::Now();
    if (open == 0 || left <= absl::ZeroDuration()) break;
    const int ms = static_cast<int>(
        std::clamp<int64_t>(absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))), 1,
                            absl::ToInt64Milliseconds(kShutdownFlush)));
    (void)::poll(fds.data(), fds.size(), ms);
  }
  for (Closing& k : closing) {
    Connection& c = *k.conn;
    const std::string rail = c.railed ? absl::StrCat(" rail ", c.rail) : "";
    if (k.stage == Closing::Stage::kFlushing) {
      size_t unsent = 0;
      {
        std::lock_guard<std::mutex> lock(c.slot->mu);
        for (size_t i = 0; i < c.queued; ++i) {
          unsent += c.at(i).prefix_bytes + c.at(i).bytes - c.at(i).sent;
        }
      }
      STEPMESH_LOG(kWarning, "tcp: shutdown: ", PeerName(c.peer), " (", c.address, ")", rail,
                   " did not read its socket within ", absl::FormatDuration(bound), " (", unsent,
                   " bytes not sent); closing without a goodbye");
    } else if (k.stage == Closing::Stage::kAwaitingEnd) {
      STEPMESH_LOG(kWarning, "tcp: shutdown: ", PeerName(c.peer), " (", c.address, ")", rail,
                   " did not close its end within ", absl::FormatDuration(bound),
                   " of the goodbye (", Unacknowledged(c.fd.get()),
                   " bytes it has not acknowledged); closing");
    }
    ::shutdown(c.fd.get(), SHUT_RDWR);
  }
}

absl::Status TcpTransport::ShutdownRail(NodeId peer, int rail) {
  PeerSlot* slot = SlotOf(peer);
  if (slot == nullptr || rail < 0 || rail >= static_cast<int>(kMaxRails)) {
    return absl::NotFoundError(absl::StrCat("tcp: no rail ", rail, " to ", PeerName(peer)));
  }
  std::lock_guard<std::mutex> lock(slot->mu);
  Connection* c = slot->rails > 1 ? slot->rail[rail] : (rail == 0 ? slot->conn : nullptr);
  if (c == nullptr) {
    return absl::NotFoundError(absl::StrCat("tcp: no rail ", rail, " to ", PeerName(peer)));
  }
  ::shutdown(c->fd.get(), SHUT_RDWR);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint64_t>> TcpTransport::RailBytes(NodeId peer) {
  PeerSlot* slot = SlotOf(peer);
  if (slot == nullptr) return absl::NotFoundError(absl::StrCat("tcp: no ", PeerName(peer)));
  std::lock_guard<std::mutex> lock(slot->mu);
  std::vector<uint64_t> out;
  if (slot->rails < 2) {
    out.push_back(slot->conn != nullptr ? slot->conn->payload_sent : 0);
    return out;
  }
  for (int r = 0; r < slot->rails; ++r) {
    out.push_back(slot->rail[r] != nullptr ? slot->rail[r]->payload_sent : 0);
  }
  return out;
}

absl::Status TcpTransport::SetBuffers(NodeId peer, int bytes) {
  PeerSlot* slot = SlotOf(peer);
  if (slot == nullptr) return absl::NotFoundError(absl::StrCat("tcp: no ", PeerName(peer)));
  std::lock_guard<std::mutex> lock(slot->mu);
  int set = 0;
  for (Connection* c : {slot->conn, slot->rail[0], slot->rail[1], slot->rail[2], slot->rail[3]}) {
    if (c == nullptr) continue;
    STEPMESH_RETURN_IF_ERROR(base::SetBufferSizes(c->fd.get(), bytes));
    ++set;
  }
  if (set == 0) {
    return absl::NotFoundError(absl::StrCat("tcp: no connection to ", PeerName(peer)));
  }
  return absl::OkStatus();
}

absl::Status TcpTransport::Check(absl::Status status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat("tcp: ", status.message()));
}

PeerSlot* TcpTransport::SlotOf(NodeId peer) {
  auto& slots = core::IsWorker(peer) ? worker_slots_ : server_slots_;
  if (!core::IsWorker(peer) && !core::IsServer(peer)) return nullptr;
  const uint32_t rank = core::NodeRank(peer);
  return rank < slots.size() ? &slots[rank] : nullptr;
}

}  // namespace stepmesh::tcp::internal

namespace stepmesh::tcp {

absl::StatusOr<std::unique_ptr<core::Transport>> CreateTcpTransport(const MeshOptions& options) {
  auto transport = std::make_unique<internal::TcpTransport>(options);
  STEPMESH_RETURN_IF_ERROR(transport->Init());
  return transport;
}

absl::Status ShutdownRailForTesting(core::Transport& transport, core::NodeId peer, int rail) {
  return static_cast<internal::TcpTransport&>(transport).ShutdownRail(peer, rail);
}

absl::StatusOr<std::vector<uint64_t>> RailBytesForTesting(core::Transport& transport,
                                                          core::NodeId peer) {
  return static_cast<internal::TcpTransport&>(transport).RailBytes(peer);
}

absl::Status SetSocketBuffersForTesting(core::Transport& transport, core::NodeId peer, int bytes) {
  return static_cast<internal::TcpTransport&>(transport).SetBuffers(peer, bytes);
}

}  // namespace stepmesh::tcp
