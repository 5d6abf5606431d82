#include "src/transport/tcp_fallback/tcp_transport.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

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

void TcpTransport::Shutdown() {
  if (shut_down_.exchange(true)) return;
  // Frames already queued go out first (the send thread has stopped), so
  // that the goodbye ends the stream on a frame boundary; a peer that does
  // not read within the bound gets no goodbye and sees the close as a loss.
  const absl::Time deadline = absl::Now() + std::min(options_.timeout, kShutdownFlush);
  const NodeId self = self_.load(std::memory_order_acquire);
  for (auto* slots : {&worker_slots_, &server_slots_}) {
    for (PeerSlot& slot : *slots) {
      std::lock_guard<std::mutex> lock(slot.mu);
      for (Connection* c : {slot.conn, slot.rail[0], slot.rail[1], slot.rail[2], slot.rail[3]}) {
        if (c == nullptr || !c->alive.load()) continue;
        while (c->queued > 0 && c->broken.ok() && absl::Now() < deadline) {
          pollfd pfd{c->fd.get(), POLLOUT, 0};
          (void)::poll(&pfd, 1, 10);
          DrainQueue(*c);
        }
        if (c->queued == 0 && c->broken.ok()) {
          // With rails every rail says goodbye, after what it carried.
          std::array<std::byte, kRailHeaderBytes> rail_bye;
          FrameBytes frame;
          if (c->railed) {
            RailHeader bye;
            bye.kind = RailKind::kGoodbye;
            bye.ack = slot.delivered.load(std::memory_order_relaxed);
            EncodeRailHeader(bye, rail_bye.data());
          } else {
            FrameHeader bye;
            bye.type = FrameType::kGoodbye;
            bye.src = self;
            bye.dst = c->peer;
            frame = EncodeFrame(bye);
          }
          const std::byte* bytes = c->railed ? rail_bye.data() : frame.data();
          const size_t size = c->railed ? rail_bye.size() : frame.size();
          (void)::send(c->fd.get(), bytes, size, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        ::shutdown(c->fd.get(), SHUT_RDWR);
        c->alive.store(false);
      }
    }
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

}  // namespace stepmesh::tcp
