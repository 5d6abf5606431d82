#include "benchmarks/perf_baselines_io.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <thread>

#include "absl/time/clock.h"
#include "src/base/net.h"
#include "stepmesh/status.h"

namespace stepmesh::bench::baseline_io {

absl::Status SetTimeouts(int fd, absl::Duration timeout) {
  timeval tv = absl::ToTimeval(timeout);
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    return absl::InternalError(base::ErrnoMessage("setsockopt timeouts", errno));
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, iovec* iov, int iovcnt) {
  while (iovcnt > 0) {
    const ssize_t n = ::writev(fd, iov, iovcnt);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(base::ErrnoMessage("raw-tcp writev", errno));
    }
    size_t left = static_cast<size_t>(n);
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return absl::OkStatus();
}

absl::Status ReadAll(LowWater& lw, void* data, size_t bytes, absl::Time deadline) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    lw.Want(bytes);
    if (lw.enabled()) {
      const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (left_ms <= 0) return absl::DeadlineExceededError("raw-tcp receive timed out");
      pollfd pfd{lw.fd(), POLLIN, 0};
      const int ready = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left_ms, INT32_MAX)));
      if (ready < 0 && errno != EINTR) {
        return absl::UnavailableError(base::ErrnoMessage("raw-tcp poll", errno));
      }
      if (ready <= 0) continue;
    }
    const ssize_t n = ::recv(lw.fd(), p, bytes, lw.enabled() ? MSG_DONTWAIT : MSG_WAITALL);
    if (n == 0) return absl::UnavailableError("raw-tcp peer closed");
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (lw.enabled()) continue;  // woken without bytes: poll again
        return absl::DeadlineExceededError("raw-tcp receive timed out");  // SO_RCVTIMEO
      }
      return absl::UnavailableError(base::ErrnoMessage("raw-tcp recv", errno));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

bool ReadableNow(int fd) {
  pollfd pfd{fd, POLLIN, 0};
  return ::poll(&pfd, 1, 0) > 0;  // POLLIN, or POLLHUP/POLLERR that recv() reports
}

absl::Status SpinReadAll(LowWater& lw, void* data, size_t bytes, absl::Duration spin_for,
                         absl::Time deadline) {
  auto* p = static_cast<char*>(data);
  absl::Time idle_since = absl::InfinitePast();
  for (uint32_t idle = 0; bytes > 0;) {
    lw.Want(bytes);
    if (!lw.enabled() || ReadableNow(lw.fd())) {
      const ssize_t n = ::recv(lw.fd(), p, bytes, MSG_DONTWAIT);
      if (n > 0) {
        p += n;
        bytes -= static_cast<size_t>(n);
        idle = 0;
        continue;
      }
      if (n == 0) return absl::UnavailableError("raw-tcp peer closed");
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return absl::UnavailableError(base::ErrnoMessage("raw-tcp recv", errno));
      }
    }
    if (++idle % 1024 == 0) {
      const absl::Time now = absl::Now();
      if (idle == 1024) idle_since = now;
      if (now - idle_since > spin_for) return ReadAll(lw, p, bytes, deadline);
      if (now > deadline) return absl::DeadlineExceededError("raw-tcp receive timed out");
    }
    // An empty round: let the thread we wait for run (the library's receive
    // loop does the same, src/core/mesh_node.cc).
    std::this_thread::yield();
  }
  return absl::OkStatus();
}

absl::Status ConfigureRaw(int fd, int sockbuf, absl::Duration timeout) {
  STEPMESH_RETURN_IF_ERROR(base::SetNoDelay(fd));
  if (sockbuf > 0) STEPMESH_RETURN_IF_ERROR(base::SetBufferSizes(fd, sockbuf));
  return SetTimeouts(fd, timeout);
}

absl::StatusOr<bool> ReceiveQueued(int fd, char* into, size_t want, size_t* received) {
  const ssize_t n = ::recv(fd, into, want, MSG_DONTWAIT);
  if (n > 0) {
    *received += static_cast<size_t>(n);
    return true;
  }
  if (n == 0) return absl::UnavailableError("raw-tcp peer closed");
  if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
    return absl::UnavailableError(base::ErrnoMessage("raw-tcp recv", errno));
  }
  return false;
}

}  // namespace stepmesh::bench::baseline_io
