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

void TcpTransport::Pump(absl::Duration max_wait) {
  if (acceptors_.empty()) return;
  const absl::Time now_before = absl::Now();
  if (accept_paused_.load()) {
    bool still = false;
    for (size_t r = 0; r < acceptors_.size(); ++r) {
      if (!acceptor_paused_[r]) continue;
      if (now_before < acceptors_[r].paused_until()) {
        still = true;
        continue;
      }
      (void)handshakes_.Modify(acceptors_[r].fd(), EPOLLIN, kListenerToken - r);
      acceptor_paused_[r] = false;
    }
    accept_paused_.store(still);
  }
  epoll_event events[64];
  absl::StatusOr<int> ready =
      handshakes_.Wait(events, 64, static_cast<int>(absl::ToInt64Milliseconds(max_wait)));
  const int n = ready.ok() ? *ready : 0;
  for (int i = 0; i < n; ++i) {
    const uint64_t token = events[i].data.u64;
    if (token <= kListenerToken && token > kListenerToken - acceptors_.size()) {
      AcceptAll(static_cast<int>(kListenerToken - token));
      continue;
    }
    auto* p = base::EventLoop::PointerOf<Pending>(token);
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
      Refuse(*p, absl::DeadlineExceededError(absl::StrCat(
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

void TcpTransport::AcceptAll(int rail) {
  base::Acceptor& acceptor = acceptors_[static_cast<size_t>(rail)];
  const base::Acceptor::Outcome ended = base::AcceptAndAdmit(
      acceptor, exhausted_, "tcp (data listener)", pending_,
      [](const std::unique_ptr<Pending>& p) { return !p->done; },
      [](const std::unique_ptr<Pending>& p) -> const std::string& { return p->address; },
      handshake_caps_,
      [this](std::unique_ptr<Pending>& p, const std::string& why) { Drop(*p, why); },
      [&](base::Acceptor::Accepted a) {
        auto p = std::make_unique<Pending>(options_.auth_token);
        p->fd = std::move(a.fd);
        p->address = std::move(a.peer);
        p->rail = rail;
        p->deadline = absl::Now() + kHandshakeTimeout;
        if (!handshakes_.Watch(p->fd.get(), EPOLLIN | EPOLLRDHUP, base::EventLoop::TokenOf(p.get()))
                 .ok()) {
          return;
        }
        Pending& added = *p;
        pending_.push_back(std::move(p));
        Advance(added);  // its hello is often there already
      });
  if (ended == base::Acceptor::Outcome::kExhausted) {
    // Left alone until paused_until (Pump resumes it).
    (void)handshakes_.Pause(acceptor.fd(), kListenerToken - static_cast<uint64_t>(rail));
    acceptor_paused_[static_cast<size_t>(rail)] = true;
    accept_paused_.store(true);
  }
}

void TcpTransport::Advance(Pending& p) {
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

void TcpTransport::Decide(Pending& p) {
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
  } else if (self != kNoNode && expected_.contains(ExpectKey(from, p.rail))) {
    p.handshake.Decide(self, absl::OkStatus());
  } else {
    p.parked = true;
  }
  if (p.parked != was_parked) {
    // Parked, its socket is not watched: unread bytes would wake the pump forever.
    const uint64_t token = base::EventLoop::TokenOf(&p);
    (void)(p.parked ? handshakes_.Pause(p.fd.get(), token)
                    : handshakes_.Modify(p.fd.get(), EPOLLIN | EPOLLRDHUP, token));
  }
}

bool TcpTransport::Answer(Pending& p) {
  if (p.done) return false;
  if (p.handshake.step() == HandshakeAcceptor::Step::kDone) {
    const NodeId from = p.handshake.claimed();
    if (!expected_.contains(ExpectKey(from, p.rail))) {
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
  handshakes_.Unwatch(p.fd.get());
  expected_.erase(ExpectKey(from, p.rail));
  absl::Status adopted = Adopt(from, std::move(p.fd), p.address, p.rail);
  if (!adopted.ok()) {
    STEPMESH_LOG(kWarning, "tcp: cannot adopt the connection of ", PeerName(from), ": ",
                 adopted.ToString());
  }
  p.done = true;
  return false;
}

std::string TcpTransport::ConnectedFrom(NodeId peer) {
  PeerSlot* slot = SlotOf(peer);
  if (slot == nullptr) return "not a peer";
  std::lock_guard<std::mutex> lock(slot->mu);
  if (slot->rails > 1) {
    for (const Connection* c : slot->rail) {
      if (c != nullptr) return absl::StrCat("already connected from ", c->address, " (rails)");
    }
  }
  if (slot->conn == nullptr) return "not connected";
  return absl::StrCat("already connected from ", slot->conn->address);
}

void TcpTransport::Refuse(Pending& p, const absl::Status& why) {
  if (p.handshake.step() != HandshakeAcceptor::Step::kRefused) {
    p.handshake.Withdraw(why);
    const std::string out = p.handshake.TakeOutput();
    (void)!::send(p.fd.get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  Drop(p, absl::StrCat("refused: ", why.message()));
}

void TcpTransport::Drop(Pending& p, absl::string_view reason, bool quiet) {
  if (p.done) return;
  if (quiet) {
    STEPMESH_LOG(kInfo, "tcp: data connection from ", p.address, ": ", reason);
  } else {
    STEPMESH_LOG_LIMITED(violations_, kWarning, "tcp: data connection from ", p.address, ": ",
                         reason);
  }
  handshakes_.Unwatch(p.fd.get());
  p.fd.Reset();
  p.done = true;
}

}  // namespace stepmesh::tcp::internal
