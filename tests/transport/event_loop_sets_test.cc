// What the TCP transport asks of base::EventLoop beyond one watched set: a
// descriptor paused in its set (a rail waiting for another, a parked
// handshake), a second set nested in the first (the handshakes), and an
// accept pass that says when its listener ran out of descriptors.

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <list>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "src/base/event_loop.h"

namespace stepmesh::base {
namespace {

struct Pipe {
  UniqueFd read_end;
  UniqueFd write_end;
  static Pipe Make() {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    return {UniqueFd(fds[0]), UniqueFd(fds[1])};
  }
};

TEST_CASE("event loop: a paused descriptor stays in its set and reports nothing until modified",
          "[base]") {
  absl::StatusOr<EventLoop> loop = EventLoop::Create();
  REQUIRE(loop.ok());
  Pipe p = Pipe::Make();
  REQUIRE(loop->Watch(p.read_end.get(), EPOLLIN, 42).ok());
  REQUIRE(::write(p.write_end.get(), "x", 1) == 1);
  epoll_event events[4];
  absl::StatusOr<int> n = loop->Wait(events, 4, 1000);
  REQUIRE(n.ok());
  REQUIRE(*n == 1);  // level-triggered: unread, it is reported again and again
  REQUIRE(loop->Pause(p.read_end.get(), 42).ok());
  n = loop->Wait(events, 4, 20);
  REQUIRE(n.ok());
  CHECK(*n == 0);                                                // still unread, but paused
  CHECK_FALSE(loop->Watch(p.read_end.get(), EPOLLIN, 42).ok());  // still in the set
  REQUIRE(loop->Modify(p.read_end.get(), EPOLLIN, 43).ok());
  n = loop->Wait(events, 4, 1000);
  REQUIRE(n.ok());
  REQUIRE(*n == 1);
  CHECK(events[0].data.u64 == 43);
  // Pausing what is not in the set is an error, and adds nothing.
  Pipe other = Pipe::Make();
  CHECK_FALSE(loop->Pause(other.read_end.get(), 44).ok());
  REQUIRE(::write(other.write_end.get(), "y", 1) == 1);
  n = loop->Wait(events, 4, 20);
  REQUIRE(n.ok());
  REQUIRE(*n == 1);
  CHECK(events[0].data.u64 == 43);
}

TEST_CASE("event loop: a nested set without a wake reports as one token of the outer loop",
          "[base]") {
  absl::StatusOr<EventLoop> outer = EventLoop::Create();
  absl::StatusOr<EventLoop> inner = EventLoop::Create(EventLoop::Wakeable::kNo);
  REQUIRE(outer.ok());
  REQUIRE(inner.ok());
  REQUIRE(outer->WatchLoop(*inner, 5).ok());
  Pipe p = Pipe::Make();
  int target = 0;
  REQUIRE(inner->Watch(p.read_end.get(), EPOLLIN, EventLoop::TokenOf(&target)).ok());
  epoll_event events[4];
  inner->Wake();  // no wake descriptor: nothing happens
  absl::StatusOr<int> n = outer->Wait(events, 4, 20);
  REQUIRE(n.ok());
  CHECK(*n == 0);
  REQUIRE(::write(p.write_end.get(), "x", 1) == 1);
  n = outer->Wait(events, 4, 1000);
  REQUIRE(n.ok());
  REQUIRE(*n == 1);
  CHECK(events[0].data.u64 == 5);
  n = inner->Wait(events, 4, 0);
  REQUIRE(n.ok());
  REQUIRE(*n == 1);
  CHECK(EventLoop::PointerOf<int>(events[0].data.u64) == &target);
  char byte;
  REQUIRE(::read(p.read_end.get(), &byte, 1) == 1);
  n = outer->Wait(events, 4, 20);  // drained: the outer loop is quiet again
  REQUIRE(n.ok());
  CHECK(*n == 0);
  // The outer loop's wake still works, and is no event.
  outer->Wake();
  bool woken = false;
  n = outer->Wait(events, 4, 1000, &woken);
  REQUIRE(n.ok());
  CHECK(*n == 0);
  CHECK(woken);
}

UniqueFd Dial(uint16_t port) {
  absl::StatusOr<UniqueFd> c =
      ConnectTcp(HostPort{"127.0.0.1", port}, absl::Now() + absl::Seconds(5));
  REQUIRE(c.ok());
  return *std::move(c);
}

struct Waiting {
  UniqueFd fd;
  std::string peer;
};

// Lowers the descriptor limit to what is open now and fills what is left,
// restoring both when it goes.
class DescriptorsExhausted {
 public:
  DescriptorsExhausted() {
    REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved_) == 0);
    rlimit low = saved_;
    low.rlim_cur = std::min<rlim_t>(saved_.rlim_cur, 256);
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
    for (int i = 0; i < 512; ++i) {
      const int fd = ::dup(0);
      if (fd < 0) break;
      held_.emplace_back(fd);
    }
  }
  ~DescriptorsExhausted() {
    held_.clear();
    ::setrlimit(RLIMIT_NOFILE, &saved_);
  }

 private:
  rlimit saved_{};
  std::vector<UniqueFd> held_;
};

TEST_CASE("event loop: accept-and-admit ends its pass saying the listener is out of descriptors",
          "[base]") {
  absl::StatusOr<UniqueFd> listener = ListenTcp("127.0.0.1", 0);
  REQUIRE(listener.ok());
  const absl::StatusOr<uint16_t> port = LocalPort(listener->get());
  REQUIRE(port.ok());
  absl::StatusOr<Acceptor> acceptor = Acceptor::Create(*std::move(listener));
  REQUIRE(acceptor.ok());
  const UniqueFd first = Dial(*port);
  RateLimiter limit(10, absl::Seconds(10));
  std::list<Waiting> waiting;
  auto pass = [&] {
    return AcceptAndAdmit(
        *acceptor, limit, "test", waiting, [](const Waiting&) { return true; },
        [](const Waiting& w) -> const std::string& { return w.peer; }, AdmissionCaps{8, 8},
        [](Waiting&, const std::string&) {},
        [&](Acceptor::Accepted a) {
          waiting.push_back({std::move(a.fd), std::move(a.peer)});
        });
  };
  {
    DescriptorsExhausted exhausted;
    // The client's connection is closed unserved; the acceptor backs off.
    Acceptor::Outcome ended = Acceptor::Outcome::kNone;
    for (int i = 0; i < 200 && ended == Acceptor::Outcome::kNone; ++i) {
      ended = pass();
      if (ended == Acceptor::Outcome::kNone) absl::SleepFor(absl::Milliseconds(5));
    }
    CHECK(ended == Acceptor::Outcome::kExhausted);
    CHECK(waiting.empty());
    CHECK(acceptor->paused_until() > absl::Now());
  }
  // With descriptors again a new client is admitted and the pass ends with
  // nothing more waiting.
  const UniqueFd second = Dial(*port);
  Acceptor::Outcome ended = Acceptor::Outcome::kExhausted;
  for (int i = 0; i < 200 && waiting.empty(); ++i) {
    ended = pass();
    if (waiting.empty()) absl::SleepFor(absl::Milliseconds(5));
  }
  CHECK(waiting.size() == 1);
  CHECK(ended == Acceptor::Outcome::kNone);
}

}  // namespace
}  // namespace stepmesh::base
