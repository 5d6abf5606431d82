// Peer liveness across processes: a stopped FFN process is declared lost by the
// scheduler's heartbeat and workers see UNAVAILABLE within the timeout; a
// restarted FFN process rejoins and traffic resumes.

#include <signal.h>

#include <catch2/catch.hpp>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "stepmesh/scheduler.h"
#include "stepmesh/worker.h"
#include "tests/reliability/harness.h"
#include "tests/support/child_process.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"

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

// A scheduler in this process (TCP, 100 ms heartbeats) and the command lines of
// stepmesh_reliability_node processes that join it with the same options.
struct ProcessMesh {
  ProcessMesh(int workers, int servers, absl::Duration timeout) {
    options.transport = "tcp";
    options.num_workers = workers;
    options.num_servers = servers;
    options.timeout = timeout;
    options.heartbeat_interval = absl::Milliseconds(100);
    auto started = StartLoopbackScheduler(options);
    REQUIRE_OK(started);
    scheduler = *std::move(started);
  }
  // `rounds`: a worker's round trips before it leaves (0: until killed).
  std::vector<std::string> NodeArgs(const char* role, int rank, int rounds = 0) const {
    return {STEPMESH_RELIABILITY_NODE_PATH,
            "--role",
            role,
            "--scheduler",
            options.scheduler,
            "--rank",
            std::to_string(rank),
            "--workers",
            std::to_string(options.num_workers),
            "--servers",
            std::to_string(options.num_servers),
            "--keys",
            "1",
            "--bytes",
            std::to_string(kBytes),
            "--timeout-ms",
            std::to_string(absl::ToInt64Milliseconds(options.timeout)),
            "--heartbeat-ms",
            std::to_string(absl::ToInt64Milliseconds(options.heartbeat_interval)),
            "--rounds",
            std::to_string(rounds)};
  }

  // This process as worker 0 of the mesh.
  std::unique_ptr<AFTensorWorker> CreateWorker0() const {
    MeshOptions o = options;
    o.role = Role::kWorker;
    o.rank = 0;
    auto created = AFTensorWorker::Create(o);
    INFO(created.status().ToString());
    REQUIRE(created.ok());
    return *std::move(created);
  }
  MeshOptions options;
  std::unique_ptr<Scheduler> scheduler;
};

// Round trips until one succeeds (peers register or reconnect right after
// joining), for at most 15 s; the last status.
absl::Status Eventually(ProcessWorker& pw, uint8_t fill, std::vector<int> servers) {
  const absl::Time until = absl::Now() + absl::Seconds(15);
  absl::Status s;
  do {
    s = pw.RoundTrip(fill, servers, absl::Seconds(2));
    if (s.ok()) return s;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < until);
  return s;
}

TEST_CASE("liveness: a stopped server is declared lost in time, a restarted one rejoins",
          "[liveness][process]") {
  ProcessMesh mesh(/*workers=*/1, /*servers=*/2, absl::Seconds(2));
  auto args = [&](int rank) { return mesh.NodeArgs("server", rank); };
  ChildProcess server0 = *ChildProcess::Spawn(args(0));
  auto server1 = std::make_unique<ChildProcess>(*ChildProcess::Spawn(args(1)));
  std::unique_ptr<AFTensorWorker> created = mesh.CreateWorker0();
  ProcessWorker pw(*created, 2);

  // The servers register right after joining: retry until they have.
  auto eventually = [&](uint8_t fill, std::vector<int> servers) {
    return Eventually(pw, fill, std::move(servers));
  };
  {
    const absl::Status s = eventually(1, {0, 1});
    REQUIRE_OK(s);
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
  CHECK(detected < mesh.options.timeout + absl::Seconds(2));
  CHECK(absl::IsUnavailable(pw.Start(3, {1}).status()));  // fails fast now
  CHECK(pw.RoundTrip(4, {0}, absl::Seconds(5)).ok());     // the other server is fine

  // Restart: a new process takes rank 1 again.
  server1.reset();  // SIGKILL + reap
  server1 = std::make_unique<ChildProcess>(*ChildProcess::Spawn(args(1)));
  {
    const absl::Status s = eventually(5, {0, 1});
    REQUIRE_OK(s);
  }
  for (int i = 0; i < 20; ++i) {
    REQUIRE(pw.RoundTrip(static_cast<uint8_t>(10 + i), {0, 1}, absl::Seconds(5)).ok());
  }

  // Orderly end: the servers see every worker gone and exit 0.
  REQUIRE(created->Shutdown().ok());
  auto code0 = server0.Wait(absl::Seconds(10));
  auto code1 = server1->Wait(absl::Seconds(10));
  REQUIRE(code0.ok());
  REQUIRE(code1.ok());
  CHECK(*code0 == 0);
  CHECK(*code1 == 0);
}

TEST_CASE("liveness: a killed worker leaves the batches, a restarted one rejoins them",
          "[liveness][process]") {
  // One FFN process; attention rank 0 here, rank 1 a child process that is
  // killed mid-traffic and started again. Every batch holds every live worker
  // (kAllWorkers), so rank 0's round trips only complete while the server
  // counts rank 1 correctly: present, then dropped, then back.
  ProcessMesh mesh(/*workers=*/2, /*servers=*/1, absl::Seconds(3));
  auto args = [&](const char* role, int rank, int rounds) {
    return mesh.NodeArgs(role, rank, rounds);
  };
  ChildProcess server = *ChildProcess::Spawn(args("server", 0, 0));
  auto worker1 = std::make_unique<ChildProcess>(*ChildProcess::Spawn(args("worker", 1, 0)));
  std::unique_ptr<AFTensorWorker> created = mesh.CreateWorker0();
  ProcessWorker pw(*created, 1);
  auto eventually = [&](uint8_t fill) { return Eventually(pw, fill, {0}); };
  REQUIRE(eventually(1).ok());
  for (int i = 0; i < 10; ++i) {
    REQUIRE(pw.RoundTrip(static_cast<uint8_t>(2 + i), {0}, absl::Seconds(5)).ok());
  }

  // Killed: its half-finished pushes go, and batches stop waiting for it.
  worker1.reset();  // SIGKILL + reap
  REQUIRE(eventually(20).ok());
  for (int i = 0; i < 10; ++i) {
    REQUIRE(pw.RoundTrip(static_cast<uint8_t>(21 + i), {0}, absl::Seconds(5)).ok());
  }

  // Restarted under rank 1: checked round trips of its own, while rank 0
  // keeps going. The scheduler may still be seeing the old process die:
  // the new one then exits 3 and is started again (bounded).
  auto run_new_worker1 = [&](int rounds) {
    std::optional<int> exit_code;
    int data_errors = 0;
    for (int attempt = 0; attempt < 20; ++attempt) {
      worker1 = std::make_unique<ChildProcess>(*ChildProcess::Spawn(args("worker", 1, rounds)));
      const absl::Time until = absl::Now() + absl::Seconds(30);
      uint8_t fill = 40;
      while (!(exit_code = worker1->TryWait()) && absl::Now() < until) {
        // Rank 0's rounds complete only in batches shared with the new rank 1
        // (or alone while it is not yet counted); failures while it connects
        // are allowed, wrong bytes are not.
        data_errors += absl::IsDataLoss(pw.RoundTrip(fill++, {0}, absl::Seconds(2)));
      }
      if (exit_code != 3) break;
      absl::SleepFor(absl::Milliseconds(200));
    }
    CHECK(data_errors == 0);
    return exit_code;
  };
  std::optional<int> exit_code = run_new_worker1(30);
  REQUIRE(exit_code.has_value());
  CHECK(*exit_code == 0);  // its 30 round trips all came back right
  // Gone again, orderly this time: rank 0 carries on alone.
  REQUIRE(eventually(90).ok());
  // A rank that left in order may be taken by a new process too (a rolling restart).
  exit_code = run_new_worker1(10);
  REQUIRE(exit_code.has_value());
  CHECK(*exit_code == 0);
  REQUIRE(eventually(100).ok());

  REQUIRE(created->Shutdown().ok());
  auto code = server.Wait(absl::Seconds(10));
  REQUIRE(code.ok());
  CHECK(*code == 0);
}

}  // namespace
}  // namespace stepmesh::testing
