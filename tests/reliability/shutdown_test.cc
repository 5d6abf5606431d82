// Shutdown in any order ends cleanly: no hang, no leaked descriptor or thread,
// no error storm.

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <functional>
#include <future>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "src/compose/transports.h"
#include "src/core/mesh.h"
#include "tests/reliability/harness.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"
#include "tests/support/stderr_capture.h"

namespace stepmesh::testing {
namespace {

int Lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

HarnessConfig Config(int workers, int servers) {
  HarnessConfig c = MeshConfig("tcp", workers, servers, absl::Seconds(3));
  c.options.heartbeat_interval = absl::Milliseconds(100);
  return c;
}

TEST_CASE("shutdown: a server blocked in GetBatch returns UNAVAILABLE once every worker left",
          "[shutdown]") {
  MeshOptions o;
  o.transport = "tcp";
  o.timeout = absl::Seconds(5);
  auto mesh = LoopbackMesh::Start(o, compose::CreateTransport);
  REQUIRE_OK(mesh);
  AFTensorServer& server = (*mesh)->server(0);
  std::atomic<bool> calling{false};
  auto blocked = std::async(std::launch::async, [&] {
    calling = true;
    return server.GetBatch(absl::Seconds(60)).status();
  });
  // The premise: the server is inside GetBatch and stays there (no batch, no
  // early return) before the worker leaves. Waited for, not assumed.
  const absl::Time entered_by = absl::Now() + absl::Seconds(10);
  while (!calling && absl::Now() < entered_by) std::this_thread::yield();
  REQUIRE(calling);
  REQUIRE(blocked.wait_for(std::chrono::milliseconds(200)) == std::future_status::timeout);
  const absl::Time left = absl::Now();
  REQUIRE_OK((*mesh)->worker(0).Shutdown());
  REQUIRE(blocked.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  const absl::Status s = blocked.get();
  INFO(s.ToString());
  CHECK(absl::IsUnavailable(s));
  CHECK(absl::Now() - left < absl::Seconds(3));
  CHECK_OK(server.Shutdown());
}

// Runs `body`, which builds a mesh and ends it, with stderr captured: a line
// or two per participant (12 at most), not a storm. Afterwards the process
// has the file descriptors and stepmesh threads it had before.
void QuietAndLeakFree(const std::function<void()>& body) {
  const int fds = OpenFdCount();
  const int threads = ThreadCount();
  {
    StderrCapture capture("shutdown");
    body();
    const std::string log = capture.Finish();
    INFO(log);
    CHECK(Lines(log) <= 12);
  }
  CHECK(OpenFdCount() == fds);
  const int left = ThreadCountSettled(threads, absl::Seconds(2));
  INFO("stepmesh threads now: " << absl::StrJoin(ThreadNames(), ", "));
  CHECK(left == threads);
}

TEST_CASE("shutdown: workers first", "[shutdown]") {
  QuietAndLeakFree([] {
    Harness mesh(Config(2, 2), compose::CreateTransport);
    REQUIRE(mesh.status().ok());
    auto h0 = mesh.Start(0, 0, 1);
    auto h1 = mesh.Start(1, 0, 2);
    REQUIRE(mesh.Finish(0, 0, *h0, 1, absl::Seconds(5)).ok());
    REQUIRE(mesh.Finish(1, 0, *h1, 2, absl::Seconds(5)).ok());
    const absl::Time start = absl::Now();
    mesh.StopWorker(0);
    mesh.StopWorker(1);
    CHECK(absl::IsUnavailable(mesh.server_exit(0)));  // loops end: every worker gone
    CHECK(absl::IsUnavailable(mesh.server_exit(1)));
    CHECK(absl::Now() - start < absl::Seconds(3));
    CHECK(mesh.server_errors().empty());
  });
}

TEST_CASE("shutdown: servers first", "[shutdown]") {
  QuietAndLeakFree([] {
    Harness mesh(Config(1, 2), compose::CreateTransport);
    REQUIRE(mesh.status().ok());
    REQUIRE(mesh.RoundTrip(0, 0, 1).ok());
    const absl::Time start = absl::Now();
    mesh.StopServer(1);
    // The worker learns at once (goodbye / closed connection), not at a deadline.
    absl::Status s;
    for (int i = 0; i < 100; ++i) {
      s = mesh.RoundTrip(0, 0, 2, absl::Seconds(5));
      if (absl::IsUnavailable(s)) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    INFO(s.ToString());
    CHECK(absl::IsUnavailable(s));
    CHECK(absl::Now() - start < absl::Seconds(3));
    CHECK(mesh.RoundTrip(0, 1, 3, absl::Seconds(5), {0}).ok());
    mesh.StopServer(0);
    CHECK(absl::IsUnavailable(mesh.RoundTrip(0, 1, 4, absl::Seconds(5), {0})));
  });
}

TEST_CASE("shutdown: scheduler first never hangs the participants", "[shutdown]") {
  QuietAndLeakFree([] {
    absl::Time start;
    {
      Harness mesh(Config(1, 1), compose::CreateTransport);
      REQUIRE(mesh.status().ok());
      REQUIRE(mesh.RoundTrip(0, 0, 1).ok());
      mesh.StopScheduler();
      // The data plane does not depend on the scheduler.
      CHECK(mesh.RoundTrip(0, 0, 2).ok());
      absl::SleepFor(absl::Milliseconds(200));
      const absl::Time barrier_start = absl::Now();
      const absl::Status barrier = mesh.worker(0).Barrier();
      INFO(barrier.ToString());
      CHECK(absl::IsUnavailable(barrier));
      CHECK(absl::Now() - barrier_start < absl::Seconds(1));
      start = absl::Now();
    }
    CHECK(absl::Now() - start < absl::Seconds(3));  // participants' teardown
  });
}

}  // namespace
}  // namespace stepmesh::testing
