#pragma once
// What a receive thread or the scheduler waits in: an epoll set with an
// eventfd that wakes it from any thread, and the accept-and-admit pass of a
// listener whose clients have not proved who they are yet. Used by the RDMA
// transport and the scheduler (the TCP transport's loop is still its own).

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

  EventLoop() = default;  // invalid until Create
  static absl::StatusOr<EventLoop> Create();

  bool valid() const { return epoll_.valid(); }

  // `events`: EPOLLIN, EPOLLOUT, ... `token` comes back with each event (any
  // value but kWakeToken).
  absl::Status Watch(int fd, uint32_t events, uint64_t token);
  absl::Status Modify(int fd, uint32_t events, uint64_t token);
  // Stops watching `fd` (before it is closed: a closed descriptor may stay in
  // the set while another process holds it).
  void Unwatch(int fd);

  // From any thread: the Wait in progress, or the next one, returns.
  void Wake();

  // Waits up to `timeout_ms` (0: never blocks) for events and writes up to
  // `max` of them to `out`, wakes left out (they are consumed here);
  // `*woken` (optional) says whether one came. Returns how many it wrote
  // (0 after a signal).
  absl::StatusOr<int> Wait(epoll_event* out, int max, int timeout_ms, bool* woken = nullptr);

 private:
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
// `limit`, and the pass ends.
template <typename Entries, typename Waiting, typename AddressOf, typename Evict, typename Admit>
void AcceptAndAdmit(Acceptor& acceptor, RateLimiter& limit, absl::string_view who, Entries& entries,
                    Waiting waiting, AddressOf address_of, const AdmissionCaps& caps, Evict evict,
                    Admit admit) {
  for (int i = 0; i < 64; ++i) {
    Acceptor::Accepted accepted;
    switch (acceptor.Accept(&accepted)) {
      case Acceptor::Outcome::kNone:
        return;
      case Acceptor::Outcome::kExhausted:
        STEPMESH_LOG_LIMITED(limit, kWarning, who, ": out of file descriptors (",
                             ErrnoMessage("accept", acceptor.exhausted_errno()),
                             "): closed a new connection unserved; accepting again in 100 ms");
        return;
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
}

}  // namespace stepmesh::base
