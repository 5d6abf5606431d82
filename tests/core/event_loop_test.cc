// base::EventLoop (epoll + eventfd wake) and base::AcceptAndAdmit, which the
// RDMA transport and the scheduler wait and accept in.

#include "src/base/event_loop.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <list>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"

namespace stepmesh::base {
namespace {

TEST_CASE("event loop: a wake from another thread ends a wait, and is no event", "[base]") {
  absl::StatusOr<EventLoop> loop = EventLoop::Create();
  REQUIRE(loop.ok());
  epoll_event events[4];
  bool woken = true;
  // Nothing watched, nothing woken: a zero timeout returns at once.
  absl::StatusOr<int> none = loop->Wait(events, 4, 0, &woken);
  REQUIRE(none.ok());
  CHECK(*none == 0);
  CHECK_FALSE(woken);
  const absl::Time start = absl::Now();
  std::thread waker([&] {
    absl::SleepFor(absl::Milliseconds(50));
    loop->Wake();
  });
  absl::StatusOr<int> n = loop->Wait(events, 4, 10000, &woken);
  waker.join();
  REQUIRE(n.ok());
  CHECK(*n == 0);
  CHECK(woken);
  CHECK(absl::Now() - start < absl::Seconds(5));
  // The wake was consumed: the next wait times out.
  n = loop->Wait(events, 4, 10, &woken);
  REQUIRE(n.ok());
  CHECK(*n == 0);
  CHECK_FALSE(woken);
}

TEST_CASE("event loop: a watched descriptor reports its token until unwatched", "[base]") {
  absl::StatusOr<EventLoop> loop = EventLoop::Create();
  REQUIRE(loop.ok());
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  UniqueFd read_end(fds[0]);
  UniqueFd write_end(fds[1]);
  REQUIRE(loop->Watch(read_end.get(), EPOLLIN, 42).ok());
  CHECK_FALSE(loop->Watch(read_end.get(), EPOLLIN, 43).ok());  // twice: refused
  REQUIRE(::write(write_end.get(), "x", 1) == 1);
  loop->Wake();
  epoll_event events[4];
  bool woken = false;
  absl::StatusOr<int> n = loop->Wait(events, 4, 1000, &woken);
  REQUIRE(n.ok());
  REQUIRE(*n == 1);  // the wake is not among them
  CHECK(events[0].data.u64 == 42);
  CHECK(woken);
  REQUIRE(loop->Modify(read_end.get(), EPOLLIN, 7).ok());
  n = loop->Wait(events, 4, 1000);
  REQUIRE(n.ok());
  REQUIRE(*n == 1);
  CHECK(events[0].data.u64 == 7);
  loop->Unwatch(read_end.get());
  n = loop->Wait(events, 4, 10);
  REQUIRE(n.ok());
  CHECK(*n == 0);
}

struct Waiting {
  UniqueFd fd;
  std::string peer;
  bool dropped = false;
};

TEST_CASE("event loop: accept-and-admit evicts the oldest waiting connection over a cap",
          "[base]") {
  absl::StatusOr<UniqueFd> listener = ListenTcp("127.0.0.1", 0);
  REQUIRE(listener.ok());
  absl::StatusOr<Acceptor> acceptor = Acceptor::Create(*std::move(listener));
  REQUIRE(acceptor.ok());
  absl::StatusOr<uint16_t> port = LocalPort(acceptor->fd());
  REQUIRE(port.ok());
  std::vector<UniqueFd> clients;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<UniqueFd> c =
        ConnectTcp(HostPort{"127.0.0.1", *port}, absl::Now() + absl::Seconds(5));
    REQUIRE(c.ok());
    clients.push_back(*std::move(c));
  }
  RateLimiter limit(10, absl::Seconds(10));
  std::list<Waiting> waiting;
  std::vector<std::string> reasons;
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (waiting.size() < 3 && absl::Now() < until) {
    AcceptAndAdmit(
        *acceptor, limit, "test", waiting, [](const Waiting& w) { return !w.dropped; },
        [](const Waiting& w) -> const std::string& { return w.peer; }, AdmissionCaps{2, 10},
        [&](Waiting& w, const std::string& why) {
          w.dropped = true;
          w.fd.Reset();
          reasons.push_back(why);
        },
        [&](Acceptor::Accepted a) {
          waiting.push_back({std::move(a.fd), std::move(a.peer)});
        });
    absl::SleepFor(absl::Milliseconds(5));
  }
  REQUIRE(waiting.size() == 3);
  CHECK(waiting.front().dropped);  // the oldest of the three from one address
  CHECK_FALSE(waiting.back().dropped);
  REQUIRE(reasons.size() == 1);
  CHECK(absl::StrContains(reasons[0], "more than 2"));
}

}  // namespace
}  // namespace stepmesh::base
