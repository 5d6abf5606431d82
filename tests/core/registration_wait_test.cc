// An integrator's first program: no barrier anywhere. Workers push as soon as
// their mesh is up; servers register their tensors whenever their application
// gets to it. A push that arrives first waits for the registration (bounded by
// MeshOptions::timeout), and one whose key is never registered fails NOT_FOUND
// naming the key and the server.

#include <catch2/catch.hpp>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/compose/transports.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

constexpr int kWorkers = 2;
constexpr int kServers = 2;
constexpr int64_t kRows = 128;
constexpr int64_t kCols = 7168;
constexpr size_t kElems = kRows * kCols;  // bf16 elements of one push
constexpr Key kPushKey = 1;
constexpr Key kReplyKey = 2;

uint16_t PushValue(int round, int w, size_t i) {
  return static_cast<uint16_t>(i * 31 + round * 7 + w * 1009);
}
uint16_t ReplyValue(uint16_t pushed, int s) { return static_cast<uint16_t>(pushed ^ (0x5a5a + s)); }

std::unique_ptr<testing::LoopbackMesh> Mesh(absl::Duration timeout) {
  MeshOptions o;
  o.transport = "tcp";
  o.timeout = timeout;
  o.num_workers = kWorkers;
  o.num_servers = kServers;
  absl::StatusOr<std::unique_ptr<testing::LoopbackMesh>> mesh =
      testing::LoopbackMesh::Start(o, compose::CreateTransport);
  REQUIRE_OK(mesh);
  return *std::move(mesh);
}

TEST_CASE("no barrier: pushes before the servers register wait for the registration",
          "[mesh][registration]") {
  constexpr int kRounds = 20;
  std::vector<std::vector<uint16_t>> push(kWorkers, std::vector<uint16_t>(kElems));
  std::vector<std::vector<std::vector<uint16_t>>> pull(
      kWorkers, std::vector<std::vector<uint16_t>>(kServers, std::vector<uint16_t>(kElems)));
  std::vector<std::vector<uint16_t>> recv(kServers, std::vector<uint16_t>(kWorkers * kElems));
  std::vector<std::vector<uint16_t>> reply(kServers, std::vector<uint16_t>(kWorkers * kElems));
  auto mesh = Mesh(absl::Seconds(10));  // after the tensors: registered memory outlives the mesh

  std::vector<std::thread> servers;
  std::vector<absl::Status> server_status(kServers);
  for (int s = 0; s < kServers; ++s) {
    servers.emplace_back([&, s] {
      // The application is slow to register: the workers' pushes are already on the way.
      absl::SleepFor(absl::Milliseconds(300 + 200 * s));
      AFTensorServer& server = mesh->server(s);
      const Shape shape{kWorkers * kRows, kCols};
      absl::Status st =
          server.RegisterRecvTensor(kPushKey, {recv[s].data(), DType::kBFloat16, shape});
      if (st.ok())
        st = server.RegisterReplyTensor(kReplyKey, {reply[s].data(), DType::kBFloat16, shape});
      for (int round = 0; st.ok() && round < kRounds; ++round) {
        absl::StatusOr<Batch> batch = server.GetBatch(absl::Seconds(10));
        if (!batch.ok()) {
          st = batch.status();
          break;
        }
        for (size_t i = 0; i < recv[s].size(); ++i) reply[s][i] = ReplyValue(recv[s][i], s);
        std::vector<Reply> replies;
        for (int w : batch->workers) replies.push_back(Reply{w});
        st = server.Respond(*batch, replies);
      }
      server_status[s] = st;
    });
  }
  absl::Status worker_status[kWorkers];
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      AFTensorWorker& worker = mesh->worker(w);
      const Shape shape{kRows, kCols};
      absl::Status st =
          worker.RegisterPushTensor(kPushKey, {push[w].data(), DType::kBFloat16, shape});
      for (int s = 0; st.ok() && s < kServers; ++s) {
        st = worker.RegisterPullTensor(kReplyKey, s, {pull[w][s].data(), DType::kBFloat16, shape});
      }
      const Push p{kPushKey};
      const Pull q[kServers] = {{kReplyKey, 0}, {kReplyKey, 1}};
      for (int round = 0; st.ok() && round < kRounds; ++round) {
        for (size_t i = 0; i < kElems; ++i) push[w][i] = PushValue(round, w, i);
        absl::StatusOr<RequestHandle> h = worker.PushPull({&p, 1}, {q, kServers});
        if (!h.ok()) {
          st = h.status();
          break;
        }
        st = worker.Wait(*h, absl::Seconds(10));
        for (int s = 0; st.ok() && s < kServers; ++s) {
          for (size_t i = 0; i < kElems; ++i) {
            if (pull[w][s][i] != ReplyValue(PushValue(round, w, i), s)) {
              st = absl::DataLossError(
                  absl::StrCat("worker ", w, " round ", round, " server ", s, " element ", i));
              break;
            }
          }
        }
      }
      worker_status[w] = st;
    });
  }
  for (std::thread& t : workers) t.join();
  for (std::thread& t : servers) t.join();
  for (int w = 0; w < kWorkers; ++w) CHECK_OK(worker_status[w]);
  for (int s = 0; s < kServers; ++s) CHECK_OK(server_status[s]);
}

TEST_CASE("a push to a key never registered fails NOT_FOUND naming key and server",
          "[mesh][registration]") {
  std::vector<uint8_t> push(64, 1), pull(64);
  auto mesh = Mesh(absl::Milliseconds(500));
  REQUIRE_OK(mesh->worker(0).RegisterPushTensor(7, BytesView(push.data(), 64)));
  const int only[1] = {0};
  const Push to0{7, kWholeTensor, {only, 1}};
  absl::StatusOr<RequestHandle> h = mesh->worker(0).PushPull({&to0, 1}, {});
  REQUIRE_OK(h);
  const absl::Time start = absl::Now();
  absl::Status st = mesh->worker(0).Wait(*h, absl::Seconds(5));
  INFO(st.ToString());
  CHECK(st.code() == absl::StatusCode::kNotFound);
  CHECK(absl::StrContains(st.message(), "key 7"));
  CHECK(absl::StrContains(st.message(), "server 0"));
  CHECK(absl::Now() - start < absl::Seconds(4));
}

}  // namespace
}  // namespace stepmesh
