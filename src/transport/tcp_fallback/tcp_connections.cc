#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
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

namespace {

// A worker has at most this many dials under way at once. One at a time,
// each worker waits a scheduling round trip per server, three times over;
// all at once, 96 workers flooding 32 servers with 3,072 handshakes made the
// last Create() later on the shared 2-core machine, though it cost less CPU
// (docs/benchmarks.md, "Scale": window 4 against 1 and unbounded).
constexpr size_t kDialWindow = 4;

// One data connection being dialled: a peer's rail, its socket once the
// connect is under way, and its handshake once the connect is done.
struct Dialling {
  NodeId peer = kNoNode;
  int rail = 0;
  int rails = 1;
  std::string at;  // the peer's endpoint for this rail, for errors
  base::HostPort where;
  base::UniqueFd fd;
  std::optional<core::HandshakeDialer> handshake;
  absl::Time retry_at = absl::InfinitePast();  // refused: dial again then
  absl::Duration backoff = absl::Milliseconds(5);
  bool done = false;

  std::string Name() const {
    return absl::StrCat(PeerName(peer), " at ", at,
                        rails > 1 ? absl::StrCat(" (rail ", rail, ")") : "");
  }
};

// Sends what the handshake has to say now (a few dozen bytes on a fresh
// socket, so it fits the send buffer whole).
absl::Status SendHandshake(Dialling& d) {
  const std::string out = d.handshake->TakeOutput();
  if (out.empty()) return absl::OkStatus();
  const ssize_t n = ::send(d.fd.get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n == static_cast<ssize_t>(out.size())) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "data connection to ", d.Name(), ": ",
      n < 0 ? base::ErrnoMessage("send", errno) : "the handshake did not fit the send buffer"));
}

}  // namespace

absl::Status TcpTransport::Dial(NodeId self, absl::Span<const PeerInfo> peers,
                                absl::Time deadline) {
  // One connection per rail both ends have (rail r to the peer's rail r).
  std::vector<Dialling> dials;
  for (const PeerInfo& peer : peers) {
    STEPMESH_ASSIGN_OR_RETURN(std::vector<std::string> at, SplitRailEndpoint(peer.endpoint));
    const int rails = PrepareRails(peer);
    for (int r = 0; r < rails; ++r) {
      Dialling& d = dials.emplace_back();
      d.peer = peer.id;
      d.rail = r;
      d.rails = rails;
      d.at = at[r];
      STEPMESH_ASSIGN_OR_RETURN(d.where, base::ParseHostPort(at[r]));
    }
  }
  // A connect error: retried with backoff while the peer may still be
  // starting (as base::ConnectTcp does), else the dial's error.
  auto failed = [&](Dialling& d, int err) -> absl::Status {
    d.fd.Reset();
    if (!base::RetryableConnectError(err) || absl::Now() + d.backoff > deadline) {
      return absl::UnavailableError(absl::StrCat(
          "connecting to ", d.Name(), ": ",
          base::ErrnoMessage(absl::StrCat("connect to ", d.where.host, ":", d.where.port), err)));
    }
    d.retry_at = absl::Now() + d.backoff;
    d.backoff = std::min(d.backoff * 2, absl::Milliseconds(200));
    return absl::OkStatus();
  };
  // The connect is done: the hello goes out.
  auto connected = [&](Dialling& d) -> absl::Status {
    STEPMESH_ASSIGN_OR_RETURN(core::HandshakeDialer handshake,
                              core::HandshakeDialer::Start(self, d.peer, options_.auth_token));
    d.handshake.emplace(std::move(handshake));
    return SendHandshake(d);
  };
  // Bytes of the handshake arrived (or the peer hung up).
  auto advance = [&](Dialling& d) -> absl::Status {
    while (d.handshake->step() == core::HandshakeDialer::Step::kRead) {
      std::byte in[core::HandshakeDialer::kMaxRead];
      const ssize_t n = ::recv(d.fd.get(), in, d.handshake->wanted(), MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return absl::OkStatus();
      if (n <= 0) {
        d.handshake->Closed();
        break;
      }
      d.handshake->Received(absl::MakeConstSpan(in, static_cast<size_t>(n)));
      STEPMESH_RETURN_IF_ERROR(SendHandshake(d));
    }
    if (d.handshake->step() == core::HandshakeDialer::Step::kRefused) {
      return d.handshake->refusal();
    }
    const std::string address = base::PeerAddress(d.fd.get());
    STEPMESH_RETURN_IF_ERROR(Adopt(d.peer, std::move(d.fd), address, d.rail));
    d.done = true;
    return absl::OkStatus();
  };

  // Worker w starts at its w-th peer, so the workers do not all queue at the
  // same server first.
  if (!dials.empty()) {
    std::rotate(dials.begin(), dials.begin() + core::NodeRank(self) % dials.size(), dials.end());
  }
  std::vector<pollfd> watched;
  std::vector<Dialling*> owners;
  watched.reserve(dials.size());
  owners.reserve(dials.size());
  for (size_t left = dials.size(); left > 0;) {
    const absl::Time now = absl::Now();
    absl::Time wake = deadline;
    watched.clear();
    owners.clear();
    size_t in_flight = 0;
    for (Dialling& d : dials) {
      if (d.done) continue;
      if (++in_flight > kDialWindow) break;
      if (!d.fd.valid()) {
        if (now < d.retry_at) {
          wake = std::min(wake, d.retry_at);
          continue;
        }
        STEPMESH_ASSIGN_OR_RETURN(base::StartedConnect started, base::StartConnectTcp(d.where));
        d.fd = std::move(started.fd);
        if (started.error == 0) {
          STEPMESH_RETURN_IF_ERROR(connected(d));
        } else if (started.error != EINPROGRESS) {
          STEPMESH_RETURN_IF_ERROR(failed(d, started.error));
          if (!d.fd.valid()) {
            wake = std::min(wake, d.retry_at);
            continue;
          }
        }
      }
      watched.push_back(pollfd{d.fd.get(), static_cast<short>(d.handshake ? POLLIN : POLLOUT), 0});
      owners.push_back(&d);
    }
    if (now >= deadline) {
      std::vector<std::string> names;
      for (const Dialling& d : dials) {
        if (!d.done) names.push_back(absl::StrCat(d.Name(), d.handshake ? " (handshake)" : ""));
      }
      return absl::DeadlineExceededError(
          absl::StrCat(names.size(), " of ", dials.size(),
                       " data connection(s) not up by the deadline: ", absl::StrJoin(names, ", ")));
    }
    const int64_t ms = std::clamp<int64_t>(absl::ToInt64Milliseconds(wake - now) + 1, 0, 1 << 30);
    const int ready = ::poll(watched.data(), watched.size(), static_cast<int>(ms));
    if (ready < 0 && errno != EINTR) {
      return absl::InternalError(base::ErrnoMessage("poll", errno));
    }
    for (size_t i = 0; ready > 0 && i < watched.size(); ++i) {
      if (watched[i].revents == 0) continue;
      Dialling& d = *owners[i];
      if (!d.handshake) {
        const int err = base::ConnectError(d.fd.get());
        STEPMESH_RETURN_IF_ERROR(err == 0 ? connected(d) : failed(d, err));
        continue;  // the verdict comes in a later look
      }
      STEPMESH_RETURN_IF_ERROR(advance(d));
      if (d.done) --left;
    }
  }
  return absl::OkStatus();
}

absl::Status TcpTransport::Adopt(NodeId peer, base::UniqueFd fd, std::string address, int rail) {
  PeerSlot* slot = SlotOf(peer);
  if (slot == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(PeerName(peer), " is not in this mesh"));
  }
  STEPMESH_RETURN_IF_ERROR(base::SetNoDelay(fd.get()));
  STEPMESH_RETURN_IF_ERROR(base::SetBufferSizes(fd.get(), kSocketBufferBytes));
  STEPMESH_RETURN_IF_ERROR(base::SetNonBlocking(fd.get(), true));
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    if (slot->rails > 1) {
      // A rail is given up when what it sent is not acknowledged by the
      // kernel within RailTimeout (a link down, a black hole): its bytes then
      // go on the other rails, in time for the requests they carry.
      const unsigned ms = static_cast<unsigned>(
          std::clamp<int64_t>(absl::ToInt64Milliseconds(RailTimeout()), 1, 1 << 30));
      if (::setsockopt(fd.get(), IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof(ms)) != 0) {
        return absl::InternalError(base::ErrnoMessage("setsockopt(TCP_USER_TIMEOUT)", errno));
      }
    }
  }
  auto conn = std::make_unique<Connection>();
  conn->slot = slot;
  conn->peer = peer;
  conn->address = std::move(address);
  conn->fd = std::move(fd);
  conn->causality = base::SocketCausality::ForSocket(conn->fd.get());
  conn->ring.resize(kInitialQueueFrames);
  conn->rail = rail;
  Connection* added = conn.get();
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    connections_.push_back(std::move(conn));
  }
  std::lock_guard<std::mutex> lock(slot->mu);
  // Set before Watch makes the connection visible to the receive thread,
  // which reads them unlocked (epoll_ctl orders them for it).
  added->railed = slot->rails > 1;
  added->generation = slot->generation.load(std::memory_order_relaxed);
  if (absl::Status watched =
          loop_.Watch(added->fd.get(), EPOLLIN | EPOLLRDHUP, base::EventLoop::TokenOf(added));
      !watched.ok()) {
    const absl::Status failed = Check(std::move(watched));
    added->alive.store(false);
    added->slot = slot;
    Retire(*added);
    return failed;
  }
  Connection*& place = added->railed ? slot->rail[rail] : slot->conn;
  if (Connection* stale = place; stale != nullptr) {
    // A rejoined peer replaces its old connection; closing the old one must
    // not report the (new) peer as lost, hence `superseded` before `alive`.
    stale->superseded = true;
    if (stale->alive.exchange(false)) Retire(*stale);
  }
  place = added;
  slot->lost = false;
  return absl::OkStatus();
}

void TcpTransport::LoseBroken(TransportSink& sink) {
  attention_.store(false, std::memory_order_release);
  for (auto* slots : {&worker_slots_, &server_slots_}) {
    for (PeerSlot& slot : *slots) {
      Connection* broken = nullptr;
      absl::Status why;
      for (int r = -1; r < static_cast<int>(kMaxRails); ++r) {
        {
          std::lock_guard<std::mutex> lock(slot.mu);
          Connection* c = r < 0 ? slot.conn : slot.rail[r];
          broken = c != nullptr && !c->broken.ok() ? c : nullptr;
          if (broken != nullptr) why = broken->broken;
        }
        if (broken != nullptr) Lose(*broken, sink, why);
      }
    }
  }
}

void TcpTransport::Lose(Connection& conn, TransportSink& sink, absl::Status why) {
  PeerSlot& slot = *conn.slot;
  {
    std::lock_guard<std::mutex> lock(slot.mu);
    if (!conn.alive.exchange(false)) return;
    Retire(conn);
    if (conn.superseded) return;  // the peer is on a newer connection
    if (conn.railed) {
      // One rail of several: the peer is lost only with its last rail.
      if (RailDown(slot, conn, why)) return;
      for (Connection* c : slot.rail) {
        if (c != nullptr && c->alive.exchange(false)) Retire(*c);
      }
      if (slot.lost) return;
      slot.lost = true;
      if (slot.said_goodbye) why = absl::CancelledError("left");
    }
  }
  sink.OnPeerLost(conn.peer, std::move(why));
}

void TcpTransport::Retire(Connection& conn) {
  loop_.Unwatch(conn.fd.get());
  ::shutdown(conn.fd.get(), SHUT_RDWR);
  if (conn.out_armed) backlogged_.fetch_sub(1, std::memory_order_relaxed);
  conn.out_armed = false;
  conn.queued = 0;
  conn.ring.clear();
  if (conn.slot->conn == &conn) conn.slot->conn = nullptr;
  if (conn.slot->rail[conn.rail] == &conn) conn.slot->rail[conn.rail] = nullptr;
  if (conn.blocked) {
    conn.blocked = false;
    blocked_count_.fetch_sub(1, std::memory_order_relaxed);
  }
  std::lock_guard<std::mutex> lock(connections_mu_);
  for (auto it = connections_.begin(); it != connections_.end(); ++it) {
    if (it->get() == &conn) {
      retired_list_.splice(retired_list_.end(), connections_, it);
      break;
    }
  }
  retired_.store(true, std::memory_order_release);
}

void TcpTransport::Reap() {
  std::list<std::unique_ptr<Connection>> dead;
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    dead.swap(retired_list_);
    retired_.store(false, std::memory_order_release);
  }
  // Rails woken but retired meanwhile are not read (nor named) again.
  for (const std::unique_ptr<Connection>& gone : dead) {
    runnable_.erase(std::remove(runnable_.begin(), runnable_.end(), gone.get()), runnable_.end());
  }
}

void TcpTransport::Housekeeping(TransportSink& sink) {
  const absl::Time now = absl::Now();
  if (now < next_housekeeping_) return;
  next_housekeeping_ = now + absl::Milliseconds(50);
  if (backlogged_.load(std::memory_order_relaxed) > 0) {
    for (auto* slots : {&worker_slots_, &server_slots_}) {
      for (PeerSlot& slot : *slots) {
        for (int r = -1; r < static_cast<int>(kMaxRails); ++r) {
          Connection* stalled = nullptr;
          absl::Status why;
          {
            std::lock_guard<std::mutex> lock(slot.mu);
            Connection* c = r < 0 ? slot.conn : slot.rail[r];
            const absl::Duration limit = r < 0 ? options_.timeout : RailTimeout();
            if (c != nullptr && c->queued > 0 && now - c->last_progress > limit) {
              stalled = c;
              size_t unsent = 0;
              for (size_t i = 0; i < c->queued; ++i) {
                unsent += c->at(i).prefix_bytes + c->at(i).bytes - c->at(i).sent;
              }
              why = absl::DeadlineExceededError(
                  absl::StrCat("did not read its socket for ", absl::FormatDuration(limit), " (",
                               c->queued, " frames, ", unsent, " bytes waiting to be sent)"));
            }
          }
          if (stalled != nullptr) {
            STEPMESH_LOG(kWarning, "tcp: ", PeerName(stalled->peer), " (", stalled->address, ") ",
                         stalled->railed ? absl::StrCat("rail ", stalled->rail, " ") : "",
                         why.message(), "; closing the connection");
            Lose(*stalled, sink, why);
          }
        }
      }
    }
  }
  if (railed_peers_.load(std::memory_order_relaxed) > 0) RailHousekeeping(now);
  if (accept_mu_.try_lock()) {
    Pump(absl::ZeroDuration());
    accept_mu_.unlock();
  }
}

}  // namespace stepmesh::tcp::internal
