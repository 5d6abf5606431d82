#include "tests/support/conformance_suite.h"

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "tests/support/status.h"

namespace stepmesh::testing {

std::unique_ptr<LoopbackMesh> StartPair(MeshOptions options,
                                        const core::TransportFactory& transport) {
  options.num_workers = 1;
  options.num_servers = 1;
  absl::StatusOr<std::unique_ptr<LoopbackMesh>> mesh = LoopbackMesh::Start(options, transport);
  REQUIRE_OK(mesh);
  return *std::move(mesh);
}

void RunBadInputConformance(const std::function<std::unique_ptr<LoopbackMesh>()>& make) {
  std::vector<uint8_t> push(256, 7), pull(512, 0), other_push(256, 9);
  std::vector<uint8_t> recv(256), reply(512, 3), recv_bf16(512);
  std::vector<uint8_t> wrong(256), big(1024), small(128);  // for single sections
  std::unique_ptr<LoopbackMesh> mesh = make();  // after the tensors: registered memory outlives it
  AFTensorWorker& worker = mesh->worker(0);
  AFTensorServer& server = mesh->server(0);
  const TensorView push_view{push.data(), DType::kFloat8E4M3, Shape{1, 256}, Device::Cpu()};
  REQUIRE(worker.RegisterPushTensor(1, push_view).ok());
  REQUIRE(worker.RegisterPullTensor(2, 0, {pull.data(), DType::kBFloat16, Shape{1, 256}}).ok());
  REQUIRE(server.RegisterRecvTensor(1, {recv.data(), DType::kFloat8E4M3, Shape{1, 256}}).ok());
  REQUIRE(server.RegisterReplyTensor(2, {reply.data(), DType::kBFloat16, Shape{1, 256}}).ok());

  // The good request (push key 1, pull key 2 from server 0), posted.
  const Push good_push{1};
  const Pull good_pull{2, 0};
  auto post_good = [&] {
    auto h = worker.PushPull({&good_push, 1}, {&good_pull, 1});
    REQUIRE(h.ok());
    return *h;
  };
  // A good round trip, used again after every bad input.
  auto round_trip = [&] {
    const RequestHandle h = post_good();
    auto batch = server.GetBatch(absl::Seconds(5));
    REQUIRE(batch.ok());
    REQUIRE(batch->workers.size() == 1);
    CHECK(batch->tensors[0].valid_bytes[0] == 256);
    CHECK(recv[0] == push[0]);
    const Reply r{0};
    REQUIRE(server.Respond(*batch, {&r, 1}).ok());
    REQUIRE(worker.Wait(h, absl::Seconds(5)).ok());
    CHECK(pull == reply);
  };
  round_trip();

  SECTION("registration rules") {
    CHECK(absl::IsAlreadyExists(worker.RegisterPushTensor(1, push_view)));
    CHECK(
        absl::IsInvalidArgument(worker.RegisterPushTensor(5, {nullptr, DType::kUInt8, Shape{4}})));
    CHECK(absl::IsInvalidArgument(worker.RegisterPullTensor(6, 3, push_view)));
    CHECK(absl::IsNotFound(worker.Unregister(77)));
    // Pull tensors receive remote writes: they may not alias anything registered.
    CHECK(
        absl::IsInvalidArgument(worker.RegisterPullTensor(8, 0, BytesView(push.data() + 16, 32))));
    CHECK(absl::IsInvalidArgument(worker.RegisterPushTensor(9, BytesView(pull.data() + 8, 8))));
    // Two push tensors may share memory: both are only read.
    CHECK(worker.RegisterPushTensor(10, BytesView(push.data(), 16)).ok());
    CHECK(absl::IsInvalidArgument(server.RegisterRecvTensor(11, BytesView(recv.data() + 100, 10))));
    CHECK(absl::IsInvalidArgument(server.RegisterReplyTensor(12, BytesView(recv.data(), 10))));
    // Unregistering frees the range for reuse.
    REQUIRE(worker.Unregister(10).ok());
    CHECK(absl::IsNotFound(worker.Unregister(10)));
  }
  SECTION("unregistered key") {
    const Push p{99};
    auto h = worker.PushPull({&p, 1}, {});
    CHECK(absl::IsNotFound(h.status()));
    round_trip();
  }
  SECTION("push larger than registered") {
    const Push p{1, 257};
    auto h = worker.PushPull({&p, 1}, {});
    CHECK(absl::IsOutOfRange(h.status()));
    round_trip();
  }
  SECTION("pull from an unknown server") {
    const Push p{1};
    const Pull q{2, 4};
    CHECK(absl::IsInvalidArgument(worker.PushPull({&p, 1}, {&q, 1}).status()));
    round_trip();
  }
  SECTION("reuse of a key still in flight, and handle rules") {
    const RequestHandle h = post_good();
    CHECK(absl::IsFailedPrecondition(worker.PushPull({&good_push, 1}, {&good_pull, 1}).status()));
    CHECK(absl::IsFailedPrecondition(worker.Unregister(1)));
    // Wait past its deadline: DEADLINE_EXCEEDED, the request stays pending.
    CHECK(absl::IsDeadlineExceeded(worker.Wait(h, absl::Milliseconds(50))));
    CHECK_FALSE(*worker.Test(h));
    auto batch = server.GetBatch(absl::Seconds(5));
    REQUIRE(batch.ok());
    const Reply r{0};
    REQUIRE(server.Respond(*batch, {&r, 1}).ok());
    CHECK(absl::IsFailedPrecondition(server.Respond(*batch, {&r, 1})));  // answered twice
    REQUIRE(worker.Wait(h, absl::Seconds(5)).ok());
    CHECK(absl::IsFailedPrecondition(worker.Wait(h, absl::Seconds(1))));  // waited twice
    CHECK(worker.FetchTrace(h).ok());
    round_trip();  // reuses the slot: the old handle is now stale
    CHECK(absl::IsFailedPrecondition(worker.Wait(h, absl::Seconds(1))));
    CHECK(absl::IsInvalidArgument(worker.Wait(RequestHandle(), absl::Seconds(1))));
  }
  SECTION("dtype mismatch is refused by the server and reported to the worker") {
    REQUIRE(worker.RegisterPushTensor(3, {wrong.data(), DType::kUInt8, Shape{256}}).ok());
    REQUIRE(server.RegisterRecvTensor(3, {recv_bf16.data(), DType::kBFloat16, Shape{1, 256}}).ok());
    const Push p{3};
    auto h = worker.PushPull({&p, 1}, {});
    REQUIRE(h.ok());
    absl::Status s = worker.Wait(*h, absl::Seconds(5));
    CHECK(absl::IsInvalidArgument(s));
    CHECK(std::string(s.message()).find("dtype") != std::string::npos);
    CHECK(absl::IsDeadlineExceeded(server.GetBatch(absl::Milliseconds(50)).status()));
    round_trip();
  }
  SECTION("push larger than the server's slot") {
    REQUIRE(worker.RegisterPushTensor(4, {big.data(), DType::kUInt8, Shape{1024}}).ok());
    REQUIRE(server.RegisterRecvTensor(4, {small.data(), DType::kUInt8, Shape{128}}).ok());
    const Push p{4};
    auto h = worker.PushPull({&p, 1}, {});
    // TCP learns it from the server's error frame; RDMA knows the remote slot size.
    if (h.ok()) {
      CHECK(absl::IsOutOfRange(worker.Wait(*h, absl::Seconds(5))));
    } else {
      CHECK(absl::IsOutOfRange(h.status()));
    }
    round_trip();
  }
  SECTION("Respond validates before sending anything") {
    const RequestHandle h = post_good();
    auto batch = server.GetBatch(absl::Seconds(5));
    REQUIRE(batch.ok());
    CHECK(absl::IsInvalidArgument(server.Respond(*batch, {})));  // worker 0 pulls
    const Reply stranger{3};
    CHECK(absl::IsInvalidArgument(server.Respond(*batch, {&stranger, 1})));
    const Reply too_big{0, 4096};
    CHECK(absl::IsOutOfRange(server.Respond(*batch, {&too_big, 1})));
    CHECK(absl::IsDeadlineExceeded(worker.Wait(h, absl::Milliseconds(20))));
    const Reply r{0};
    REQUIRE(server.Respond(*batch, {&r, 1}).ok());
    REQUIRE(worker.Wait(h, absl::Seconds(5)).ok());
    round_trip();
  }
  SECTION("a server that goes away fails the worker's request, not the process") {
    const RequestHandle h = post_good();
    REQUIRE(server.GetBatch(absl::Seconds(5)).ok());
    const absl::Time gone = absl::Now();
    mesh->DropServer(0);
    const absl::Status s = worker.Wait(h, absl::Seconds(10));
    CHECK(absl::IsUnavailable(s));
    CHECK(absl::Now() - gone < absl::Seconds(5));
    CHECK(absl::IsUnavailable(worker.PushPull({&good_push, 1}, {&good_pull, 1}).status()));
  }
}

}  // namespace stepmesh::testing
