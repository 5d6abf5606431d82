#include "src/base/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "stepmesh/status.h"

namespace stepmesh::base {
namespace {

int PollTimeoutMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30));
}

// 1: ready (errors surface from the following read/write), 0: timed out,
// -1: poll failed (errno). No status object: idle waits must not allocate.
int PollFor(int fd, short events, absl::Time deadline) {
  for (;;) {
    pollfd pfd{fd, events, 0};
    const int n = ::poll(&pfd, 1, PollTimeoutMs(deadline));
    if (n >= 0) return n > 0 ? 1 : 0;
    if (errno != EINTR) return -1;
  }
}

absl::Status WaitFor(int fd, short events, absl::Time deadline) {
  switch (PollFor(fd, events, deadline)) {
    case 1:
      return absl::OkStatus();
    case 0:
      return absl::DeadlineExceededError("socket I/O timed out");
    default:
      return absl::InternalError(ErrnoMessage("poll", errno));
  }
}

absl::StatusOr<sockaddr_storage> Resolve(const std::string& host, uint16_t port, socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &result);
  if (rc != 0 || result == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve '", host, "': ", ::gai_strerror(rc)));
  }
  sockaddr_storage addr{};
  std::memcpy(&addr, result->ai_addr, result->ai_addrlen);
  *len = result->ai_addrlen;
  ::freeaddrinfo(result);
  if (addr.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&addr)->sin_port = htons(port);
  } else {
    reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = htons(port);
  }
  return addr;
}

}  // namespace

void UniqueFd::Reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string ErrnoMessage(absl::string_view what, int err) {
  return absl::StrCat(what, ": ", std::strerror(err));
}

absl::StatusOr<HostPort> ParseHostPort(absl::string_view text) {
  const size_t colon = text.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not host:port"));
  }
  uint32_t port = 0;
  if (!absl::SimpleAtoi(text.substr(colon + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad port in '", text, "'"));
  }
  absl::string_view host = text.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return HostPort{std::string(host), static_cast<uint16_t>(port)};
}

absl::StatusOr<UniqueFd> ListenTcp(const std::string& host, uint16_t port, int backlog) {
  socklen_t len = 0;
  STEPMESH_ASSIGN_OR_RETURN(sockaddr_storage addr, Resolve(host, port, &len));
  UniqueFd fd(::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return absl::InternalError(ErrnoMessage("socket", errno));
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    return absl::UnavailableError(ErrnoMessage(absl::StrCat("bind ", host, ":", port), errno));
  }
  if (::listen(fd.get(), backlog) != 0) return absl::InternalError(ErrnoMessage("listen", errno));
  return fd;
}

absl::StatusOr<uint16_t> LocalPort(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return absl::InternalError(ErrnoMessage("getsockname", errno));
  }
  return addr.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port)
                                   : ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
}

absl::StatusOr<UniqueFd> ConnectTcp(const HostPort& to, absl::Time deadline) {
  socklen_t len = 0;
  STEPMESH_ASSIGN_OR_RETURN(sockaddr_storage addr, Resolve(to.host, to.port, &len));
  absl::Duration backoff = absl::Milliseconds(5);
  for (;;) {
    UniqueFd fd(::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) return absl::InternalError(ErrnoMessage("socket", errno));
    int rc = ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), len);
    int err = rc == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      STEPMESH_RETURN_IF_ERROR(WaitFor(fd.get(), POLLOUT, deadline));
      socklen_t errlen = sizeof(err);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &errlen);
    }
    if (err == 0) {
      STEPMESH_RETURN_IF_ERROR(SetNonBlocking(fd.get(), false));
      return fd;
    }
    const bool retryable = RetryableConnectError(err);
    if (!retryable || absl::Now() + backoff > deadline) {
      return absl::UnavailableError(
          ErrnoMessage(absl::StrCat("connect to ", to.host, ":", to.port), err));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(200));
  }
}

absl::StatusOr<StartedConnect> StartConnectTcp(const HostPort& to) {
  socklen_t len = 0;
  STEPMESH_ASSIGN_OR_RETURN(sockaddr_storage addr, Resolve(to.host, to.port, &len));
  StartedConnect started;
  started.fd.Reset(::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!started.fd.valid()) return absl::InternalError(ErrnoMessage("socket", errno));
  const int rc = ::connect(started.fd.get(), reinterpret_cast<sockaddr*>(&addr), len);
  started.error = rc == 0 ? 0 : errno;
  return started;
}

int ConnectError(int fd) {
  int err = 0;
  socklen_t errlen = sizeof(err);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &errlen) != 0) return errno;
  return err;
}

bool RetryableConnectError(int err) {
  return err == ECONNREFUSED || err == ETIMEDOUT || err == ECONNRESET;
}

absl::StatusOr<UniqueFd> AcceptTcp(int listen_fd, absl::Time deadline) {
  for (;;) {
    STEPMESH_RETURN_IF_ERROR(WaitFor(listen_fd, POLLIN, deadline));
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) return UniqueFd(fd);
    if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) {
      return absl::InternalError(ErrnoMessage("accept", errno));
    }
  }
}

absl::Status SetNonBlocking(int fd, bool on) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) return absl::InternalError(ErrnoMessage("fcntl", errno));
  const int want = on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  if (::fcntl(fd, F_SETFL, want) != 0) return absl::InternalError(ErrnoMessage("fcntl", errno));
  return absl::OkStatus();
}

absl::Status SetNoDelay(int fd) {
  const int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    return absl::InternalError(ErrnoMessage("TCP_NODELAY", errno));
  }
  return absl::OkStatus();
}

absl::Status SetBufferSizes(int fd, int bytes) {
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
  return absl::OkStatus();  // a smaller kernel cap is not an error
}

absl::Status WriteFully(int fd, const void* data, size_t bytes, absl::Time deadline) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      STEPMESH_RETURN_IF_ERROR(WaitFor(fd, POLLOUT, deadline));
      continue;
    }
    return absl::UnavailableError(ErrnoMessage("send", n < 0 ? errno : EPIPE));
  }
  return absl::OkStatus();
}

absl::Status ReadFully(int fd, void* data, size_t bytes, absl::Time deadline) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, p, bytes, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return absl::UnavailableError("connection closed by peer");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      STEPMESH_RETURN_IF_ERROR(WaitFor(fd, POLLIN, deadline));
      continue;
    }
    return absl::UnavailableError(ErrnoMessage("recv", errno));
  }
  return absl::OkStatus();
}

void SkipWritten(size_t n, iovec** iov, int* iovcnt) {
  while (*iovcnt > 0 && n >= (*iov)->iov_len) {
    n -= (*iov)->iov_len;
    ++*iov;
    --*iovcnt;
  }
  if (*iovcnt > 0) {
    (*iov)->iov_base = static_cast<char*>((*iov)->iov_base) + n;
    (*iov)->iov_len -= n;
  }
}

std::string PeerAddress(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    return absl::StrCat(host, ":", ntohs(in->sin_port));
  }
  if (addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    return absl::StrCat("[", host, "]:", ntohs(in6->sin6_port));
  }
  return "?";
}

absl::string_view AddressHost(absl::string_view address) {
  const size_t colon = address.rfind(':');
  return colon == absl::string_view::npos ? address : address.substr(0, colon);
}

absl::StatusOr<bool> IsLoopbackHost(const std::string& host) {
  absl::string_view name = host;
  if (name.size() >= 2 && name.front() == '[' && name.back() == ']') {
    name = name.substr(1, name.size() - 2);
  }
  if (name.empty()) return false;  // bind() to "" is the wildcard
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const std::string lookup(name);
  const int rc = ::getaddrinfo(lookup.c_str(), nullptr, &hints, &result);
  if (rc != 0 || result == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve '", host, "': ", ::gai_strerror(rc)));
  }
  bool loopback = true;
  for (const addrinfo* a = result; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const uint32_t ip = ntohl(reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr.s_addr);
      loopback = loopback && (ip >> 24) == 127;
    } else if (a->ai_family == AF_INET6) {
      const in6_addr& ip = reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr;
      const bool mapped_loopback = IN6_IS_ADDR_V4MAPPED(&ip) && ip.s6_addr[12] == 127;
      loopback = loopback && (IN6_IS_ADDR_LOOPBACK(&ip) || mapped_loopback);
    } else {
      loopback = false;
    }
  }
  ::freeaddrinfo(result);
  return loopback;
}

absl::StatusOr<Acceptor> Acceptor::Create(UniqueFd listener) {
  STEPMESH_RETURN_IF_ERROR(SetNonBlocking(listener.get(), true));
  Acceptor a;
  a.listener_ = std::move(listener);
  a.spare_.Reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  return a;
}

Acceptor::Outcome Acceptor::Accept(Accepted* out) {
  for (;;) {
    const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      out->fd.Reset(fd);
      out->peer = PeerAddress(fd);
      return Outcome::kAccepted;
    }
    const int err = errno;
    if (err == EINTR || err == ECONNABORTED) continue;
    if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
      // Give the spare up to take the waiting connection off the queue, close
      // it, and take the spare back; with no spare (another thread took the
      // last descriptor) the back-off alone keeps the loop from spinning.
      if (spare_.valid()) {
        spare_.Reset();
        const int dropped = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
        if (dropped >= 0) ::close(dropped);
        spare_.Reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
      }
      exhausted_errno_ = err;
      paused_until_ = absl::Now() + absl::Milliseconds(100);
      return Outcome::kExhausted;
    }
    return Outcome::kNone;  // EAGAIN, or an error of the waiting connection itself
  }
}

absl::StatusOr<bool> WaitReadable(int fd, absl::Time deadline) {
  const int ready = PollFor(fd, POLLIN, deadline);
  if (ready < 0) return absl::InternalError(ErrnoMessage("poll", errno));
  return ready == 1;
}

}  // namespace stepmesh::base
