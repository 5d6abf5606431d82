#pragma once
// The socket helpers of the baselines (benchmarks/perf_baselines.h): the size
// header every request starts with, and the blocking, busy-polled and
// low-water-marked sends and receives of the raw-tcp clients and the echo
// side. Internal to stepmesh_perf_support.

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace stepmesh::bench::baseline_io {

// Size header of both baselines (host order: both ends are this program on the
// same architecture).
struct SizeHeader {
  uint64_t push_bytes = 0;
  uint64_t pull_bytes = 0;
  uint64_t batch = 1;      // clients the server hears from before it answers any (an AF batch)
  uint64_t mode = 0;       // RawMode: how the echo side receives
  uint64_t low_water = 0;  // 1: with the receive low-water mark
};

// Blocking sockets with kernel timeouts: a stuck peer fails the call instead
// of hanging the benchmark. The spinning paths use MSG_DONTWAIT per call.
absl::Status SetTimeouts(int fd, absl::Duration timeout);

absl::Status WriteAll(int fd, iovec* iov, int iovcnt);

// The receive low-water mark, as the TCP transport sets it (tcp_transport.cc,
// SetLowWater): the kernel reports a socket readable, and wakes a sleeping
// receiver, only once the rest of the current message or kLowWaterCap of it
// is queued. Without it a receiver chases the sender 64 KiB segment by
// segment, each wake-up or busy recv taking the socket lock the sender's
// loopback delivery needs; with it, one copy per 256 KiB. Set only when the
// wanted mark changes.
inline constexpr size_t kLowWaterCap = 256 << 10;

class LowWater {
 public:
  // `enabled` false: the kernel's default mark of one byte.
  explicit LowWater(int fd, bool enabled = true) : fd_(fd), enabled_(enabled) {}
  // The mark for `left` more bytes of the message being read. A mark above
  // what will still arrive would never report the socket readable.
  void Want(size_t left) {
    if (enabled_) Set(static_cast<int>(std::clamp<size_t>(left, 1, kLowWaterCap)));
  }
  // Switched per request on the echo side; off restores the default mark.
  void Enable(bool on) {
    enabled_ = on;
    if (!on) Set(1);
  }
  int fd() const { return fd_; }
  bool enabled() const { return enabled_; }

 private:
  void Set(int want) {
    if (want == current_) return;
    if (::setsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(want)) == 0) current_ = want;
  }
  int fd_;
  bool enabled_;
  int current_ = 1;  // the kernel's default
};

// Blocking receive of exactly `bytes`. With the low-water mark: sleep in
// poll() until the mark is reached, copy what is queued without blocking,
// lower the mark to what is left, again (the library's blocking mode sleeps
// in epoll_wait the same way). Not recv(MSG_WAITALL): a receive that already
// copied part of a chunk waits for the kernel's wake-up, which comes only
// once a whole mark's worth more is queued, so at the end of a message it
// would sleep until the timeout. Without the mark (raw-naive): MSG_WAITALL,
// one wake-up per segment.
absl::Status ReadAll(LowWater& lw, void* data, size_t bytes, absl::Time deadline);

// Whether `fd` is readable now (honouring its low-water mark), without taking
// the socket lock a recv() would: the library's spinning receive thread polls
// readiness the same way (epoll_wait with a zero timeout).
bool ReadableNow(int fd);

// Busy-polled receive of exactly `bytes`: readiness polled in a loop, then a
// non-blocking recv of whatever is queued. After `spin_for` without any byte
// it finishes with a blocking ReadAll (infinite: spin until `deadline`).
absl::Status SpinReadAll(LowWater& lw, void* data, size_t bytes, absl::Duration spin_for,
                         absl::Time deadline);

// TCP_NODELAY, the socket buffers when `sockbuf` > 0, and SetTimeouts.
absl::Status ConfigureRaw(int fd, int sockbuf, absl::Duration timeout);

// Non-blocking recv of what is queued, up to `want` bytes, into `into`; adds
// the bytes to *received. False when nothing was queued.
absl::StatusOr<bool> ReceiveQueued(int fd, char* into, size_t want, size_t* received);

}  // namespace stepmesh::bench::baseline_io
