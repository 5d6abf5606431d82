// Peer liveness across processes: a stopped FFN process is declared lost by the
// scheduler's heartbeat and workers see UNAVAILABLE within the timeout; a
// restarted FFN process rejoins and traffic resumes.

#include <signal.h>

#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "stepmesh/scheduler.h"
#include "stepmesh/worker.h"
#include "tests/core/child_process.h"
#include "tests/reliability/harness.h"

namespace stepmesh::testing {
namespace {

constexpr size_t kBytes = 4096;

struct ProcessWorker {
  ProcessWorker(AFTensorWorker& w, int servers) : worker(w), num_servers(servers) {
    push.assign(kBytes, 0);
    pulls.assign(servers, std::vector<uint8_t>(kBytes));
    REQUIRE(worker.RegisterPushTensor(RelPushKey(0), BytesView(push.data(), kBytes)).ok());
    for (int s = 0; s < servers; ++s) {
      REQUIRE(worker.RegisterPullTensor(RelPullKey(0), s, BytesView(pulls[s].data(), kBytes)).ok());
    }
  }
  absl::StatusOr<RequestHandle> Start(uint8_t fill, std::vector<int> servers) {
    servers_ = std::move(servers);
    for (size_t j = 0; j < kBytes; ++j) push[j] = static_cast<uint8_t>(fill + j);
    Push p{RelPushKey(0)};
    p.servers = servers_;
    std::vector<Pull> pulls_of;
    for (int s : servers_) pulls_of.push_back({RelPullKey(0), s});
    return worker.PushPull({&p, 1}, pulls_of);
  }
  absl::Status Finish(RequestHandle h, uint8_t fill, absl::Duration timeout) {
    absl::Status s = worker.Wait(h, timeout);
    if (!s.ok()) return s;
    for (int srv : servers_) {
      for (size_t j = 0; j < kBytes; ++j) {
        if (pulls[srv][j] != (static_cast<uint8_t>(fill + j) ^ ReplyMask(srv))) {
          return absl::DataLossError(absl::StrCat("server ", srv, " byte ", j));
        }
      }
    }
    return absl::OkStatus();
  }
  absl::Status RoundTrip(uint8_t fill, std::vector<int> servers, absl::Duration timeout) {
    auto h = Start(fill, std::move(servers));
    if (!h.ok()) return h.status();
    return Finish(*h, fill, timeout);
  }

  AFTensorWorker& worker;
  int num_servers;
  std::vector<uint8_t> push;
  std::vector<std::vector<uint8_t>> pulls;
  std::vector<int> servers_;
};

TEST_CASE("liveness: a stopped server is declared lost in time, a restarted one rejoins",
          "[liveness][process]") {
  MeshOptions o;
  o.transport = "tcp";
  o.num_workers = 1;
  o.num_servers = 2;
  o.timeout = absl::Seconds(2);
  o.heartbeat_interval = absl::Milliseconds(100);
  o.scheduler = "127.0.0.1:0";
  auto scheduler = Scheduler::Start(o);
  REQUIRE(scheduler.ok());
  o.scheduler = (*scheduler)->address();
  auto args = [&](int rank) {
    return std::vector<std::string>{STEPMESH_RELIABILITY_NODE_PATH, "--scheduler", o.scheduler,
                                    "--rank", std::to_string(rank), "--workers", "1",
                                    "--servers", "2", "--keys", "1", "--bytes",
                                    std::to_string(kBytes), "--timeout-ms", "2000",
                                    "--heartbeat-ms", "100"};
  };
  ChildProcess server0 = *ChildProcess::Spawn(args(0));
  auto server1 = std::make_unique<ChildProcess>(*ChildProcess::Spawn(args(1)));
  o.role = Role::kWorker;
  o.rank = 0;
  auto created = AFTensorWorker::Create(o);
  INFO(created.status().ToString());
  REQUIRE(created.ok());
  ProcessWorker pw(**created, 2);

  // The servers register right after joining: retry until they have.
  auto eventually = [&](uint8_t fill, std::vector<int> servers) {
    const absl::Time until = absl::Now() + absl::Seconds(15);
    absl::Status s;
    do {
      s = pw.RoundTrip(fill, servers, absl::Seconds(2));
      if (s.ok()) return s;
      absl::SleepFor(absl::Milliseconds(50));
    } while (absl::Now() < until);
    return s;
  };
  {
    const absl::Status s = eventually(1, {0, 1});
    INFO(s.ToString());
    REQUIRE(s.ok());
  }

  // SIGSTOP: the process is alive but silent; only the heartbeat can tell.
  REQUIRE(::kill(server1->pid(), SIGSTOP) == 0);
  const absl::Time stopped = absl::Now();
  auto h = pw.Start(2, {0, 1});
  REQUIRE(h.ok());
  const absl::Status lost = pw.Finish(*h, 2, absl::Seconds(20));
  const absl::Duration detected = absl::Now() - stopped;
  INFO(lost.ToString() << " after " << absl::FormatDuration(detected));
  CHECK(absl::IsUnavailable(lost));
  CHECK(detected < o.timeout + absl::Seconds(2));
  CHECK(absl::IsUnavailable(pw.Start(3, {1}).status()));  // fails fast now
  CHECK(pw.RoundTrip(4, {0}, absl::Seconds(5)).ok());     // the other server is fine

  // Restart: a new process takes rank 1 again.
  server1.reset();  // SIGKILL + reap
  server1 = std::make_unique<ChildProcess>(*ChildProcess::Spawn(args(1)));
  {
    const absl::Status s = eventually(5, {0, 1});
    INFO(s.ToString());
    REQUIRE(s.ok());
  }
  for (int i = 0; i < 20; ++i) {
    REQUIRE(pw.RoundTrip(static_cast<uint8_t>(10 + i), {0, 1}, absl::Seconds(5)).ok());
  }

  // Orderly end: the servers see every worker gone and exit 0.
  REQUIRE((*created)->Shutdown().ok());
  auto code0 = server0.Wait(absl::Seconds(10));
  auto code1 = server1->Wait(absl::Seconds(10));
  REQUIRE(code0.ok());
  REQUIRE(code1.ok());
  CHECK(*code0 == 0);
  CHECK(*code1 == 0);
}

}  // namespace
}  // namespace stepmesh::testing
