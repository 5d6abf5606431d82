// The one thread every rendezvous runs its peer handlers on
// (src/core/peer_event_thread.h): order, and what Stop() does to pending work.

#include "src/core/peer_event_thread.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "src/base/sync.h"

namespace stepmesh::core {
namespace {

TEST_CASE("peer events: posted work runs in order, one at a time", "[peer_events]") {
  PeerEventThread events;
  events.Start();
  std::mutex mu;
  std::vector<int> ran;
  std::atomic<int> running{0}, overlapped{0};
  base::Notification done;
  for (int i = 0; i < 100; ++i) {
    events.Post([&, i] {
      if (running.fetch_add(1) != 0) overlapped.fetch_add(1);
      {
        std::lock_guard<std::mutex> lock(mu);
        ran.push_back(i);
      }
      running.fetch_sub(1);
      if (i == 99) done.Notify();
    });
  }
  REQUIRE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  events.Stop();
  CHECK(overlapped.load() == 0);
  std::lock_guard<std::mutex> lock(mu);
  REQUIRE(ran.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(ran[i] == i);
}

TEST_CASE("peer events: Stop drops what is still queued and what is posted after",
          "[peer_events]") {
  PeerEventThread events;
  events.Start();
  base::Notification entered, release;
  std::atomic<int> later{0};
  events.Post([&] {
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(10));
  });
  for (int i = 0; i < 5; ++i) events.Post([&] { later.fetch_add(1); });
  REQUIRE(entered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  REQUIRE(events.queued() == 5);
  // Stop while the first runs: it waits for that one, the five queued are dropped.
  std::thread stopper([&] { events.Stop(); });
  const absl::Time cleared_by = absl::Now() + absl::Seconds(10);
  while (events.queued() != 0 && absl::Now() < cleared_by) absl::SleepFor(absl::Milliseconds(1));
  CHECK(events.queued() == 0);
  release.Notify();
  stopper.join();
  events.Post([&] { later.fetch_add(1); });
  events.Stop();  // idempotent
  CHECK(later.load() == 0);
}

TEST_CASE("peer events: a thread never started stops at once", "[peer_events]") {
  PeerEventThread events;
  events.Post([] {});
  events.Stop();
  SUCCEED();
}

}  // namespace
}  // namespace stepmesh::core
