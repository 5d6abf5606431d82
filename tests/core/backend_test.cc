#include "stepmesh/backend.h"

#include <atomic>
#include <catch2/catch.hpp>
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
}  // namespace stepmesh
