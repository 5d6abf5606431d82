#include "stepmesh/backend.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"

namespace stepmesh {
namespace {

TEST_CASE("cpu_mock streams run work in order, events complete only when reached", "[backend]") {
  auto backend = CreateCpuMockBackend({absl::Milliseconds(20)});
  auto stream = backend->CreateStream();
  REQUIRE(stream.ok());
  auto event = backend->CreateEvent();
  REQUIRE(event.ok());
  std::vector<int> order;
  REQUIRE((*stream)->LaunchHostFunc([&] { order.push_back(1); }).ok());
  REQUIRE((*stream)->LaunchHostFunc([&] { order.push_back(2); }).ok());
  REQUIRE((*event)->Record(**stream).ok());
  // Two items each delayed 20 ms: the event cannot have completed yet.
  auto reached = (*event)->Query();
  REQUIRE(reached.ok());
  CHECK_FALSE(*reached);
  REQUIRE((*event)->Wait(absl::Seconds(5)).ok());
  CHECK(order == std::vector<int>{1, 2});
  REQUIRE((*stream)->Synchronize(absl::Seconds(5)).ok());
}

TEST_CASE("cpu_mock stream waits on a host flag without blocking the host", "[backend]") {
  auto backend = CreateCpuMockBackend();
  auto stream = *backend->CreateStream();
  auto flag = *backend->CreateHostFlag();
  auto event = *backend->CreateEvent();
  std::atomic<bool> ran{false};
  REQUIRE(stream->WaitHostFlag(*flag, 3).ok());
  REQUIRE(stream->LaunchHostFunc([&] { ran = true; }).ok());
  REQUIRE(event->Record(*stream).ok());
  absl::SleepFor(absl::Milliseconds(30));
  CHECK_FALSE(ran.load());
  flag->Store(2);
  absl::SleepFor(absl::Milliseconds(10));
  CHECK_FALSE(ran.load());
  std::thread releaser([&] { flag->Store(3); });
  REQUIRE(event->Wait(absl::Seconds(5)).ok());
  releaser.join();
  CHECK(ran.load());

  auto signal = *backend->CreateHostFlag();
  REQUIRE(stream->SignalHostFlag(*signal, 9).ok());
  REQUIRE(stream->Synchronize(absl::Seconds(5)).ok());
  CHECK(signal->Load() == 9);
}

TEST_CASE("cpu_mock WaitHostFlagNext waits for one more increment each time it runs", "[backend]") {
  auto backend = CreateCpuMockBackend();
  auto stream = *backend->CreateStream();
  auto counter = *backend->CreateHostFlag();
  auto cursor = *backend->CreateHostFlag();
  std::atomic<int> passed{0};
  for (int i = 0; i < 3; ++i) {
    REQUIRE(stream->WaitHostFlagNext(*counter, *cursor).ok());
    REQUIRE(stream->LaunchHostFunc([&] { ++passed; }).ok());
  }
  for (int i = 1; i <= 3; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    CHECK(passed.load() == i - 1);
    counter->Store(static_cast<uint32_t>(i));
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (passed.load() < i && absl::Now() < deadline) std::this_thread::yield();
    CHECK(passed.load() == i);
    CHECK(cursor->Load() == static_cast<uint32_t>(i));
  }
}

TEST_CASE("cpu_mock WaitCounterAtLeast holds later work until counter >= target", "[backend]") {
  auto backend = CreateCpuMockBackend();
  auto stream = *backend->CreateStream();
  int64_t counter = 0;
  int64_t target = 2;
  std::atomic<int> passed{0};
  REQUIRE(stream->WaitCounterAtLeast(&counter, &target).ok());
  REQUIRE(stream->LaunchHostFunc([&] { ++passed; }).ok());
  absl::SleepFor(absl::Milliseconds(10));
  CHECK(passed.load() == 0);
  std::atomic_ref<int64_t>(counter).store(1, std::memory_order_release);
  absl::SleepFor(absl::Milliseconds(10));
  CHECK(passed.load() == 0);  // 1 < 2
  std::atomic_ref<int64_t>(counter).store(3, std::memory_order_release);
  CHECK(stream->Synchronize(absl::Seconds(5)).ok());
  CHECK(passed.load() == 1);
  CHECK(absl::IsInvalidArgument(stream->WaitCounterAtLeast(nullptr, &target)));
}

TEST_CASE("cpu_mock: a destroyed or released flag lets its waiters go", "[backend]") {
  auto backend = CreateCpuMockBackend();
  auto stream = *backend->CreateStream();
  auto flag = *backend->CreateHostFlag();
  auto counter = *backend->CreateHostFlag();
  auto cursor = *backend->CreateHostFlag();
  REQUIRE(stream->WaitHostFlag(*flag, 7).ok());
  REQUIRE(stream->WaitHostFlagNext(*counter, *cursor).ok());
  REQUIRE(stream->WaitHostFlagNext(*counter, *cursor).ok());
  flag.reset();               // destroyed: its waiters are released first
  counter->ReleaseWaiters();  // shutdown: both next-waits go
  CHECK(stream->Synchronize(absl::Seconds(5)).ok());
  CHECK(cursor->Load() == 2);
}

TEST_CASE("cpu_mock memory is aligned and zeroed, unknown backends are errors", "[backend]") {
  auto backend = CreateCpuMockBackend();
  auto mem = backend->Allocate(10000, MemoryKind::kDevice);
  REQUIRE(mem.ok());
  CHECK(reinterpret_cast<uintptr_t>((*mem)->data()) % 4096 == 0);
  CHECK(static_cast<uint8_t*>((*mem)->data())[9999] == 0);
  CHECK(absl::IsNotFound(CreateBackend("tpu", 0).status()));
  auto event = *backend->CreateEvent();
  CHECK(*event->Query());  // never recorded: complete
}

}  // namespace
TEST_CASE("cpu_mock capture records stream ops, a launch replays exactly those, async",
          "[backend]") {
  auto backend = CreateCpuMockBackend({absl::Milliseconds(2)});
  auto capture = *backend->CreateStream();
  auto replay = *backend->CreateStream();
  auto event = *backend->CreateEvent();
  std::vector<int> order;
  std::atomic<int> ops_ran{0};  // read while the stream runs (order is not)
  int host_code_ran = 0;
  int64_t go = 0;
  int64_t src = 0, dst = 0;
  REQUIRE(capture->BeginCapture().ok());
  CHECK(capture->IsCapturing());
  CHECK(absl::IsFailedPrecondition(capture->BeginCapture()));
  REQUIRE(capture
              ->LaunchHostFunc([&] {
                order.push_back(1);
                ops_ran.fetch_add(1);
              })
              .ok());
  ++host_code_ran;  // host code between captured ops: not part of the graph
  REQUIRE(capture->CopyAsync(&dst, &src, sizeof(src)).ok());
  REQUIRE(capture->IncrementCounter(&go).ok());
  REQUIRE(capture
              ->LaunchHostFunc([&] {
                order.push_back(2);
                ops_ran.fetch_add(1);
              })
              .ok());
  // Nothing ran, and what cannot be captured is refused.
  absl::SleepFor(absl::Milliseconds(10));
  CHECK(order.empty());
  CHECK(go == 0);
  CHECK(absl::IsFailedPrecondition(event->Record(*capture)));
  CHECK(absl::IsFailedPrecondition(capture->Synchronize(absl::Seconds(1))));
  auto graph = capture->EndCapture();
  REQUIRE(graph.ok());
  CHECK((*graph)->size() == 4);
  CHECK_FALSE(capture->IsCapturing());
  CHECK(absl::IsFailedPrecondition(capture->EndCapture().status()));
  for (int64_t i = 1; i <= 100; ++i) {
    src = i * 7;  // host code between replays: the graph reads the captured address
    REQUIRE((*graph)->Launch(*replay).ok());
    REQUIRE(event->Record(*replay).ok());
    REQUIRE(event->Wait(absl::Seconds(5)).ok());
    REQUIRE(std::atomic_ref<int64_t>(go).load() == i);  // one increment per replay
    REQUIRE(dst == i * 7);
  }
  CHECK(host_code_ran == 1);
  CHECK(order.size() == 200);
  // Asynchronous like a real launch: back-to-back launches queue behind each other.
  order.clear();
  ops_ran.store(0);
  for (int i = 0; i < 5; ++i) REQUIRE((*graph)->Launch(*replay).ok());
  CHECK(ops_ran.load() < 10);  // 2 ms per op: the launches returned before running
  REQUIRE(replay->Synchronize(absl::Seconds(5)).ok());
  CHECK(order.size() == 10);
  for (size_t i = 0; i < order.size(); ++i) CHECK(order[i] == (i % 2 == 0 ? 1 : 2));
  CHECK(absl::IsInvalidArgument(replay->IncrementCounter(nullptr)));
}

TEST_CASE("cpu_mock: an allocation while a stream captures is refused and breaks the capture",
          "[backend]") {
  // CUDA's global capture mode (torch.cuda.graph's default) refuses cudaMalloc
  // and cudaHostAlloc from any thread while a capture is in progress, and the
  // capture then fails at its end: the mock is no more permissive.
  auto backend = CreateCpuMockBackend();
  auto capture = *backend->CreateStream();
  auto other = *backend->CreateStream();
  int64_t go = 0;
  REQUIRE(capture->BeginCapture().ok());
  REQUIRE(capture->IncrementCounter(&go).ok());
  absl::StatusOr<std::unique_ptr<Memory>> memory = backend->Allocate(64, MemoryKind::kHostMapped);
  CHECK(absl::IsFailedPrecondition(memory.status()));
  CHECK_THAT(std::string(memory.status().message()),
             Catch::Contains("Allocate(64 bytes) while a stream was being captured"));
  absl::Status elsewhere_status;
  std::thread elsewhere([&] { elsewhere_status = backend->CreateHostFlag().status(); });
  elsewhere.join();
  CHECK(absl::IsFailedPrecondition(elsewhere_status));  // another thread: refused too (global)
  REQUIRE(other->CopyAsync(&go, &go, 0).ok());          // stream work elsewhere is fine
  absl::Status after = capture->IncrementCounter(&go);  // the broken capture records no more
  CHECK(absl::IsFailedPrecondition(after));
  CHECK_THAT(std::string(after.message()), Catch::Contains("invalidated by Allocate(64 bytes)"));
  absl::StatusOr<std::unique_ptr<StreamGraph>> graph = capture->EndCapture();
  CHECK(absl::IsFailedPrecondition(graph.status()));
  CHECK_THAT(std::string(graph.status().message()),
             Catch::Contains("invalidated by Allocate(64 bytes)"));
  CHECK_FALSE(capture->IsCapturing());
  // Allocated before the capture, the same work captures and replays.
  auto flag = *backend->CreateHostFlag();
  memory = backend->Allocate(64, MemoryKind::kHostMapped);
  REQUIRE(memory.ok());
  REQUIRE(capture->BeginCapture().ok());
  REQUIRE(capture->IncrementCounter(&go).ok());
  REQUIRE(capture->SignalHostFlag(*flag, 7).ok());
  graph = capture->EndCapture();
  REQUIRE(graph.ok());
  REQUIRE((*graph)->Launch(*other).ok());
  REQUIRE(other->Synchronize(absl::Seconds(5)).ok());
  CHECK(std::atomic_ref<int64_t>(go).load() == 1);
  CHECK(flag->Load() == 7);
  // A stream destroyed mid-capture leaves no capture behind.
  REQUIRE(other->BeginCapture().ok());
  other.reset();
  CHECK(backend->Allocate(64, MemoryKind::kHostMapped).ok());
}

TEST_CASE("cpu_mock: a replayed WaitCounterAtLeast(done, go) waits for that replay's go",
          "[backend]") {
  auto backend = CreateCpuMockBackend();
  auto capture = *backend->CreateStream();
  auto replay = *backend->CreateStream();
  int64_t go = 0, done = 0;
  std::atomic<int> after{0};
  REQUIRE(capture->BeginCapture().ok());
  REQUIRE(capture->IncrementCounter(&go).ok());
  REQUIRE(capture->WaitCounterAtLeast(&done, &go).ok());
  REQUIRE(capture->LaunchHostFunc([&] { ++after; }).ok());
  auto graph = *capture->EndCapture();
  for (int i = 1; i <= 20; ++i) {
    REQUIRE(graph->Launch(*replay).ok());
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (std::atomic_ref<int64_t>(go).load() < i && absl::Now() < deadline) {
      std::this_thread::yield();
    }
    absl::SleepFor(absl::Milliseconds(2));
    CHECK(after.load() == i - 1);  // done i-1 < go i: held
    std::atomic_ref<int64_t>(done).store(i, std::memory_order_release);
    REQUIRE(replay->Synchronize(absl::Seconds(5)).ok());
    CHECK(after.load() == i);
  }
  // A stream destroyed while a replay waits does not hang.
  REQUIRE(graph->Launch(*replay).ok());
  replay.reset();
}

}  // namespace stepmesh
