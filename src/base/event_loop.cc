#include "src/base/event_loop.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>

namespace stepmesh::base {

absl::StatusOr<EventLoop> EventLoop::Create(Wakeable wakeable) {
  EventLoop loop;
  loop.epoll_.Reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!loop.epoll_.valid()) return absl::InternalError(ErrnoMessage("epoll_create1", errno));
  if (wakeable == Wakeable::kNo) return loop;
  loop.wake_.Reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!loop.wake_.valid()) return absl::InternalError(ErrnoMessage("eventfd", errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeToken;
  if (::epoll_ctl(loop.epoll_.get(), EPOLL_CTL_ADD, loop.wake_.get(), &ev) != 0) {
    return absl::InternalError(ErrnoMessage("epoll_ctl", errno));
  }
  return loop;
}

absl::Status EventLoop::Control(int op, int fd, uint32_t events, uint64_t token) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = token;
  if (::epoll_ctl(epoll_.get(), op, fd, &ev) != 0) {
    return absl::InternalError(
        ErrnoMessage(op == EPOLL_CTL_ADD ? "epoll_ctl(ADD)" : "epoll_ctl(MOD)", errno));
  }
  return absl::OkStatus();
}

absl::Status EventLoop::Watch(int fd, uint32_t events, uint64_t token) {
  return Control(EPOLL_CTL_ADD, fd, events, token);
}

absl::Status EventLoop::Modify(int fd, uint32_t events, uint64_t token) {
  return Control(EPOLL_CTL_MOD, fd, events, token);
}

void EventLoop::Unwatch(int fd) {
  if (epoll_.valid()) ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
}

void EventLoop::Wake() {
  const uint64_t one = 1;
  if (wake_.valid()) (void)!::write(wake_.get(), &one, sizeof(one));
}

absl::StatusOr<int> EventLoop::Wait(epoll_event* out, int max, int timeout_ms, bool* woken) {
  if (woken != nullptr) *woken = false;
  const int n = ::epoll_wait(epoll_.get(), out, max, timeout_ms);
  if (n < 0) {
    if (errno == EINTR) return 0;
    return absl::InternalError(ErrnoMessage("epoll_wait", errno));
  }
  int kept = 0;
  for (int i = 0; i < n; ++i) {
    if (out[i].data.u64 == kWakeToken) {
      uint64_t drain;
      (void)!::read(wake_.get(), &drain, sizeof(drain));
      if (woken != nullptr) *woken = true;
      continue;
    }
    out[kept++] = out[i];
  }
  return kept;
}

}  // namespace stepmesh::base
