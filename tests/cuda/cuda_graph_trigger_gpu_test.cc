// Device-triggered sends in a real CUDA graph (docs/cuda.md, "Device-triggered
// sends"): one capture of [copy the input into a mapped send buffer, bump go,
// wait until done >= go, copy the mapped receive buffer out], 100 replays;
// a stepmesh::Trigger posts to a host peer (every byte + 1) once per replay.
// Exits 77 (ctest: skipped) without a GPU.

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "stepmesh/backend.h"
#include "stepmesh/cuda.h"
#include "stepmesh/trigger.h"
#include "tests/support/catch_session.h"

namespace stepmesh {
namespace {

constexpr size_t kBytes = 4096;

TEST_CASE("gpu: a captured graph posts through the trigger at every one of 100 replays",
          "[cuda_gpu]") {
  auto backend = *CreateCudaBackend(0);
  auto stream = *backend->CreateStream();
  auto native = static_cast<cudaStream_t>(*NativeCudaStream(*stream));
  auto input = *backend->Allocate(kBytes, MemoryKind::kDevice);
  auto output = *backend->Allocate(kBytes, MemoryKind::kDevice);
  auto send = *backend->Allocate(kBytes, MemoryKind::kHostMapped);
  auto recv = *backend->Allocate(kBytes, MemoryKind::kHostMapped);
  auto* send_bytes = static_cast<uint8_t*>(send->data());
  auto* recv_bytes = static_cast<uint8_t*>(recv->data());
  // The peer: a post answers at once (on the trigger's thread) with every byte
  // + 1; poll reports it done the next time.
  std::atomic<uint32_t> posted{0};
  TriggerTarget target;
  target.post = [&]() -> absl::StatusOr<RequestHandle> {
    for (size_t i = 0; i < kBytes; ++i) recv_bytes[i] = send_bytes[i] + 1;
    return RequestHandle(0, ++posted);
  };
  target.poll = [](RequestHandle) -> absl::StatusOr<bool> { return true; };
  target.name = "host peer";
  auto trigger = *Trigger::Create(*backend);
  auto armed = *trigger->Arm(std::move(target));

  REQUIRE(cudaStreamBeginCapture(native, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  const absl::Status copied_in = stream->CopyAsync(send->data(), input->data(), kBytes);
  const absl::Status go = stream->IncrementCounter(armed.go);
  const absl::Status wait = stream->WaitCounterAtLeast(armed.done, armed.go);
  const absl::Status copied_out = stream->CopyAsync(output->data(), recv->data(), kBytes);
  cudaGraph_t graph = nullptr;
  REQUIRE(cudaStreamEndCapture(native, &graph) == cudaSuccess);
  REQUIRE(copied_in.ok());
  REQUIRE(go.ok());
  REQUIRE(wait.ok());
  REQUIRE(copied_out.ok());
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  CHECK(posted.load() == 0);

  std::vector<uint8_t> host(kBytes), got(kBytes);
  const absl::Time start = absl::Now();
  for (int r = 0; r < 100; ++r) {
    for (size_t i = 0; i < kBytes; ++i) host[i] = static_cast<uint8_t>(r * 5 + i);
    REQUIRE(cudaMemcpy(input->data(), host.data(), kBytes, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, native) == cudaSuccess);
    REQUIRE(stream->Synchronize(absl::Seconds(10)).ok());
    REQUIRE(cudaMemcpy(got.data(), output->data(), kBytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    for (size_t i = 0; i < kBytes; ++i) REQUIRE(got[i] == static_cast<uint8_t>(r * 5 + i + 1));
  }
  const absl::Duration took = absl::Now() - start;
  std::fprintf(stderr,
               "100 replays, one trigger post each: %.1f us per replay (with host copies)\n",
               absl::ToDoubleMicroseconds(took) / 100);
  CHECK(posted.load() == 100);
  CHECK(trigger->posts() == 100);
  CHECK(trigger->TakeError().ok());
  trigger->Shutdown();
  CHECK(cudaGraphExecDestroy(exec) == cudaSuccess);
  CHECK(cudaGraphDestroy(graph) == cudaSuccess);
}

}  // namespace
}  // namespace stepmesh

int main(int argc, char** argv) {
  const bool hardware =
      ::access("/dev/nvidiactl", F_OK) == 0 || ::access("/dev/nvidia0", F_OK) == 0;
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if ((error != cudaSuccess || count == 0) && !hardware) {
    std::fprintf(stderr, "cuda_graph_trigger_gpu_test: no GPU on this host (%s), skipping\n",
                 error != cudaSuccess ? cudaGetErrorName(error) : "0 devices");
    return 77;
  }
  if (error != cudaSuccess || count == 0) {
    std::fprintf(stderr, "cuda_graph_trigger_gpu_test: FAILED: %s, but /dev/nvidia* exists\n",
                 error != cudaSuccess ? cudaGetErrorName(error) : "no CUDA device");
    return 1;
  }
  return stepmesh::testing::RunCatchSession(argc, argv);
}
