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
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/base/sync.h"
#include "src/transport/tcp_fallback/tcp_transport_impl.h"
#include "stepmesh/status.h"

namespace stepmesh::tcp::internal {

absl::Status TcpTransport::Dial(NodeId self, const PeerInfo& peer, absl::Time deadline) {
  STEPMESH_ASSIGN_OR_RETURN(std::vector<std::string> at, SplitRailEndpoint(peer.endpoint));
  // One connection per rail both ends have (rail r to the peer's rail r).
  const int rails = PrepareRails(peer);
  for (int r = 0; r < rails; ++r) {
    STEPMESH_ASSIGN_OR_RETURN(base::HostPort where, base::ParseHostPort(at[r]));
    absl::StatusOr<base::UniqueFd> fd = base::ConnectTcp(where, deadline);
    if (!fd.ok()) {
      return absl::UnavailableError(absl::StrCat("connecting to ", PeerName(peer.id), " at ", at[r],
                                                 rails > 1 ? absl::StrCat(" (rail ", r, ")") : "",
                                                 ": ", fd.status().message()));
    }
    STEPMESH_RETURN_IF_ERROR(
        DialHandshake(fd->get(), self, peer.id, options_.auth_token, deadline));
    const std::string address = base::PeerAddress(fd->get());
    STEPMESH_RETURN_IF_ERROR(Adopt(peer.id, *std::move(fd), address, r));
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
