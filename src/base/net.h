#pragma once
// Socket plumbing shared by the rendezvous and the TCP transport: RAII file
// descriptors, listen/connect with deadlines, and whole-buffer I/O that never
// blocks past a deadline.

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
// Accepts one connection, waiting at most until `deadline`.
absl::StatusOr<UniqueFd> AcceptTcp(int listen_fd, absl::Time deadline);

absl::Status SetNonBlocking(int fd, bool on);
absl::Status SetNoDelay(int fd);
absl::Status SetBufferSizes(int fd, int bytes);

// Moves exactly `bytes` (fd may be blocking or not); UNAVAILABLE on close/reset,
// DEADLINE_EXCEEDED at the deadline.
absl::Status WriteFully(int fd, const void* data, size_t bytes, absl::Time deadline);
absl::Status ReadFully(int fd, void* data, size_t bytes, absl::Time deadline);
// Waits until `fd` is readable (true) or the deadline passes (false).
absl::StatusOr<bool> WaitReadable(int fd, absl::Time deadline);

std::string ErrnoMessage(absl::string_view what, int err);

}  // namespace stepmesh::base
