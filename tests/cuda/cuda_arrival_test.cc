// Arrival on the GPU timeline through the core (worker StreamWaitReply /
// StreamWaitNextPull, server StreamWaitNextBatch): a 1A1F mesh over TCP whose
// participants use the CUDA backend over FakeCudaApi, every tensor in (fake)
// device memory, so the core stages them and the test reads them back only
// through the fake. The fake's streams run only when the test says so, which
// makes "the consumer has not run yet" observable.

#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/backends/cuda/cuda_backend.h"
#include "src/compose/transports.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"
#include "tests/cuda/fake_cuda_api.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

using cuda::testing::FakeCudaApi;

constexpr Key kPushKey = 1;
constexpr Key kPullKey = 2;
constexpr size_t kBytes = 8192;

struct FakeGpuMesh {
  FakeGpuMesh() {
    MeshOptions o;
    o.transport = "tcp";
    o.timeout = absl::Seconds(10);
    worker_backend = *CreateCudaBackend(worker_gpu, 0);
    server_backend = *CreateCudaBackend(server_gpu, 0);
    auto started = testing::LoopbackMesh::Start(
        o, compose::CreateTransport,
        [this](Role role, int) { return role == Role::kWorker ? worker_backend : server_backend; });
    REQUIRE_OK(started);
    mesh = *std::move(started);
    worker = &mesh->worker(0);
    server = &mesh->server(0);
    push = *worker_backend->Allocate(kBytes, MemoryKind::kDevice);
    pull = *worker_backend->Allocate(kBytes, MemoryKind::kDevice);
    recv = *server_backend->Allocate(kBytes, MemoryKind::kDevice);
    reply = *server_backend->Allocate(kBytes, MemoryKind::kDevice);
    const Shape shape{1, static_cast<int64_t>(kBytes)};
    REQUIRE(worker->RegisterPushTensor(kPushKey, push->View(DType::kUInt8, shape)).ok());
    REQUIRE(worker->RegisterPullTensor(kPullKey, 0, pull->View(DType::kUInt8, shape)).ok());
    REQUIRE(server->RegisterRecvTensor(kPushKey, recv->View(DType::kUInt8, shape)).ok());
    REQUIRE(server->RegisterReplyTensor(kPullKey, reply->View(DType::kUInt8, shape)).ok());
  }
  ~FakeGpuMesh() {
    mesh.reset();  // workers, then servers, then the scheduler
    push.reset();
    pull.reset();
    recv.reset();
    reply.reset();
    worker_backend.reset();
    server_backend.reset();
    for (const std::string& v : worker_gpu->violations()) FAIL_CHECK("worker's GPU: " << v);
    for (const std::string& v : server_gpu->violations()) FAIL_CHECK("server's GPU: " << v);
  }

  // The server's side of one step: the pushed bytes came, the reply is `value`.
  void Serve(uint8_t pushed, uint8_t value) {
    auto batch = server->GetBatch(absl::Seconds(10));
    REQUIRE(batch.ok());
    std::vector<uint8_t> seen(kBytes);
    REQUIRE(server_backend->Copy(seen.data(), recv->data(), kBytes).ok());
    CHECK(seen == std::vector<uint8_t>(kBytes, pushed));
    std::vector<uint8_t> out(kBytes, value);
    REQUIRE(server_backend->Copy(reply->data(), out.data(), kBytes).ok());
    const Reply r{0};
    REQUIRE(server->Respond(*batch, {&r, 1}).ok());
  }
  RequestHandle Push(uint8_t value) {
    std::vector<uint8_t> in(kBytes, value);
    REQUIRE(worker_backend->Copy(push->data(), in.data(), kBytes).ok());
    const stepmesh::Push p{kPushKey};
    const Pull q{kPullKey, 0};
    auto handle = worker->PushPull({&p, 1}, {&q, 1});
    REQUIRE(handle.ok());
    return *handle;
  }
  static cudaStream_t Native(Stream& stream) {
    return static_cast<cudaStream_t>(*NativeCudaStream(stream));
  }

  std::shared_ptr<FakeCudaApi> worker_gpu = std::make_shared<FakeCudaApi>(1);
  std::shared_ptr<FakeCudaApi> server_gpu = std::make_shared<FakeCudaApi>(1);
  std::shared_ptr<Backend> worker_backend;
  std::shared_ptr<Backend> server_backend;
  std::unique_ptr<testing::LoopbackMesh> mesh;
  AFTensorWorker* worker = nullptr;
  AFTensorServer* server = nullptr;
  std::unique_ptr<Memory> push, pull, recv, reply;
};

TEST_CASE("arrival: a worker stream waits for its request's reply on the device",
          "[cuda][arrival]") {
  FakeGpuMesh mesh;
  auto stream = *mesh.worker_backend->CreateStream();
  auto out = *mesh.worker_backend->Allocate(kBytes, MemoryKind::kHostPinned);
  for (int step = 1; step <= 5; ++step) {
    const auto value = static_cast<uint8_t>(step * 11);
    const RequestHandle handle = mesh.Push(static_cast<uint8_t>(step));
    REQUIRE(mesh.worker->StreamWaitReply(handle, *stream).ok());
    // The consumer of the reply, queued before the reply exists.
    REQUIRE(stream->CopyAsync(out->data(), mesh.pull->data(), kBytes).ok());
    mesh.worker_gpu->RunAll();
    CHECK(mesh.worker_gpu->Pending(FakeGpuMesh::Native(*stream)) == 2);  // held by the wait
    mesh.Serve(static_cast<uint8_t>(step), value);
    REQUIRE(mesh.worker->Wait(handle, absl::Seconds(10)).ok());
    mesh.worker_gpu->RunAll();
    CHECK(mesh.worker_gpu->Pending(FakeGpuMesh::Native(*stream)) == 0);
    CHECK(std::vector<uint8_t>(static_cast<uint8_t*>(out->data()),
                               static_cast<uint8_t*>(out->data()) + kBytes) ==
          std::vector<uint8_t>(kBytes, value));
  }
  // A waited handle is gone: clear status, nothing enqueued.
  const RequestHandle handle = mesh.Push(9);
  mesh.Serve(9, 9);
  REQUIRE(mesh.worker->Wait(handle, absl::Seconds(10)).ok());
  CHECK(mesh.worker->StreamWaitReply(handle, *stream).code() ==
        absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("arrival: a captured graph waits for a new reply at each of 100 replays",
          "[cuda][arrival]") {
  FakeGpuMesh mesh;
  auto capture = *mesh.worker_backend->CreateStream();
  auto replay = *mesh.worker_backend->CreateStream();
  auto out = *mesh.worker_backend->Allocate(kBytes, MemoryKind::kHostPinned);
  REQUIRE(mesh.worker_gpu->BeginCapture(FakeGpuMesh::Native(*capture),
                                        cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(mesh.worker->StreamWaitNextPull(kPullKey, 0, *capture).ok());
  REQUIRE(capture->CopyAsync(out->data(), mesh.pull->data(), kBytes).ok());
  FakeCudaApi::Graph graph;
  REQUIRE(mesh.worker_gpu->EndCapture(FakeGpuMesh::Native(*capture), &graph) == cudaSuccess);
  for (int step = 1; step <= 100; ++step) {
    const auto value = static_cast<uint8_t>(step);
    const RequestHandle handle = mesh.Push(value);
    REQUIRE(mesh.worker_gpu->LaunchGraph(graph, FakeGpuMesh::Native(*replay)) == cudaSuccess);
    mesh.worker_gpu->RunAll();
    REQUIRE(mesh.worker_gpu->Pending(FakeGpuMesh::Native(*replay)) == 2);  // waits for this reply
    mesh.Serve(value, static_cast<uint8_t>(value ^ 0x5A));
    REQUIRE(mesh.worker->Wait(handle, absl::Seconds(10)).ok());
    mesh.worker_gpu->RunAll();
    REQUIRE(mesh.worker_gpu->Pending(FakeGpuMesh::Native(*replay)) == 0);
    CHECK(static_cast<uint8_t*>(out->data())[kBytes - 1] == static_cast<uint8_t>(value ^ 0x5A));
  }
  CHECK(mesh.worker->StreamWaitNextPull(kPullKey, 1, *replay).code() ==
        absl::StatusCode::kNotFound);
}

TEST_CASE("arrival: a server stream waits for the next batch before it is there",
          "[cuda][arrival]") {
  FakeGpuMesh mesh;
  auto stream = *mesh.server_backend->CreateStream();
  auto out = *mesh.server_backend->Allocate(kBytes, MemoryKind::kHostPinned);
  for (int step = 1; step <= 5; ++step) {
    const auto value = static_cast<uint8_t>(step + 100);
    REQUIRE(mesh.server->StreamWaitNextBatch(*stream).ok());
    REQUIRE(stream->CopyAsync(out->data(), mesh.recv->data(), kBytes).ok());  // the FFN
    mesh.server_gpu->RunAll();
    CHECK(mesh.server_gpu->Pending(FakeGpuMesh::Native(*stream)) == 2);
    const RequestHandle handle = mesh.Push(value);
    // The batch completes on the server's receive thread; the stream goes.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (mesh.server_gpu->Pending(FakeGpuMesh::Native(*stream)) != 0 && absl::Now() < deadline) {
      mesh.server_gpu->RunAll();
      absl::SleepFor(absl::Milliseconds(1));
    }
    CHECK(static_cast<uint8_t*>(out->data())[0] == value);
    mesh.Serve(value, value);
    REQUIRE(mesh.worker->Wait(handle, absl::Seconds(10)).ok());
  }
}

TEST_CASE("arrival: shutdown releases streams still waiting for arrivals", "[cuda][arrival]") {
  FakeGpuMesh mesh;
  auto worker_stream = *mesh.worker_backend->CreateStream();
  auto server_stream = *mesh.server_backend->CreateStream();
  REQUIRE(mesh.worker->StreamWaitNextPull(kPullKey, 0, *worker_stream).ok());
  REQUIRE(mesh.server->StreamWaitNextBatch(*server_stream).ok());
  const RequestHandle handle = mesh.Push(1);  // never answered
  REQUIRE(mesh.worker->StreamWaitReply(handle, *worker_stream).ok());
  mesh.worker_gpu->RunAll();
  mesh.server_gpu->RunAll();
  CHECK(mesh.worker_gpu->Pending(FakeGpuMesh::Native(*worker_stream)) == 2);
  REQUIRE(mesh.server->Shutdown().ok());
  REQUIRE(mesh.worker->Shutdown().ok());
  const absl::Status waited = mesh.worker->Wait(handle, absl::Seconds(1));
  CHECK((absl::IsCancelled(waited) || absl::IsUnavailable(waited)));
  mesh.worker_gpu->RunAll();
  mesh.server_gpu->RunAll();
  CHECK(mesh.worker_gpu->Pending(FakeGpuMesh::Native(*worker_stream)) == 0);
  CHECK(mesh.server_gpu->Pending(FakeGpuMesh::Native(*server_stream)) == 0);
}

// The send thread polls a copy-engine ready event; a device fault means its
// flag copy never lands. The request must fail with the CUDA error instead of
// waiting for ever.
TEST_CASE("arrival: a device fault under a copy-engine ready event fails the request",
          "[cuda][arrival]") {
  FakeGpuMesh mesh;
  auto stream = *mesh.worker_backend->CreateStream();
  auto gate = *mesh.worker_backend->CreateHostFlag();
  auto ready = *mesh.worker_backend->CreateEvent();
  REQUIRE(stream->WaitHostFlag(*gate, 1).ok());  // the kernels that produce the push
  REQUIRE(ready->Record(*stream).ok());
  const stepmesh::Push p{kPushKey};
  const Pull q{kPullKey, 0};
  SendOptions options;
  options.ready = ready.get();
  auto handle = mesh.worker->PushPull({&p, 1}, {&q, 1}, options);
  REQUIRE(handle.ok());
  mesh.worker_gpu->InjectDeviceFault(0, cudaErrorIllegalAddress);  // one of them faults
  const absl::Status status = mesh.worker->Wait(*handle, absl::Seconds(10));
  INFO(status.ToString());
  CHECK(absl::IsInternal(status));
  CHECK(absl::StrContains(status.message(), "cudaErrorIllegalAddress"));
}

}  // namespace
}  // namespace stepmesh
