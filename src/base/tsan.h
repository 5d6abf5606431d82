#pragma once
// ThreadSanitizer annotations for causality that travels through the kernel:
// the bytes of a TCP connection. Empty (no members, no calls, no syscalls)
// unless the build has -fsanitize=thread.
//
// What TSan sees without them: sendmsg() reads the payload (the interceptor
// marks the iovecs read by the calling thread) and recv() writes the
// destination (marked written by the receive thread), but the only ordering it
// adds is between calls on the *same descriptor*. The two ends of a connection
// are different descriptors (in different transports, often of one process in
// the tests), so "the peer answered, therefore the kernel has finished reading
// my tensor" is invisible, and the application's next write of a tensor it had
// sent races, in TSan's eyes, with the kernel's copy. SocketCausality is that
// connection as one TSan sync object, which both ends find on their own from
// the connection's addresses.
//
// Why one object for both directions, not one per direction: when the peer is
// another process, its half of the chain (it read our bytes, then answered) is
// invisible to this process's TSan; our receive of its answer acquiring what
// our own send released stands for it. What that can hide: an application
// write racing with a sendmsg still in progress (one non-blocking call), if
// another frame that arrived on the same connection during the call is what
// released the application.

#include <sys/socket.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>

#if defined(__SANITIZE_THREAD__)
#define STEPMESH_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define STEPMESH_TSAN 1
#endif
#endif

#if defined(STEPMESH_TSAN)
#include <netinet/in.h>
#include <sanitizer/tsan_interface.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <initializer_list>

// Exported by libtsan, not declared in GCC 12's <sanitizer/tsan_interface.h>.
extern "C" void __tsan_read_range(void* addr, unsigned long size);  // NOLINT(runtime/int)
#endif

namespace stepmesh::base {

#if defined(STEPMESH_TSAN)

namespace tsan_internal {

// Why a fixed table of addresses, in a process-wide array, for a per-connection
// object: the two ends live in different transports (often of different
// meshes) that share nothing, and a registry both could look up would be a
// singleton of its own. A connection is named by its two endpoints, in a
// canonical order, which each end computes from its socket
// (getsockname/getpeername, once per connection), and hashed into this table:
// TSan wants application memory to hang a sync object on, and a collision only
// adds ordering between two connections (it can hide a race, never invent
// one). Not one object for every socket: a receive would then acquire every
// send of the process, and an application that waited for the answer of one
// peer before rewriting a tensor still being sent to another would pass.
inline constexpr size_t kConnections = 4096;
inline uint64_t connections[kConnections];

// An endpoint as 16 address bytes (IPv4 as v4-mapped IPv6, as one end of a
// dual-stack connection may see it) and the port.
inline bool Endpoint(const sockaddr_storage& s, unsigned char out[18]) {
  std::memset(out, 0, 18);
  if (s.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(s);
    out[10] = out[11] = 0xff;
    std::memcpy(out + 12, &a.sin_addr, 4);
    std::memcpy(out + 16, &a.sin_port, 2);
    return true;
  }
  if (s.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(s);
    std::memcpy(out, &a.sin6_addr, 16);
    std::memcpy(out + 16, &a.sin6_port, 2);
    return true;
  }
  return false;
}

// The connection between endpoints `a` and `b`, the same from either end
// (FNV-1a over both, the lesser first).
inline void* Connection(const unsigned char a[18], const unsigned char b[18]) {
  const bool a_first = std::memcmp(a, b, 18) <= 0;
  uint64_t h = 1469598103934665603ull;
  for (const unsigned char* p : {a_first ? a : b, a_first ? b : a}) {
    for (int i = 0; i < 18; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  return &connections[h % kConnections];
}

}  // namespace tsan_internal

// One TCP connection as a TSan sync object.
class SocketCausality {
 public:
  SocketCausality() = default;

  // For a connected socket; a default (inert) object when its addresses are
  // not IP (nothing to annotate: every call below is then a no-op).
  static SocketCausality ForSocket(int fd) {
    sockaddr_storage local{}, remote{};
    socklen_t local_len = sizeof(local), remote_len = sizeof(remote);
    unsigned char self[18], peer[18];
    SocketCausality c;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
        ::getpeername(fd, reinterpret_cast<sockaddr*>(&remote), &remote_len) != 0 ||
        !tsan_internal::Endpoint(local, self) || !tsan_internal::Endpoint(remote, peer)) {
      return c;
    }
    c.link_ = tsan_internal::Connection(self, peer);
    return c;
  }

  // sendmsg(2) of application memory, annotated. Why not TSan's own sendmsg
  // interceptor: it marks the payload read when the call *returns*, and the
  // sending thread is often preempted right there (the call woke the
  // receiver); the peer's answer, and this process's next write of the same
  // tensor, can come first, which TSan then reports as a race with the copy.
  // The kernel reads the payload inside the call, before the peer sees a
  // byte, so the read is marked (and released) before the raw system call.
  // The interceptor's release on the descriptor (which orders this thread
  // before later receives on the same descriptor) is subsumed by Release on
  // the connection; what is lost is TSan's check of the descriptor against a
  // concurrent close, for this call only.
  ssize_t SendMsg(int fd, const msghdr* msg, int flags) const {
    if (link_ == nullptr) return ::sendmsg(fd, msg, flags);  // not IP: TSan's own
    for (size_t i = 0; i < msg->msg_iovlen; ++i) {
      __tsan_read_range(msg->msg_iov[i].iov_base, msg->msg_iov[i].iov_len);
    }
    Release();
    const ssize_t n = ::syscall(SYS_sendmsg, fd, msg, flags);
    Release();
    return n;
  }

  // Call around any other send (the wire proxy's of its own buffer): before
  // the call (what this thread did before sending reaches whoever reads the
  // bytes) and after it returned (the kernel's read of them, which the
  // interceptor marks on return, reaches whoever reacts to them).
  void Release() const {
    if (link_ != nullptr) __tsan_release(link_);
  }
  // After a receive returned: what the peer did before it sent these bytes
  // happened before this thread's use of them (and its next receive into the
  // same memory).
  void Acquire() const {
    if (link_ != nullptr) __tsan_acquire(link_);
  }

 private:
  void* link_ = nullptr;
};

#else  // !STEPMESH_TSAN: no state, no calls.

class SocketCausality {
 public:
  static SocketCausality ForSocket(int) { return {}; }
  ssize_t SendMsg(int fd, const msghdr* msg, int flags) const { return ::sendmsg(fd, msg, flags); }
  void Release() const {}
  void Acquire() const {}
};

#endif

}  // namespace stepmesh::base
