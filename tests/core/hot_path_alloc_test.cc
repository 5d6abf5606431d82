// The hot path allocates nothing: once a 2A2F mesh is warm, PushPull, Wait,
// GetBatch and Respond, and the send and receive threads behind them, run
// without a single call to operator new. Counted by replacing the global
// operator new of this test program; sanitizer builds keep their own
// allocator, so there the case only reports that it cannot count.

#include <atomic>
#include <cstdlib>
#include <new>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/time/clock.h"
#include "stepmesh/scheduler.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"

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

TEST_CASE("steady-state 2A2F exchanges over TCP allocate nothing", "[mesh][tcp][alloc]") {
#if !STEPMESH_COUNT_ALLOCATIONS
  WARN("sanitizer build: allocations are not counted here (the normal build checks them)");
#else
  MeshOptions base;
  base.transport = "tcp";
  base.num_workers = kWorkers;
  base.num_servers = kServers;
  base.timeout = absl::Seconds(60);
  base.heartbeat_interval = absl::Hours(1);  // no liveness traffic inside the window
  base.scheduler = "127.0.0.1:0";
  auto scheduler = Scheduler::Start(base);
  REQUIRE(scheduler.ok());
  base.scheduler = (*scheduler)->address();

  std::atomic<int> warmed{0}, finished{0}, failures{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int s = 0; s < kServers; ++s) {
    threads.emplace_back([&, s] {
      MeshOptions o = base;
      o.role = Role::kServer;
      o.rank = s;
      auto server = AFTensorServer::Create(o);
      if (!server.ok()) {
        failures.fetch_add(1);
        return;
      }
      std::vector<uint8_t> recv(kWorkers * kBytes), reply(kWorkers * kBytes);
      const Shape shape{kWorkers, kBytes};
      if (!(*server)->RegisterRecvTensor(1, {recv.data(), DType::kUInt8, shape}).ok() ||
          !(*server)->RegisterReplyTensor(2, {reply.data(), DType::kUInt8, shape}).ok() ||
          !(*server)->Barrier().ok()) {
        failures.fetch_add(1);
      }
      const Reply replies[kWorkers] = {{0}, {1}};
      for (;;) {  // ends when every worker has left
        absl::StatusOr<Batch> batch = (*server)->GetBatch(absl::Seconds(30));
        if (!batch.ok()) break;
        for (int w : batch->workers) reply[w * kBytes] = recv[w * kBytes] ^ 0x5A;
        if (!(*server)->Respond(*batch, replies).ok()) failures.fetch_add(1);
      }
      (void)(*server)->Shutdown();
    });
  }
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      MeshOptions o = base;
      o.role = Role::kWorker;
      o.rank = w;
      auto worker = AFTensorWorker::Create(o);
      if (!worker.ok()) {
        failures.fetch_add(1);
        return;
      }
      std::vector<uint8_t> push(kBytes), pull0(kBytes), pull1(kBytes);
      if (!(*worker)->RegisterPushTensor(1, BytesView(push.data(), kBytes)).ok() ||
          !(*worker)->RegisterPullTensor(2, 0, BytesView(pull0.data(), kBytes)).ok() ||
          !(*worker)->RegisterPullTensor(2, 1, BytesView(pull1.data(), kBytes)).ok() ||
          !(*worker)->Barrier().ok()) {
        failures.fetch_add(1);
      }
      const Push p{1};
      const Pull pulls[kServers] = {{2, 0}, {2, 1}};
      auto round = [&](int i) {
        push[0] = static_cast<uint8_t>(i);
        absl::StatusOr<RequestHandle> h = (*worker)->PushPull({&p, 1}, pulls);
        if (!h.ok() || !(*worker)->Wait(*h, absl::Seconds(30)).ok() ||
            pull0[0] != (push[0] ^ 0x5A) || pull1[0] != (push[0] ^ 0x5A)) {
          failures.fetch_add(1);
        }
      };
      for (int i = 0; i < kWarmup; ++i) round(i);
      warmed.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kMeasured; ++i) round(kWarmup + i);
      finished.fetch_add(1);
      while (go.load()) std::this_thread::yield();  // nothing but the window is counted
      (void)(*worker)->Shutdown();
    });
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (warmed.load() < kWorkers && absl::Now() < deadline) std::this_thread::yield();
  const uint64_t before = allocations.load();
  go.store(true);
  while (finished.load() < kWorkers && absl::Now() < deadline) std::this_thread::yield();
  const uint64_t during = allocations.load() - before;
  go.store(false);
  for (std::thread& t : threads) t.join();
  REQUIRE(finished.load() == kWorkers);
  CHECK(failures.load() == 0);
  INFO(during << " allocations in " << kMeasured << " round trips of " << kWorkers << " workers");
  CHECK(during == 0);
#endif
}

}  // namespace
}  // namespace stepmesh
