// The hot path allocates nothing: once a 2A2F mesh is warm, PushPull (or Post
// of a request prepared before), Wait, GetBatch and Respond, and the send and
// receive threads behind them, run without a single call to operator new. Counted by replacing the
// global operator new of this test program; sanitizer builds keep their own allocator, so there the
// case only reports that it cannot count.

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <new>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "src/compose/transports.h"
#include "stepmesh/server.h"
#include "stepmesh/status.h"
#include "stepmesh/worker.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define STEPMESH_COUNT_ALLOCATIONS 0
#else
#define STEPMESH_COUNT_ALLOCATIONS 1
namespace {
std::atomic<uint64_t> allocations{0};
void* Allocate(std::size_t bytes, std::size_t alignment) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  bytes = bytes == 0 ? 1 : bytes;
  void* p = alignment <= alignof(std::max_align_t)
                ? std::malloc(bytes)
                : std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace
void* operator new(std::size_t bytes) { return Allocate(bytes, 0); }
void* operator new(std::size_t bytes, std::align_val_t a) {
  return Allocate(bytes, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#endif

namespace stepmesh {
namespace {

constexpr int kWorkers = 2;
constexpr int kServers = 2;
constexpr int64_t kBytes = 64 << 10;
constexpr int kWarmup = 300;
constexpr int kMeasured = 1000;

// `prepared`: each worker posts one PreparedRequest (made before the
// window); otherwise it calls PushPull each round.
void CheckNoAllocations(bool prepared) {
#if !STEPMESH_COUNT_ALLOCATIONS
  WARN("sanitizer build: allocations are not counted here (the normal build checks them)");
#else
  MeshOptions base;
  base.transport = "tcp";
  base.num_workers = kWorkers;
  base.num_servers = kServers;
  base.timeout = absl::Seconds(60);
  base.heartbeat_interval = absl::Hours(1);  // no liveness traffic inside the window
  // The trace ring on, and smaller than the window (it wraps): recording a
  // request allocates nothing either. Off, recording is one branch.
  base.trace.events = 256;
  // Every tensor before the mesh: registered memory outlives it.
  testing::MeshBuffers buffers(kWorkers, kServers, kBytes);
  auto mesh = testing::LoopbackMesh::Start(base, compose::CreateTransport);
  REQUIRE_OK(mesh);

  std::atomic<int> warmed{0}, finished{0}, failures{0};
  std::atomic<bool> go{false};
  auto serve = [&](AFTensorServer& server) -> absl::Status {
    std::vector<uint8_t>& recv = buffers.recv[server.rank()];
    std::vector<uint8_t>& reply = buffers.reply[server.rank()];
    const Shape shape{kWorkers, kBytes};
    STEPMESH_RETURN_IF_ERROR(server.RegisterRecvTensor(1, {recv.data(), DType::kUInt8, shape}));
    STEPMESH_RETURN_IF_ERROR(server.RegisterReplyTensor(2, {reply.data(), DType::kUInt8, shape}));
    STEPMESH_RETURN_IF_ERROR(server.Barrier());
    const Reply answers[kWorkers] = {{0}, {1}};
    for (;;) {  // ends when every worker has left
      absl::StatusOr<Batch> batch = server.GetBatch(absl::Seconds(30));
      if (!batch.ok()) break;
      for (int w : batch->workers) reply[w * kBytes] = recv[w * kBytes] ^ 0x5A;
      if (!server.Respond(*batch, answers).ok()) failures.fetch_add(1);
    }
    return server.Shutdown();
  };
  auto work = [&](AFTensorWorker& worker) -> absl::Status {
    std::vector<uint8_t>& push = buffers.push[worker.rank()];
    std::vector<uint8_t>& pull0 = buffers.pull[worker.rank() * kServers];
    std::vector<uint8_t>& pull1 = buffers.pull[worker.rank() * kServers + 1];
    STEPMESH_RETURN_IF_ERROR(worker.RegisterPushTensor(1, BytesView(push.data(), kBytes)));
    STEPMESH_RETURN_IF_ERROR(worker.RegisterPullTensor(2, 0, BytesView(pull0.data(), kBytes)));
    STEPMESH_RETURN_IF_ERROR(worker.RegisterPullTensor(2, 1, BytesView(pull1.data(), kBytes)));
    STEPMESH_RETURN_IF_ERROR(worker.Barrier());
    const Push p{1};
    const Pull pull_from[kServers] = {{2, 0}, {2, 1}};
    STEPMESH_ASSIGN_OR_RETURN(const PreparedRequest plan, worker.Prepare({&p, 1}, pull_from));
    auto round = [&](int i) {
      push[0] = static_cast<uint8_t>(i);
      absl::StatusOr<RequestHandle> h =
          prepared ? worker.Post(plan) : worker.PushPull({&p, 1}, pull_from);
      if (!h.ok() || !worker.Wait(*h, absl::Seconds(30)).ok() || pull0[0] != (push[0] ^ 0x5A) ||
          pull1[0] != (push[0] ^ 0x5A)) {
        failures.fetch_add(1);
      }
    };
    for (int i = 0; i < kWarmup; ++i) round(i);
    warmed.fetch_add(1);
    while (!go.load()) std::this_thread::yield();
    for (int i = 0; i < kMeasured; ++i) round(kWarmup + i);
    finished.fetch_add(1);
    while (go.load()) std::this_thread::yield();  // nothing but the window is counted
    return worker.Shutdown();
  };
  absl::Status ran;
  std::thread participants([&] { ran = testing::RunParticipants(**mesh, work, serve); });
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (warmed.load() < kWorkers && absl::Now() < deadline) std::this_thread::yield();
  const uint64_t before = allocations.load();
  go.store(true);
  while (finished.load() < kWorkers && absl::Now() < deadline) std::this_thread::yield();
  const uint64_t during = allocations.load() - before;
  go.store(false);
  participants.join();
  CHECK_OK(ran);
  REQUIRE(finished.load() == kWorkers);
  CHECK(failures.load() == 0);
  INFO(during << " allocations in " << kMeasured << " round trips of " << kWorkers << " workers");
  CHECK(during == 0);
#endif
}

TEST_CASE("steady-state 2A2F exchanges over TCP allocate nothing", "[mesh][tcp][alloc]") {
  CheckNoAllocations(/*prepared=*/false);
}

TEST_CASE("steady-state 2A2F posts of prepared requests over TCP allocate nothing",
          "[mesh][tcp][alloc][prepared]") {
  CheckNoAllocations(/*prepared=*/true);
}

}  // namespace
}  // namespace stepmesh
