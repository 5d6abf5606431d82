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
  STEPMESH_ASSIGN_OR_RETURN(base::HostPort where, base::ParseHostPort(peer.endpoint));
  absl::StatusOr<base::UniqueFd> fd = base::ConnectTcp(where, deadline);
  if (!fd.ok()) {
    return absl::UnavailableError(absl::StrCat("connecting to ", PeerName(peer.id), " at ",
                                               peer.endpoint, ": ", fd.status().message()));
  }
  STEPMESH_RETURN_IF_ERROR(DialHandshake(fd->get(), self, peer.id, options_.auth_token, deadline));
  const std::string address = base::PeerAddress(fd->get());
  return Adopt(peer.id, *std::move(fd), address);
}

absl::Status TcpTransport::Adopt(NodeId peer, base::UniqueFd fd, std::string address) {
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

void TcpTransport::LoseBroken(TransportSink& sink) {
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

void TcpTransport::Lose(Connection& conn, TransportSink& sink, absl::Status why) {
  {
    std::lock_guard<std::mutex> lock(conn.slot->mu);
    if (!conn.alive.exchange(false)) return;
    Retire(conn);
    if (conn.superseded) return;  // the peer is on a newer connection
  }
  sink.OnPeerLost(conn.peer, std::move(why));
}

void TcpTransport::Retire(Connection& conn) {
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

void TcpTransport::Reap() {
  std::list<std::unique_ptr<Connection>> dead;
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    dead.swap(retired_list_);
    retired_.store(false, std::memory_order_release);
  }
}

void TcpTransport::Housekeeping(TransportSink& sink) {
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
            why = absl::DeadlineExceededError(
                absl::StrCat("did not read its socket for ", absl::FormatDuration(options_.timeout),
                             " (", c->queued, " frames, ", unsent, " bytes waiting to be sent)"));
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

}  // namespace stepmesh::tcp::internal
