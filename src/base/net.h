#pragma once
// Socket plumbing shared by the rendezvous and the TCP transport: RAII file
// descriptors, listen/connect with deadlines, and whole-buffer I/O that never
// blocks past a deadline.

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace stepmesh::base {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) Reset(std::exchange(other.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Reset(int fd = -1);
  int Release() { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

struct HostPort {
  std::string host;
  uint16_t port = 0;
};
absl::StatusOr<HostPort> ParseHostPort(absl::string_view text);

// Binds and listens (port 0: the kernel picks; read it back with LocalPort).
absl::StatusOr<UniqueFd> ListenTcp(const std::string& host, uint16_t port, int backlog = 128);
absl::StatusOr<uint16_t> LocalPort(int fd);
// Connects, retrying refused connections until `deadline` (the peer may still be starting).
absl::StatusOr<UniqueFd> ConnectTcp(const HostPort& to, absl::Time deadline);
// A connect started without waiting, for dialling many peers at once: `fd` is
// nonblocking; `error` is 0 (connected), EINPROGRESS (wait for POLLOUT, then
// read the outcome with ConnectError) or the connect's errno.
struct StartedConnect {
  UniqueFd fd;
  int error = 0;
};
absl::StatusOr<StartedConnect> StartConnectTcp(const HostPort& to);
// How the started connect of `fd` ended: 0 or its errno.
int ConnectError(int fd);
// The connect errors ConnectTcp retries: the peer may still be starting.
bool RetryableConnectError(int err);
// Accepts one connection, waiting at most until `deadline`.
absl::StatusOr<UniqueFd> AcceptTcp(int listen_fd, absl::Time deadline);

absl::Status SetNonBlocking(int fd, bool on);
absl::Status SetNoDelay(int fd);
absl::Status SetBufferSizes(int fd, int bytes);

// Moves exactly `bytes` (fd may be blocking or not); UNAVAILABLE on close/reset,
// DEADLINE_EXCEEDED at the deadline.
absl::Status WriteFully(int fd, const void* data, size_t bytes, absl::Time deadline);
absl::Status ReadFully(int fd, void* data, size_t bytes, absl::Time deadline);
// After a writev/sendmsg wrote `n` bytes of `*iov`: advances `*iov` and
// `*iovcnt` past them (the first iovec left may be cut at its start).
void SkipWritten(size_t n, iovec** iov, int* iovcnt);

// Waits until `fd` is readable (true) or the deadline passes (false).
absl::StatusOr<bool> WaitReadable(int fd, absl::Time deadline);

// "host:port" of the remote end of a connected socket ("?" when unknown), for logs.
std::string PeerAddress(int fd);
// The host part of a PeerAddress ("127.0.0.1" of "127.0.0.1:4242"; "[::1]" stays bracketed).
absl::string_view AddressHost(absl::string_view address);

// Whether every address `host` resolves to is a loopback address (127.0.0.0/8,
// ::1, ::ffff:127.0.0.0/104). The wildcard (0.0.0.0, ::) and any interface
// address are not: a listener there is reachable from other machines.
absl::StatusOr<bool> IsLoopbackHost(const std::string& host);

// The accepting side of a listener in an event loop. Non-blocking, and safe
// when the process runs out of descriptors: accept() then fails with EMFILE
// while the connection stays queued, so the listener stays readable and a
// loop that only retries spins at full speed. The acceptor keeps one spare
// descriptor (/dev/null) to give up in that case: it accepts and closes the
// waiting connection (the client sees a clean close, not a hang), takes the
// spare back, and asks the loop to leave the listener alone for a back-off.
class Acceptor {
 public:
  Acceptor() = default;
  // Takes a listening socket and makes it non-blocking.
  static absl::StatusOr<Acceptor> Create(UniqueFd listener);

  int fd() const { return listener_.get(); }
  bool valid() const { return listener_.valid(); }

  enum class Outcome {
    kAccepted,   // *out holds the connection (non-blocking, close-on-exec) and its address
    kNone,       // nothing waiting
    kExhausted,  // out of descriptors (or kernel memory): one waiting connection was
                 // closed unserved; leave the listener unwatched until paused_until()
  };
  struct Accepted {
    UniqueFd fd;
    std::string peer;  // PeerAddress
  };
  Outcome Accept(Accepted* out);
  absl::Time paused_until() const { return paused_until_; }
  // The errno of the last kExhausted (EMFILE, ENFILE, ENOBUFS, ENOMEM).
  int exhausted_errno() const { return exhausted_errno_; }

 private:
  UniqueFd listener_;
  UniqueFd spare_;
  absl::Time paused_until_ = absl::InfinitePast();
  int exhausted_errno_ = 0;
};

std::string ErrnoMessage(absl::string_view what, int err);

}  // namespace stepmesh::base
