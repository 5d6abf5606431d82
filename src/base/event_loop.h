#pragma once
// What a receive thread or the scheduler waits in: an epoll set with an
// eventfd that wakes it from any thread, and the accept-and-admit pass of a
// listener whose clients have not proved who they are yet. The loop: the
// scheduler's and both transports' receive threads (the TCP transport nests
// its handshakes' set, which has no wake, in its loop: WatchLoop). The accept
// pass: the scheduler, the RDMA bootstrap listener, the TCP data listeners.

#include <sys/epoll.h>

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "src/base/admission.h"
#include "src/base/logging.h"
#include "src/base/net.h"
#include "src/base/rate_limit.h"

namespace stepmesh::base {

class EventLoop {
 public:
  // Reserved: the token of the loop's own wake descriptor.
  static constexpr uint64_t kWakeToken = ~uint64_t{0};

  enum class Wakeable { kYes, kNo };

  EventLoop() = default;  // invalid until Create
  // kNo: no wake descriptor (a set only ever waited in without blocking, or
  // nested in another loop that has one); Wake does nothing.
  static absl::StatusOr<EventLoop> Create(Wakeable wakeable = Wakeable::kYes);

  bool valid() const { return epoll_.valid(); }
  // The epoll descriptor: readable while an event waits (Transport::WaitFd).
  int fd() const { return epoll_.get(); }

  // `events`: EPOLLIN, EPOLLOUT, ... `token` comes back with each event (any
  // value but kWakeToken; a pointer through TokenOf).
  absl::Status Watch(int fd, uint32_t events, uint64_t token);
  absl::Status Modify(int fd, uint32_t events, uint64_t token);
  // Keeps `fd` in the set but reports nothing for it until the next Modify:
  // the set is level-triggered, so a descriptor that must not be read now
  // (a listener out of descriptors, a handshake that waits for a decision,
  // a rail that waits for another) would otherwise wake every Wait.
  absl::Status Pause(int fd, uint64_t token) { return Modify(fd, 0, token); }
  // Watches another loop's set as one descriptor: `token` comes back while
  // any of `inner`'s events waits (drained by waiting in `inner`).
  absl::Status WatchLoop(const EventLoop& inner, uint64_t token) {
    return Watch(inner.fd(), EPOLLIN, token);
  }
  // Stops watching `fd` (before it is closed: a closed descriptor may stay in
  // the set while another process holds it).
  void Unwatch(int fd);

  template <typename T>
  static uint64_t TokenOf(T* p) {
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
  }
  template <typename T>
  static T* PointerOf(uint64_t token) {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(token));
  }

  // From any thread: the Wait in progress, or the next one, returns.
  void Wake();

  // Waits up to `timeout_ms` (0: never blocks) for events and writes up to
  // `max` of them to `out`, wakes left out (they are consumed here);
  // `*woken` (optional) says whether one came. Returns how many it wrote
  // (0 after a signal).
  absl::StatusOr<int> Wait(epoll_event* out, int max, int timeout_ms, bool* woken = nullptr);

 private:
  absl::Status Control(int op, int fd, uint32_t events, uint64_t token);

  UniqueFd epoll_;
  UniqueFd wake_;
};

// One pass over a listener whose connections must still prove who they are
// (the scheduler's joins, the RDMA bootstrap handshakes): accepts what waits
// (at most 64, so a flood cannot starve the caller's other work) and admits
// each under `caps` (base/admission.h): a newcomer over a cap first evicts
// the oldest waiting entry of `entries` -- `evict(entry, why)` --, then
// `admit(accepted)` adds it. Out of descriptors (the acceptor closed the
// connection unserved and pauses): logged as `who`, rate-limited by
// `limit`, and the pass ends. Returns how the pass ended: kNone (nothing
// more waits), kExhausted (the caller leaves the listener alone until
// acceptor.paused_until(): EventLoop::Pause) or kAccepted (the 64 were
// admitted, more may wait).
template <typename Entries, typename Waiting, typename AddressOf, typename Evict, typename Admit>
Acceptor::Outcome AcceptAndAdmit(Acceptor& acceptor, RateLimiter& limit, absl::string_view who,
                                 Entries& entries, Waiting waiting, AddressOf address_of,
                                 const AdmissionCaps& caps, Evict evict, Admit admit) {
  for (int i = 0; i < 64; ++i) {
    Acceptor::Accepted accepted;
    switch (acceptor.Accept(&accepted)) {
      case Acceptor::Outcome::kNone:
        return Acceptor::Outcome::kNone;
      case Acceptor::Outcome::kExhausted:
        STEPMESH_LOG_LIMITED(limit, kWarning, who, ": out of file descriptors (",
                             ErrnoMessage("accept", acceptor.exhausted_errno()),
                             "): closed a new connection unserved; accepting again in 100 ms");
        return Acceptor::Outcome::kExhausted;
      case Acceptor::Outcome::kAccepted:
        break;
    }
    std::string why;
    if (auto* oldest = OldestOverCap(entries, waiting, address_of, accepted.peer, caps, &why);
        oldest != nullptr) {
      evict(*oldest, why);
    }
    admit(std::move(accepted));
  }
  return Acceptor::Outcome::kAccepted;
}

}  // namespace stepmesh::base
