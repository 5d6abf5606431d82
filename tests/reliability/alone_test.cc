// One participant's mistake or death fails that participant alone, on every
// row of the transport table: a push to a key a server has not registered is
// parked aside (the server's receive thread moves on), a pull of a key with no
// reply tensor fails that worker's request alone, and a participant lost
// before the mesh formed is taken off the roster-to-be instead of taking the
// others down. A parked push delivered once its key is registered is
// tests/core/registration_wait_test.cc. The process-level forms of the same
// cases are hostile_alone_* (tests/hostile/hostile_test.py).

#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/net.h"
#include "src/core/control_message.h"
#include "src/core/protocol.h"
#include "stepmesh/status.h"
#include "tests/reliability/harness.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"
#include "tests/support/transport_table.h"

namespace stepmesh::testing {
namespace {

constexpr size_t kBytes = 4096;
constexpr absl::Duration kTimeout = absl::Seconds(2);  // parked pushes wait half of it
constexpr Key kUnregisteredPush = 900;
constexpr Key kUnregisteredPull = 901;

// Both workers' round trip `round` on micro-batch 0; each worker's time.
absl::Status BothRound(Harness& mesh, int round, absl::Duration* slowest) {
  const uint8_t f0 = static_cast<uint8_t>(round * 3), f1 = static_cast<uint8_t>(round * 3 + 1);
  const absl::Time start = absl::Now();
  absl::StatusOr<RequestHandle> h0 = mesh.Start(0, 0, f0);
  absl::StatusOr<RequestHandle> h1 = mesh.Start(1, 0, f1);
  if (!h0.ok()) return h0.status();
  if (!h1.ok()) return h1.status();
  absl::Status s0 = mesh.Finish(0, 0, *h0, f0, absl::Seconds(5));
  absl::Status s1 = mesh.Finish(1, 0, *h1, f1, absl::Seconds(5));
  *slowest = std::max(*slowest, absl::Now() - start);
  return s0.ok() ? s1 : s0;
}

// body(mesh, row) over every transport of the table, each in its own section: two
// workers, two servers, kTimeout, started.
template <typename Body>
void OnEveryTransport(Body body) {
  for (const TransportCase& row : TransportTable()) {
    DYNAMIC_SECTION(row.name) {
      Harness mesh(MeshConfig(row.transport, 2, 2, kTimeout), row.make().factory);
      REQUIRE_OK(mesh.status());
      body(mesh, row);
    }
  }
}

TEST_CASE("alone: a push to a key no server registered is parked, not waited for",
          "[alone][registration]") {
  OnEveryTransport([&](Harness& mesh, const TransportCase& row) {
    std::vector<uint8_t> bad(kBytes, 0x5a);
    REQUIRE_OK(
        mesh.worker(1).RegisterPushTensor(kUnregisteredPush, BytesView(bad.data(), bad.size())));
    absl::Duration warm;
    REQUIRE_OK(BothRound(mesh, 0, &warm));
    // Worker 1's mistake: a request pushing a key the servers never register.
    const Push p{kUnregisteredPush};
    absl::StatusOr<RequestHandle> wrong = mesh.worker(1).PushPull({&p, 1}, {});
    REQUIRE_OK(wrong);
    absl::Duration slowest;
    for (int round = 1; round <= 20; ++round) REQUIRE_OK(BothRound(mesh, round, &slowest));
    INFO("slowest round trip after the wrong push: " << absl::FormatDuration(slowest));
    if (row.transport == "tcp") {
      // The servers' receive threads never waited: no round trip came near the
      // registration wait (before: the first one took the whole timeout, 2 s).
      CHECK(slowest < kTimeout / 4);
    }
    // Over RDMA the push never leaves worker 1: it waits in worker 1's outbox
    // to that server for the key's advertisement (the send thread does not
    // wait; worker 1's later frames to that server wait behind it), and is
    // refused after the timeout naming the key (docs/rdma.md).
    const absl::Status refused = mesh.worker(1).Wait(*wrong, kTimeout * 3);
    INFO(refused.ToString());
    if (row.transport == "tcp") {
      CHECK(absl::IsNotFound(refused));
      CHECK(absl::StrContains(refused.message(), "push key 900 of worker 1 is not registered"));
      CHECK(absl::StrContains(refused.message(), "waited"));
    } else {
      CHECK(absl::IsDeadlineExceeded(refused));
      CHECK(absl::StrContains(refused.message(), "key 900"));
    }
    // Everyone goes on as before.
    for (int round = 21; round <= 25; ++round) REQUIRE_OK(BothRound(mesh, round, &slowest));
    CHECK(mesh.server_errors().empty());
  });
}

TEST_CASE("alone: a pull of a key with no reply tensor fails that worker's request alone",
          "[alone]") {
  OnEveryTransport([&](Harness& mesh, const TransportCase& row) {
    std::vector<std::vector<uint8_t>> wrong_pulls(2, std::vector<uint8_t>(kBytes));
    for (int s = 0; s < 2; ++s) {
      REQUIRE_OK(mesh.worker(1).RegisterPullTensor(kUnregisteredPull, s,
                                                   BytesView(wrong_pulls[s].data(), kBytes)));
    }
    absl::Duration slowest;
    REQUIRE_OK(BothRound(mesh, 0, &slowest));
    // Worker 0 as always; worker 1 pulls a key the servers have no reply tensor for.
    const uint8_t f0 = 0x31;
    absl::StatusOr<RequestHandle> h0 = mesh.Start(0, 0, f0);
    REQUIRE_OK(h0);
    const Push p{RelPushKey(0)};
    const Pull q[2] = {{kUnregisteredPull, 0}, {kUnregisteredPull, 1}};
    absl::StatusOr<RequestHandle> h1 = mesh.worker(1).PushPull({&p, 1}, {q, 2});
    REQUIRE_OK(h1);
    // Worker 0's batch forms without worker 1 once its request is refused
    // (the registration wait, half the timeout), every byte its own.
    REQUIRE_OK(mesh.Finish(0, 0, *h0, f0, kTimeout * 2));
    const absl::Status refused = mesh.worker(1).Wait(*h1, kTimeout * 2);
    INFO(refused.ToString());
    CHECK(absl::IsNotFound(refused));
    CHECK(absl::StrContains(refused.message(), "worker 1 pulls key 901"));
    CHECK(absl::StrContains(refused.message(), "no reply tensor on server"));
    // Both go on in step.
    for (int round = 1; round <= 5; ++round) REQUIRE_OK(BothRound(mesh, round, &slowest));
    CHECK(mesh.server_errors().empty());
  });
}

// A participant's control connection that joins as `role` `rank` and then dies
// (closes before any roster): what a process killed during start-up leaves.
absl::Status JoinAndDie(const MeshOptions& options, Role role, int rank) {
  STEPMESH_ASSIGN_OR_RETURN(base::HostPort at, base::ParseHostPort(options.scheduler));
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd fd, base::ConnectTcp(at, deadline));
  core::ControlMessage join;
  join.type = core::ControlType::kJoin;
  join.role = static_cast<uint8_t>(role);
  join.rank = rank;
  join.text = "127.0.0.1:1";  // nobody listens there: a roster listing it fails to connect
  join.num_workers = static_cast<uint32_t>(options.num_workers);
  join.num_servers = static_cast<uint32_t>(options.num_servers);
  join.mesh_id = options.mesh_id;
  STEPMESH_RETURN_IF_ERROR(core::SendControl(fd.get(), join, deadline));
  // Long enough for the scheduler's loop (50 ms ticks) to take the join in.
  absl::SleepFor(absl::Milliseconds(300));
  return absl::OkStatus();  // the descriptor closes: the "process" died
}

TEST_CASE("alone: a participant lost before the mesh formed is taken off the roster",
          "[alone][rendezvous]") {
  for (const TransportCase& row : TransportTable()) {
    DYNAMIC_SECTION(row.name) {
      TransportInstance instance = row.make();
      MeshOptions base = OptionsFor(row);
      base.num_workers = 1;
      base.num_servers = 2;
      base.timeout = absl::Seconds(10);
      absl::StatusOr<std::unique_ptr<LoopbackMesh>> started =
          LoopbackMesh::StartEmpty(base, instance.factory);
      REQUIRE_OK(started);
      LoopbackMesh& mesh = **started;
      // Worker 0 joins and waits for the roster.
      absl::Status worker_created;
      std::thread worker([&] { worker_created = mesh.AddWorker(0); });
      absl::SleepFor(absl::Milliseconds(200));
      // Server 0's first process joins and dies before server 1 came.
      REQUIRE_OK(JoinAndDie(mesh.options(Role::kServer, 0), Role::kServer, 0));
      // Its restart and server 1 join; the mesh forms without the dead one.
      absl::Status created[2];
      std::thread servers[2];
      for (int s = 0; s < 2; ++s)
        servers[s] = std::thread([&, s] { created[s] = mesh.AddServer(s); });
      for (std::thread& t : servers) t.join();
      worker.join();
      REQUIRE_OK(worker_created);
      REQUIRE_OK(created[0]);
      REQUIRE_OK(created[1]);
      // And it carries data, every byte checked.
      std::vector<uint8_t> push(kBytes),
          pulls[2] = {std::vector<uint8_t>(kBytes), std::vector<uint8_t>(kBytes)};
      std::vector<uint8_t> recv[2] = {std::vector<uint8_t>(kBytes), std::vector<uint8_t>(kBytes)};
      std::vector<uint8_t> reply[2] = {std::vector<uint8_t>(kBytes), std::vector<uint8_t>(kBytes)};
      for (int s = 0; s < 2; ++s) {
        REQUIRE_OK(mesh.server(s).RegisterRecvTensor(1, BytesView(recv[s].data(), kBytes)));
        REQUIRE_OK(mesh.server(s).RegisterReplyTensor(2, BytesView(reply[s].data(), kBytes)));
        REQUIRE_OK(mesh.worker(0).RegisterPullTensor(2, s, BytesView(pulls[s].data(), kBytes)));
      }
      REQUIRE_OK(mesh.worker(0).RegisterPushTensor(1, BytesView(push.data(), kBytes)));
      for (size_t i = 0; i < kBytes; ++i) push[i] = static_cast<uint8_t>(i * 7);
      const Push p{1};
      const Pull q[2] = {{2, 0}, {2, 1}};
      absl::StatusOr<RequestHandle> h = mesh.worker(0).PushPull({&p, 1}, {q, 2});
      REQUIRE_OK(h);
      for (int s = 0; s < 2; ++s) {
        absl::StatusOr<Batch> batch = mesh.server(s).GetBatch(absl::Seconds(5));
        REQUIRE_OK(batch);
        for (size_t i = 0; i < kBytes; ++i)
          reply[s][i] = static_cast<uint8_t>(recv[s][i] ^ (s + 1));
        const Reply r{0};
        REQUIRE_OK(mesh.server(s).Respond(*batch, {&r, 1}));
      }
      REQUIRE_OK(mesh.worker(0).Wait(*h, absl::Seconds(5)));
      for (int s = 0; s < 2; ++s) {
        for (size_t i = 0; i < kBytes; ++i) {
          REQUIRE(pulls[s][i] == static_cast<uint8_t>(static_cast<uint8_t>(i * 7) ^ (s + 1)));
        }
      }
    }
  }
}

}  // namespace
}  // namespace stepmesh::testing
