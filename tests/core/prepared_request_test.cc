// AFTensorWorker::Prepare / Post: a request validated once and posted many
// times. Errors at preparation name the key; a key unregistered (or
// registered again) after preparation makes the request stale, refused
// without touching the old tensor; posts deliver the same bytes PushPull
// does; different prepared requests post concurrently.

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/compose/transports.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"
#include "tests/support/conformance_suite.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

constexpr size_t kBytes = 256;

MeshOptions TcpOptions() {
  MeshOptions o;
  o.transport = "tcp";
  o.timeout = absl::Seconds(20);
  return o;
}

// The server's answer to every batch: reply = recv + key, byte by byte.
void Answer(AFTensorServer& server, std::vector<uint8_t>& recv, std::vector<uint8_t>& reply,
            Key key, int batches = 1) {
  for (int i = 0; i < batches; ++i) {
    absl::StatusOr<Batch> batch = server.GetBatch(absl::Seconds(20));
    REQUIRE_OK(batch);
    const size_t valid = batch->tensors[0].valid_bytes[0];
    for (size_t b = 0; b < kBytes; ++b) {
      reply[b] = b < valid ? static_cast<uint8_t>(recv[b] + key) : 0;
    }
    const Reply r{0};
    REQUIRE_OK(server.Respond(*batch, {&r, 1}));
  }
}

void CheckMessage(const absl::Status& s, absl::StatusCode code, const std::string& part) {
  INFO(s.ToString());
  CHECK(s.code() == code);
  CHECK(absl::StrContains(s.message(), part));
}

// One worker and one server over TCP: push key 1 and pull key 2 (from server
// 0) registered on the worker, their recv and reply tensors on the server, and
// `plan` prepared over both.
struct PreparedPair {
  PreparedPair() {
    REQUIRE_OK(worker.RegisterPushTensor(1, BytesView(push.data(), kBytes)));
    REQUIRE_OK(worker.RegisterPullTensor(2, 0, BytesView(pull.data(), kBytes)));
    REQUIRE_OK(server.RegisterRecvTensor(1, BytesView(recv.data(), kBytes)));
    REQUIRE_OK(server.RegisterReplyTensor(2, BytesView(reply.data(), kBytes)));
    plan = worker.Prepare({&p, 1}, {&q, 1});
    REQUIRE_OK(plan);
  }

  std::vector<uint8_t> push = std::vector<uint8_t>(kBytes, 1);
  std::vector<uint8_t> pull = std::vector<uint8_t>(kBytes);
  std::vector<uint8_t> recv = std::vector<uint8_t>(kBytes);
  std::vector<uint8_t> reply = std::vector<uint8_t>(kBytes);
  std::unique_ptr<testing::LoopbackMesh> mesh =
      testing::StartPair(TcpOptions(), compose::CreateTransport);
  AFTensorWorker& worker = mesh->worker(0);
  AFTensorServer& server = mesh->server(0);
  const Push p{1};
  const Pull q{2, 0};
  absl::StatusOr<PreparedRequest> plan;
};

TEST_CASE("Prepare refuses bad requests naming the key, and changes nothing",
          "[mesh][prepared][bad-input]") {
  std::vector<uint8_t> push(kBytes, 1), push2(kBytes), pull(kBytes), recv(kBytes), reply(kBytes);
  auto mesh = testing::StartPair(TcpOptions(), compose::CreateTransport);
  AFTensorWorker& worker = mesh->worker(0);
  REQUIRE_OK(worker.RegisterPushTensor(1, BytesView(push.data(), kBytes)));
  REQUIRE_OK(worker.RegisterPushTensor(3, BytesView(push2.data(), kBytes)));
  REQUIRE_OK(worker.RegisterPullTensor(2, 0, BytesView(pull.data(), kBytes)));
  REQUIRE_OK(mesh->server(0).RegisterRecvTensor(1, BytesView(recv.data(), kBytes)));
  REQUIRE_OK(mesh->server(0).RegisterReplyTensor(2, BytesView(reply.data(), kBytes)));
  using C = absl::StatusCode;
  const int other[] = {5};
  const Push p1{1}, p9{9}, big{1, kBytes + 1}, far{3, kWholeTensor, other};
  const Push repeated[] = {{1}, {3}, {1}};
  const Pull q{2, 0}, q9{9, 0}, q_far{2, 7};
  const Pull twice[] = {{2, 0}, {2, 0}};
  CheckMessage(worker.Prepare({&p9, 1}, {}).status(), C::kNotFound, "push key 9");
  CheckMessage(worker.Prepare({&p1, 1}, {&q9, 1}).status(), C::kNotFound,
               "pull key 9 from server 0");
  CheckMessage(worker.Prepare({&big, 1}, {}).status(), C::kOutOfRange, "under key 1");
  CheckMessage(worker.Prepare(repeated, {}).status(), C::kInvalidArgument, "push key 1 repeated");
  CheckMessage(worker.Prepare({&far, 1}, {}).status(), C::kInvalidArgument,
               "push of key 3 to unknown server 5");
  CheckMessage(worker.Prepare({&p1, 1}, {&q_far, 1}).status(), C::kInvalidArgument,
               "pull of key 2 from unknown server 7");
  CheckMessage(worker.Prepare({&p1, 1}, twice).status(), C::kInvalidArgument,
               "two pulls from server 0");
  CheckMessage(worker.Prepare({}, {&q, 1}).status(), C::kInvalidArgument, "at least one push");
  CheckMessage(worker.Post(PreparedRequest()).status(), C::kInvalidArgument, "empty");

  // The refusals changed nothing: a good request goes through.
  absl::StatusOr<PreparedRequest> plan = worker.Prepare({&p1, 1}, {&q, 1});
  REQUIRE_OK(plan);
  CHECK(plan->num_pushes() == 1);
  CHECK(plan->num_pulls() == 1);
  CHECK(plan->push_key(0) == 1);
  CHECK(plan->bytes(0) == kBytes);
  CheckMessage(plan->SetBytes(0, kBytes + 1), C::kOutOfRange, "key 1");
  CheckMessage(plan->SetBytes(1, 1), C::kInvalidArgument, "push index 1");
  CHECK(plan->bytes(0) == kBytes);
  absl::StatusOr<RequestHandle> h = worker.Post(*plan);
  REQUIRE_OK(h);
  // Its keys are in flight: a second post of it (or PushPull on them) waits its turn.
  CheckMessage(worker.Post(*plan).status(), C::kFailedPrecondition,
               "push key 1 is still in flight");
  Answer(mesh->server(0), recv, reply, 1);
  REQUIRE_OK(worker.Wait(*h, absl::Seconds(20)));
  CHECK(pull[0] == 2);
}

TEST_CASE_METHOD(PreparedPair,
                 "a prepared request whose key was unregistered is refused naming the key",
                 "[mesh][prepared]") {
  std::vector<uint8_t> other(kBytes, 9), pull2(kBytes);
  absl::StatusOr<RequestHandle> h = worker.Post(*plan);
  REQUIRE_OK(h);
  Answer(server, recv, reply, 1);
  REQUIRE_OK(worker.Wait(*h, absl::Seconds(20)));

  // The push key goes, and comes back over other memory: the plan is stale
  // (never the new tensor silently, never the old one).
  REQUIRE_OK(worker.Unregister(1));
  CheckMessage(worker.Post(*plan).status(), absl::StatusCode::kFailedPrecondition,
               "push key 1 was unregistered");
  REQUIRE_OK(worker.RegisterPushTensor(1, BytesView(other.data(), kBytes)));
  CheckMessage(worker.Post(*plan).status(), absl::StatusCode::kFailedPrecondition,
               "push key 1 was unregistered");
  // The same for a pull key.
  absl::StatusOr<PreparedRequest> again = worker.Prepare({&p, 1}, {&q, 1});
  REQUIRE_OK(again);
  REQUIRE_OK(worker.Unregister(2));
  CheckMessage(worker.Post(*again).status(), absl::StatusCode::kFailedPrecondition,
               "pull key 2 from server 0 was unregistered");
  REQUIRE_OK(worker.RegisterPullTensor(2, 0, BytesView(pull2.data(), kBytes)));
  CheckMessage(worker.Post(*again).status(), absl::StatusCode::kFailedPrecondition,
               "pull key 2 from server 0 was unregistered");

  // A fresh plan over the new registrations works, and the refusals left the
  // keys free (nothing in flight).
  absl::StatusOr<PreparedRequest> fresh = worker.Prepare({&p, 1}, {&q, 1});
  REQUIRE_OK(fresh);
  h = worker.Post(*fresh);
  REQUIRE_OK(h);
  Answer(server, recv, reply, 1);
  REQUIRE_OK(worker.Wait(*h, absl::Seconds(20)));
  CHECK(recv[0] == 9);
  CHECK(pull2[0] == 10);
  CHECK(pull[0] == 2);  // the old pull tensor was not written again

  // A plan belongs to its worker; after shutdown nothing posts.
  REQUIRE_OK(worker.Shutdown());
  CheckMessage(worker.Post(*fresh).status(), absl::StatusCode::kFailedPrecondition, "shut down");
  CheckMessage(worker.Prepare({&p, 1}, {&q, 1}).status(), absl::StatusCode::kFailedPrecondition,
               "shut down");
}

TEST_CASE_METHOD(PreparedPair,
                 "posting a prepared request many times sends the bytes PushPull sends",
                 "[mesh][prepared]") {
  constexpr int kRounds = 20;
  for (int i = 0; i < kRounds; ++i) {
    const size_t bytes = 1 + (i * 37) % kBytes;  // each round its own prefix
    for (size_t b = 0; b < kBytes; ++b) push[b] = static_cast<uint8_t>(b * 7 + i);
    // PushPull first, then the plan with the same byte count: same landing.
    const Push sized{1, bytes};
    absl::StatusOr<RequestHandle> h = worker.PushPull({&sized, 1}, {&q, 1});
    REQUIRE_OK(h);
    Answer(server, recv, reply, 1);
    REQUIRE_OK(worker.Wait(*h, absl::Seconds(20)));
    const std::vector<uint8_t> by_push_pull = pull;
    const std::vector<uint8_t> recv_push_pull(recv.begin(), recv.begin() + bytes);
    std::fill(pull.begin(), pull.end(), 0);
    REQUIRE_OK(plan->SetBytes(0, bytes));
    h = worker.Post(*plan);
    REQUIRE_OK(h);
    Answer(server, recv, reply, 1);
    REQUIRE_OK(worker.Wait(*h, absl::Seconds(20)));
    INFO("round " << i << ", " << bytes << " bytes");
    CHECK(std::vector<uint8_t>(recv.begin(), recv.begin() + bytes) == recv_push_pull);
    CHECK(pull == by_push_pull);
    CHECK(pull[0] == static_cast<uint8_t>(push[0] + 1));
  }
}

TEST_CASE("a prepared request posts only on the worker that prepared it", "[mesh][prepared]") {
  std::vector<uint8_t> push0(kBytes), push1(kBytes);
  MeshOptions o = TcpOptions();
  o.num_workers = 2;
  absl::StatusOr<std::unique_ptr<testing::LoopbackMesh>> mesh =
      testing::LoopbackMesh::Start(o, compose::CreateTransport);
  REQUIRE_OK(mesh);
  REQUIRE_OK((*mesh)->worker(0).RegisterPushTensor(1, BytesView(push0.data(), kBytes)));
  REQUIRE_OK((*mesh)->worker(1).RegisterPushTensor(1, BytesView(push1.data(), kBytes)));
  const Push p{1};
  absl::StatusOr<PreparedRequest> plan = (*mesh)->worker(0).Prepare({&p, 1}, {});
  REQUIRE_OK(plan);
  CheckMessage((*mesh)->worker(1).Post(*plan).status(), absl::StatusCode::kInvalidArgument,
               "another worker");
}

TEST_CASE("different prepared requests post concurrently from several threads",
          "[mesh][prepared][threads]") {
  constexpr int kThreads = 4;
  constexpr int kRounds = 50;
  std::vector<std::vector<uint8_t>> push(kThreads, std::vector<uint8_t>(kBytes));
  std::vector<std::vector<uint8_t>> pull(kThreads, std::vector<uint8_t>(kBytes));
  std::vector<std::vector<uint8_t>> recv(kThreads, std::vector<uint8_t>(kBytes));
  std::vector<std::vector<uint8_t>> reply(kThreads, std::vector<uint8_t>(kBytes));
  auto mesh = testing::StartPair(TcpOptions(), compose::CreateTransport);
  AFTensorWorker& worker = mesh->worker(0);
  AFTensorServer& server = mesh->server(0);
  std::vector<PreparedRequest> plans;
  for (int t = 0; t < kThreads; ++t) {
    const Key push_key = 10 + 2 * t, pull_key = 11 + 2 * t;
    REQUIRE_OK(worker.RegisterPushTensor(push_key, BytesView(push[t].data(), kBytes)));
    REQUIRE_OK(worker.RegisterPullTensor(pull_key, 0, BytesView(pull[t].data(), kBytes)));
    REQUIRE_OK(server.RegisterRecvTensor(push_key, BytesView(recv[t].data(), kBytes)));
    REQUIRE_OK(server.RegisterReplyTensor(pull_key, BytesView(reply[t].data(), kBytes)));
    const Push p{push_key};
    const Pull q{pull_key, 0};
    absl::StatusOr<PreparedRequest> plan = worker.Prepare({&p, 1}, {&q, 1});
    REQUIRE_OK(plan);
    plans.push_back(*std::move(plan));
  }
  std::atomic<int> failures{0};
  std::thread serve([&] {
    for (int i = 0; i < kThreads * kRounds; ++i) {
      absl::StatusOr<Batch> batch = server.GetBatch(absl::Seconds(20));
      if (!batch.ok()) {
        failures.fetch_add(1);
        return;
      }
      const int t = static_cast<int>((batch->group - 10) / 2);
      for (size_t b = 0; b < kBytes; ++b) reply[t][b] = static_cast<uint8_t>(recv[t][b] + t + 1);
      const Reply r{0};
      if (!server.Respond(*batch, {&r, 1}).ok()) failures.fetch_add(1);
    }
  });
  std::vector<std::thread> posters;
  for (int t = 0; t < kThreads; ++t) {
    posters.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        std::fill(push[t].begin(), push[t].end(), static_cast<uint8_t>(i * kThreads + t));
        absl::StatusOr<RequestHandle> h = worker.Post(plans[t]);
        if (!h.ok() || !worker.Wait(*h, absl::Seconds(20)).ok() ||
            pull[t][kBytes - 1] != static_cast<uint8_t>(i * kThreads + t + t + 1)) {
          failures.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& p : posters) p.join();
  serve.join();
  CHECK(failures.load() == 0);
}

}  // namespace
}  // namespace stepmesh
