#include "src/transport/rdma/bootstrap_listener.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/admission.h"
#include "src/base/event_loop.h"
#include "src/base/logging.h"
#include "src/core/handshake.h"
#include "src/core/protocol.h"
#include "stepmesh/status.h"

namespace stepmesh::rdma {

using core::HandshakeAcceptor;
using core::NodeId;

struct BootstrapListener::Pending {
  base::UniqueFd fd;
  std::string address;
  HandshakeAcceptor handshake;
  absl::Time deadline;
  bool done = false;  // adopted, refused or dropped: freed at the end of the pass
  explicit Pending(std::string secret) : handshake(std::move(secret)) {}
};

BootstrapListener::BootstrapListener() = default;
BootstrapListener::~BootstrapListener() = default;
BootstrapListener::BootstrapListener(BootstrapListener&&) noexcept = default;
BootstrapListener& BootstrapListener::operator=(BootstrapListener&&) noexcept = default;

absl::StatusOr<BootstrapListener> BootstrapListener::Listen(const std::string& host) {
  STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd fd, base::ListenTcp(host, 0));
  BootstrapListener listener;
  listener.log_limit_ = std::make_unique<base::RateLimiter>(10, absl::Seconds(10));
  STEPMESH_ASSIGN_OR_RETURN(listener.acceptor_, base::Acceptor::Create(std::move(fd)));
  return listener;
}

absl::StatusOr<uint16_t> BootstrapListener::port() const { return base::LocalPort(acceptor_.fd()); }

void BootstrapListener::Drop(Pending& p, const std::string& why) {
  STEPMESH_LOG_LIMITED(*log_limit_, kWarning, "rdma: dropped a bootstrap connection from ",
                       p.address, ": ", why);
  p.fd.Reset();
  p.done = true;
}

void BootstrapListener::AcceptAll(const std::string& secret, size_t expected) {
  base::AcceptAndAdmit(
      acceptor_, *log_limit_, "rdma (bootstrap listener)", pending_,
      [](const std::unique_ptr<Pending>& p) { return !p->done; },
      [](const std::unique_ptr<Pending>& p) -> const std::string& { return p->address; },
      base::CapsForPeers(expected, {kMaxPendingPerAddress, kMaxPending}),
      [this](std::unique_ptr<Pending>& p, const std::string& why) { Drop(*p, why); },
      [&](base::Acceptor::Accepted accepted) {
        auto p = std::make_unique<Pending>(secret);
        p->fd = std::move(accepted.fd);
        p->address = std::move(accepted.peer);
        p->deadline = absl::Now() + kHandshakeTimeout;
        pending_.push_back(std::move(p));
      });
}

NodeId BootstrapListener::Advance(Pending& p, NodeId self, absl::Span<const NodeId> expected) {
  while (p.handshake.step() == HandshakeAcceptor::Step::kRead) {
    std::byte in[core::kHelloBytes];
    const ssize_t n = ::recv(p.fd.get(), in, p.handshake.wanted(), MSG_DONTWAIT);
    if (n == 0) {
      p.fd.Reset();  // gave up before saying who it is: nothing to report
      p.done = true;
      return core::kNoNode;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return core::kNoNode;
      Drop(p, base::ErrnoMessage("recv", errno));
      return core::kNoNode;
    }
    p.handshake.Received(absl::MakeConstSpan(in, static_cast<size_t>(n)));
    if (p.handshake.step() == HandshakeAcceptor::Step::kDecide) {
      const NodeId from = p.handshake.claimed();
      const bool wanted = std::find(expected.begin(), expected.end(), from) != expected.end();
      p.handshake.Decide(self, wanted ? absl::OkStatus()
                                      : absl::PermissionDeniedError(absl::StrCat(
                                            "its hello claims ", core::PeerName(from),
                                            ", which is not a peer this node expects")));
    }
    const std::string out = p.handshake.TakeOutput();
    if (!out.empty() && ::send(p.fd.get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT) !=
                            static_cast<ssize_t>(out.size())) {
      Drop(p, "does not take the handshake's reply");
      return core::kNoNode;
    }
  }
  switch (p.handshake.step()) {
    case HandshakeAcceptor::Step::kRefused:
      Drop(p, absl::StrCat("refused: ", p.handshake.refusal().message()));
      return core::kNoNode;
    case HandshakeAcceptor::Step::kDone:
      p.done = true;
      return p.handshake.claimed();
    default:
      return core::kNoNode;
  }
}

absl::StatusOr<std::pair<NodeId, base::UniqueFd>> BootstrapListener::AcceptOne(
    NodeId self, absl::Span<const NodeId> expected, const std::string& secret,
    absl::Time deadline) {
  std::vector<pollfd> fds;
  for (;;) {
    const absl::Time now = absl::Now();
    // Give up on handshakes past their own deadline.
    for (auto& p : pending_) {
      if (!p->done && now >= p->deadline) {
        p->handshake.Withdraw(absl::DeadlineExceededError(absl::StrCat(
            "did not finish its handshake within ", absl::FormatDuration(kHandshakeTimeout))));
        const std::string out = p->handshake.TakeOutput();
        (void)!::send(p->fd.get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        Drop(*p, "did not finish its handshake in time");
      }
    }
    pending_.remove_if([](const std::unique_ptr<Pending>& p) { return p->done; });
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no expected peer finished its bootstrap handshake (", pending_.size(), " unfinished)"));
    }
    absl::Time wake = deadline;
    fds.clear();
    const bool listening = now >= acceptor_.paused_until();
    fds.push_back({acceptor_.fd(), static_cast<short>(listening ? POLLIN : 0), 0});
    if (!listening) wake = std::min(wake, acceptor_.paused_until());
    for (const auto& p : pending_) {
      fds.push_back({p->fd.get(), POLLIN, 0});
      wake = std::min(wake, p->deadline);
    }
    const int timeout_ms =
        static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(wake - now) + 1, 1, 100));
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) {
      return absl::InternalError(base::ErrnoMessage("rdma: bootstrap poll", errno));
    }
    if (ready <= 0) continue;
    // The ones that were polled (AcceptAll appends after them).
    size_t i = 1;
    for (auto& p : pending_) {
      if (i >= fds.size()) break;
      const short revents = fds[i++].revents;
      if (revents == 0 || p->done) continue;
      const NodeId from = Advance(*p, self, expected);
      if (from == core::kNoNode) continue;
      base::UniqueFd fd = std::move(p->fd);
      STEPMESH_RETURN_IF_ERROR(base::SetNonBlocking(fd.get(), false));
      pending_.remove_if(
          [](const std::unique_ptr<Pending>& q) { return q->done && !q->fd.valid(); });
      return std::make_pair(from, std::move(fd));
    }
    if (fds[0].revents != 0) AcceptAll(secret, expected.size());
  }
}

}  // namespace stepmesh::rdma
