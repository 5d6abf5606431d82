// Logic tests of the CUDA backend over FakeCudaApi: no GPU, no driver. Every
// test ends by checking the fake saw no call a real driver would reject.

#include "src/backends/cuda/cuda_backend.h"

#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/backends/cuda/cuda_status.h"
#include "stepmesh/backend.h"
#include "tests/cuda/cuda_backend_fixture.h"
#include "tests/cuda/fake_cuda_api.h"

namespace stepmesh {
namespace {

using cuda::testing::FakeCudaApi;
using Fixture = cuda::testing::BackendFixture;

// With a pool of two events, so that the pool's limit is reached in a test.
CudaBackendOptions Options(ReadyEventMode ready, StreamWaitMode wait = StreamWaitMode::kAuto) {
  CudaBackendOptions options = cuda::testing::Modes(ready, wait);
  options.event_pool_size = 2;
  return options;
}

// --- Creation ---------------------------------------------------------------

TEST_CASE("cuda: no driver or no device gives UNAVAILABLE with a clear message", "[cuda]") {
  for (cudaError_t error : {cudaErrorNoDevice, cudaErrorInsufficientDriver, cudaErrorStubLibrary}) {
    auto fake = std::make_shared<FakeCudaApi>(1);
    fake->set_device_count_error(error);
    auto backend = CreateCudaBackend(fake, 0);
    REQUIRE_FALSE(backend.ok());
    CHECK(backend.status().code() == absl::StatusCode::kUnavailable);
    CHECK_THAT(std::string(backend.status().message()), Catch::Contains("cudaGetDeviceCount"));
    CHECK_THAT(std::string(backend.status().message()), Catch::Contains(cudaGetErrorName(error)));
    CHECK(cuda::CudaErrorFromStatus(backend.status()) == static_cast<int>(error));
  }
  auto zero = CreateCudaBackend(std::make_shared<FakeCudaApi>(0), 0);
  CHECK(zero.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(zero.status().message()), Catch::Contains("no CUDA device"));
}

TEST_CASE("cuda: the real CudaApi on a machine without a GPU fails cleanly, not by crashing",
          "[cuda]") {
  auto backend = CreateCudaBackend(0);
  if (backend.ok()) {
    SUCCEED("a GPU is present here");
  } else {
    CHECK(backend.status().code() == absl::StatusCode::kUnavailable);
  }
}

TEST_CASE("cuda: device index out of range or negative is INVALID_ARGUMENT", "[cuda]") {
  auto fake = std::make_shared<FakeCudaApi>(4);
  auto high = CreateCudaBackend(fake, 4);
  CHECK(high.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(high.status().message()), Catch::Contains("4 visible"));
  CHECK(CreateCudaBackend(fake, -1).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(CreateCudaBackend(nullptr, 0).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(fake->LiveAllocations() == 0);
}

TEST_CASE("cuda: devices above 7 work and the caller's current device is left alone", "[cuda]") {
  Fixture f(/*devices=*/16, {}, /*device=*/11);
  CHECK(f.backend->name() == "cuda");
  CHECK(f.backend->device() == Device::Cuda(11));
  REQUIRE(f.fake->SetDevice(2) == cudaSuccess);  // the application's own choice
  auto memory = f.backend->Allocate(1 << 20, MemoryKind::kDevice);
  REQUIRE(memory.ok());
  CHECK(f.fake->DeviceOf((*memory)->data()) == 11);
  CHECK((*memory)->device() == Device::Cuda(11));
  CHECK((*memory)->bytes() == size_t{1} << 20);
  auto stream = f.NewStream();
  CHECK(f.fake->DeviceOfStream(f.Native(*stream)) == 11);
  CHECK(f.fake->FlagsOfStream(f.Native(*stream)) == cudaStreamNonBlocking);
  CHECK(f.fake->CurrentDeviceOfThisThread() == 2);
  CHECK(f.fake->primary_contexts_created(0) == 0);
}

// --- Memory -----------------------------------------------------------------

TEST_CASE("cuda: allocation kinds map to cudaMalloc / pinned / mapped host memory", "[cuda]") {
  Fixture f;
  auto device = *f.backend->Allocate(100, MemoryKind::kDevice);
  auto pinned = *f.backend->Allocate(100, MemoryKind::kHostPinned);
  auto mapped = *f.backend->Allocate(100, MemoryKind::kHostMapped);
  CHECK(f.fake->DeviceOf(device->data()) == 0);
  CHECK(f.fake->DeviceOf(pinned->data()) == -1);
  CHECK(f.fake->DeviceOf(mapped->data()) == -1);
  CHECK((f.fake->HostFlagsOf(pinned->data()) & cudaHostAllocMapped) == 0);
  CHECK((f.fake->HostFlagsOf(mapped->data()) & cudaHostAllocMapped) != 0);
  CHECK(pinned->device() == Device::Cpu());
  CHECK(mapped->device() == Device::Cpu());
  auto empty = f.backend->Allocate(0, MemoryKind::kDevice);
  REQUIRE(empty.ok());
  CHECK((*empty)->data() != nullptr);
  const size_t before = f.fake->LiveAllocations();
  device.reset();
  pinned.reset();
  mapped.reset();
  CHECK(f.fake->LiveAllocations() == before - 3);
}

TEST_CASE("cuda: out of memory is RESOURCE_EXHAUSTED naming the call and device", "[cuda]") {
  Fixture f(4, {}, 3);
  f.fake->FailNext("cudaMalloc", cudaErrorMemoryAllocation);
  auto memory = f.backend->Allocate(1 << 30, MemoryKind::kDevice);
  REQUIRE_FALSE(memory.ok());
  CHECK(memory.status().code() == absl::StatusCode::kResourceExhausted);
  const std::string message(memory.status().message());
  CHECK_THAT(message, Catch::Contains("cudaMalloc of 1073741824 bytes on device 3"));
  CHECK_THAT(message, Catch::Contains("cudaErrorMemoryAllocation"));
  CHECK(cuda::CudaErrorFromStatus(memory.status()) == cudaErrorMemoryAllocation);
}

TEST_CASE("cuda: synchronous copy uses unified addressing on the backend's own stream", "[cuda]") {
  Fixture f;
  auto device = *f.backend->Allocate(16, MemoryKind::kDevice);
  const char text[16] = "hello, device";
  char back[16] = {};
  const int async_before = f.fake->Calls("cudaMemcpyAsync");
  REQUIRE(f.backend->Copy(device->data(), text, sizeof(text)).ok());
  REQUIRE(f.backend->Copy(back, device->data(), sizeof(back)).ok());
  CHECK(std::string(back) == "hello, device");
  CHECK(f.fake->Calls("cudaMemcpyAsync") - async_before == 2);
  CHECK(f.fake->Calls("cudaMemcpy") == 0);  // never the legacy default stream
  CHECK(f.backend->Copy(back, device->data(), 0).ok());
}

// --- Error mapping ------------------------------------------------------------

TEST_CASE("cuda: cudaError and CUresult map to canonical status codes", "[cuda]") {
  using absl::StatusCode;
  for (const auto& [error, code] :
       {std::pair{cudaSuccess, StatusCode::kOk},
        {cudaErrorNoDevice, StatusCode::kUnavailable},
        {cudaErrorInsufficientDriver, StatusCode::kUnavailable},
        {cudaErrorMemoryAllocation, StatusCode::kResourceExhausted},
        {cudaErrorInvalidValue, StatusCode::kInvalidArgument},
        {cudaErrorNotSupported, StatusCode::kUnimplemented},
        {cudaErrorStreamCaptureUnsupported, StatusCode::kFailedPrecondition},
        {cudaErrorIllegalAddress, StatusCode::kInternal},
        {cudaErrorLaunchFailure, StatusCode::kInternal}}) {
    INFO(cudaGetErrorName(error));
    CHECK(cuda::CudaErrorCode(error) == code);
  }
  for (const auto& [result, code] :
       {std::pair{CUDA_ERROR_NOT_SUPPORTED, StatusCode::kUnimplemented},
        {CUDA_ERROR_NOT_FOUND, StatusCode::kUnimplemented},
        {CUDA_ERROR_OUT_OF_MEMORY, StatusCode::kResourceExhausted},
        {CUDA_ERROR_ILLEGAL_ADDRESS, StatusCode::kInternal}}) {
    INFO("CUresult " << static_cast<int>(result));
    CHECK(cuda::CuResultCode(result) == code);
  }

  FakeCudaApi fake;
  CHECK(cuda::CudaStatus(fake, cudaSuccess, "x").ok());
  const absl::Status status = cuda::CudaStatus(fake, cudaErrorIllegalAddress, "cudaEventQuery");
  CHECK(status.code() == StatusCode::kInternal);
  CHECK(status.message() == absl::StrCat("cudaEventQuery: cudaErrorIllegalAddress (700): ",
                                         cudaGetErrorString(cudaErrorIllegalAddress)));
  const absl::Status driver = cuda::CuResultStatus(fake, CUDA_ERROR_NOT_SUPPORTED, "memop");
  CHECK(driver.message() == "memop: CUDA_ERROR_NOT_SUPPORTED (801)");
  CHECK(cuda::CudaErrorFromStatus(absl::InternalError("plain")) == -1);
}

// --- Event pool ---------------------------------------------------------------

TEST_CASE("cuda: events come from a pool made up front: reused, never created later", "[cuda]") {
  Fixture f(1, Options(ReadyEventMode::kCudaEvent));
  CHECK(f.fake->Calls("cudaEventCreate") == 2);  // event_pool_size
  for (int step = 0; step < 100; ++step) {
    auto a = f.backend->CreateEvent();
    auto b = f.backend->CreateEvent();
    REQUIRE(a.ok());
    REQUIRE(b.ok());
  }
  CHECK(f.fake->Calls("cudaEventCreate") == 2);
  CHECK(f.fake->Calls("cudaEventDestroy") == 0);
  {
    auto a = *f.backend->CreateEvent();
    auto b = *f.backend->CreateEvent();
    auto c = f.backend->CreateEvent();  // a third live event: the pool is full
    CHECK(c.status().code() == absl::StatusCode::kResourceExhausted);
    CHECK_THAT(std::string(c.status().message()), Catch::Contains("event_pool_size"));
  }
  CHECK(f.fake->Calls("cudaEventCreate") == 2);
  auto again = *f.backend->CreateEvent();
  f.backend.reset();
  CHECK(f.fake->LiveEvents() == 2);  // `again` keeps the pool alive
  again.reset();
  CHECK(f.fake->LiveEvents() == 0);
  CHECK(f.fake->LiveAllocations() == 0);
}

TEST_CASE("cuda: copy-engine events reuse pooled host words, no allocation per step", "[cuda]") {
  Fixture f(1, Options(ReadyEventMode::kCopyEngineFlag));
  const int host_allocs = f.fake->Calls("cudaHostAlloc");
  CHECK(host_allocs == 1);  // one block of words for the whole pool
  auto stream = f.NewStream();
  for (int step = 0; step < 200; ++step) {
    auto event = *f.backend->CreateEvent();
    REQUIRE(event->Record(*stream).ok());
    f.fake->RunAll();
    CHECK(f.Ready(*event));
  }
  CHECK(f.fake->Calls("cudaHostAlloc") == host_allocs);
  CHECK(f.fake->Calls("cudaEventCreate") == 0);
}

TEST_CASE("cuda: a failure while making the event pool fails creation cleanly", "[cuda]") {
  for (const char* call : {"cudaEventCreate", "cudaHostAlloc", "cudaMalloc"}) {
    INFO(call);
    auto fake = std::make_shared<FakeCudaApi>(1);
    fake->FailNext(call, cudaErrorMemoryAllocation);
    const bool events = std::string(call) == "cudaEventCreate";
    auto backend = CreateCudaBackend(
        fake, 0, Options(events ? ReadyEventMode::kCudaEvent : ReadyEventMode::kCopyEngineFlag));
    CHECK(backend.status().code() == absl::StatusCode::kResourceExhausted);
    CHECK(fake->LiveAllocations() == 0);
    CHECK(fake->LiveStreams() == 0);
    CHECK(fake->LiveEvents() == 0);
    CHECK(fake->violations().empty());
  }
}

TEST_CASE("cuda: an event released mid-flight returns to the pool once its copy landed", "[cuda]") {
  CudaBackendOptions options = Options(ReadyEventMode::kCopyEngineFlag);
  options.event_pool_size = 1;
  Fixture f(1, options);
  auto stream = f.NewStream();
  {
    auto event = *f.backend->CreateEvent();
    REQUIRE(event->Record(*stream).ok());
  }
  CHECK(f.backend->CreateEvent().status().code() == absl::StatusCode::kResourceExhausted);
  f.fake->RunAll();
  auto reused = f.backend->CreateEvent();
  REQUIRE(reused.ok());
  CHECK(f.Ready(**reused));  // starts as never recorded
}

// --- Ready events, both modes ---------------------------------------------------

TEST_CASE("cuda: CUDA-event mode: Record enqueues cudaEventRecord, Query polls cudaEventQuery",
          "[cuda]") {
  Fixture f(1, Options(ReadyEventMode::kCudaEvent));
  auto stream = f.NewStream();
  auto event = *f.backend->CreateEvent();
  CHECK(f.Ready(*event));  // never recorded
  auto device = *f.backend->Allocate(64, MemoryKind::kDevice);
  auto host = *f.backend->Allocate(64, MemoryKind::kHostPinned);
  REQUIRE(stream->CopyAsync(host->data(), device->data(), 64).ok());
  REQUIRE(event->Record(*stream).ok());
  CHECK(f.fake->PendingNames(f.Native(*stream)) ==
        std::vector<std::string>{"memcpy", "event_record"});
  CHECK_FALSE(f.Ready(*event));
  CHECK(event->Wait(absl::Milliseconds(5)).code() == absl::StatusCode::kDeadlineExceeded);
  f.fake->RunAll();
  CHECK(f.Ready(*event));
  REQUIRE(event->Wait(absl::Milliseconds(5)).ok());
  CHECK(f.fake->Calls("cudaEventQuery") > 0);
  CHECK(f.fake->Calls("cudaMemcpyAsync") == 1);  // nothing but the user's copy
}

TEST_CASE("cuda: copy-engine mode: Record is a 4-byte D2H copy, Query is a host load", "[cuda]") {
  Fixture f(1, Options(ReadyEventMode::kCopyEngineFlag));
  auto stream = f.NewStream();
  auto event = *f.backend->CreateEvent();
  CHECK(f.Ready(*event));
  for (int round = 0; round < 3; ++round) {
    REQUIRE(stream->LaunchHostFunc([] {}).ok());
    REQUIRE(event->Record(*stream).ok());
    CHECK(f.fake->PendingNames(f.Native(*stream)) ==
          std::vector<std::string>{"host_func", "memcpy"});
    CHECK_FALSE(f.Ready(*event));
    f.fake->RunAll();
    CHECK(f.Ready(*event));
  }
  // Two records in flight: ready only once the second copy has landed.
  REQUIRE(event->Record(*stream).ok());
  REQUIRE(stream->LaunchHostFunc([] {}).ok());
  REQUIRE(event->Record(*stream).ok());
  CHECK_FALSE(f.Ready(*event));
  CHECK(f.fake->Calls("cudaEventRecord") == 0);
  CHECK(f.fake->Calls("cudaEventQuery") == 0);
  f.fake->RunAll();
  CHECK(f.Ready(*event));
}

TEST_CASE("cuda: Event::Wait returns as soon as another thread's stream work lands", "[cuda]") {
  for (ReadyEventMode mode : {ReadyEventMode::kCopyEngineFlag, ReadyEventMode::kCudaEvent}) {
    Fixture f(1, Options(mode));
    auto stream = f.NewStream();
    auto event = *f.backend->CreateEvent();
    REQUIRE(event->Record(*stream).ok());
    std::thread gpu([&] {
      absl::SleepFor(absl::Milliseconds(20));
      f.fake->RunAll();
    });
    CHECK(event->Wait(absl::Seconds(10)).ok());
    gpu.join();
  }
}

TEST_CASE("cuda: a released pooled event starts as never-recorded for its next owner", "[cuda]") {
  for (ReadyEventMode mode : {ReadyEventMode::kCopyEngineFlag, ReadyEventMode::kCudaEvent}) {
    Fixture f(1, Options(mode));
    auto stream = f.NewStream();
    {
      auto event = *f.backend->CreateEvent();
      REQUIRE(event->Record(*stream).ok());  // dropped while pending
    }
    auto reused = *f.backend->CreateEvent();
    CHECK(f.Ready(*reused));
    REQUIRE(reused->Record(*stream).ok());
    CHECK_FALSE(f.Ready(*reused));
    f.fake->RunAll();
    CHECK(f.Ready(*reused));
  }
}

TEST_CASE("cuda: copy-engine event pending on one stream cannot move to another", "[cuda]") {
  Fixture f(1, Options(ReadyEventMode::kCopyEngineFlag));
  auto first = f.NewStream();
  auto second = f.NewStream();
  auto event = *f.backend->CreateEvent();
  REQUIRE(event->Record(*first).ok());
  CHECK(event->Record(*second).code() == absl::StatusCode::kFailedPrecondition);
  f.fake->RunAll();
  REQUIRE(event->Record(*second).ok());  // fine once the first record landed
  f.fake->RunAll();
  CHECK(f.Ready(*event));
}

TEST_CASE("cuda: events and flags reject objects of another backend", "[cuda]") {
  Fixture f;
  auto mock = CreateCpuMockBackend();
  auto mock_stream = *mock->CreateStream();
  auto mock_flag = *mock->CreateHostFlag();
  auto event = *f.backend->CreateEvent();
  CHECK(event->Record(*mock_stream).code() == absl::StatusCode::kInvalidArgument);
  auto stream = f.NewStream();
  CHECK(stream->WaitHostFlag(*mock_flag, 1).code() == absl::StatusCode::kInvalidArgument);
  CHECK(stream->SignalHostFlag(*mock_flag, 1).code() == absl::StatusCode::kInvalidArgument);
  CHECK(NativeCudaStream(*mock_stream).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("cuda: a failed record reports the CUDA error and leaves the event unrecorded",
          "[cuda]") {
  Fixture f(1, Options(ReadyEventMode::kCopyEngineFlag));
  auto stream = f.NewStream();
  auto event = *f.backend->CreateEvent();
  f.fake->FailNext("cudaMemcpyAsync", cudaErrorLaunchFailure);
  const absl::Status status = event->Record(*stream);
  CHECK(status.code() == absl::StatusCode::kInternal);
  CHECK_THAT(std::string(status.message()), Catch::Contains("ready flag"));
  CHECK(f.Ready(*event));
}

// --- GPU waits on host flags ------------------------------------------------------

// Enqueues wait(flag >= 5) then a copy and checks the copy runs only after the
// flag reaches 5. Returns the names of what was enqueued for the wait.
std::vector<std::string> CheckWaitOrdering(Fixture& f) {
  auto stream = f.NewStream();
  auto flag = *f.backend->CreateHostFlag();
  auto device = *f.backend->Allocate(8, MemoryKind::kDevice);
  auto host = *f.backend->Allocate(8, MemoryKind::kHostPinned);
  const uint64_t payload = 0x1234'5678'9abc'def0;
  REQUIRE(f.backend->Copy(device->data(), &payload, sizeof(payload)).ok());
  std::memset(host->data(), 0, 8);
  REQUIRE(stream->WaitHostFlag(*flag, 5).ok());
  auto names = f.fake->PendingNames(f.Native(*stream));
  REQUIRE(stream->CopyAsync(host->data(), device->data(), 8).ok());
  f.fake->RunAll();
  CHECK(*static_cast<uint64_t*>(host->data()) == 0);
  flag->Store(4);
  f.fake->RunAll();
  CHECK(*static_cast<uint64_t*>(host->data()) == 0);
  CHECK(stream->Synchronize(absl::Milliseconds(5)).code() == absl::StatusCode::kDeadlineExceeded);
  flag->Store(5);
  f.fake->RunAll();
  CHECK(*static_cast<uint64_t*>(host->data()) == payload);
  CHECK(stream->Synchronize(absl::Seconds(1)).ok());
  return names;
}

TEST_CASE("cuda: WaitHostFlag uses cuStreamWaitValue32(GEQ) on the flag's device alias", "[cuda]") {
  Fixture f;
  CHECK(CheckWaitOrdering(f) == std::vector<std::string>{"wait_value"});
  REQUIRE(f.fake->memops().size() == 1);
  const auto op = f.fake->memops()[0];
  CHECK(op.name == "wait");
  CHECK(op.value == 5);
  CHECK(op.flags == CU_STREAM_WAIT_VALUE_GEQ);
  CHECK(op.address >= FakeCudaApi::kAliasOffset);  // the alias, not the host pointer
  CHECK(f.fake->Calls("wait_kernel") == 0);
}

TEST_CASE("cuda: WaitHostFlag falls back to the wait kernel without stream memory ops", "[cuda]") {
  auto fake = std::make_shared<FakeCudaApi>(12);
  fake->set_has_stream_memops(false);
  Fixture f(fake, 9);
  REQUIRE(f.fake->SetDevice(1) == cudaSuccess);  // kernel launch must switch to 9 and back
  CHECK(CheckWaitOrdering(f) == std::vector<std::string>{"wait_kernel"});
  CHECK(f.fake->memops().empty());
  CHECK(f.fake->Calls("cuStreamWaitValue32") == 0);
  CHECK(f.fake->CurrentDeviceOfThisThread() == 1);
}

TEST_CASE("cuda: StreamWaitMode::kKernel always launches the kernel", "[cuda]") {
  Fixture f(1, Options(ReadyEventMode::kCopyEngineFlag, StreamWaitMode::kKernel));
  CHECK(CheckWaitOrdering(f) == std::vector<std::string>{"wait_kernel"});
  CHECK(f.fake->Calls("cuStreamWaitValue32") == 0);
}

TEST_CASE("cuda: kAuto uses the kernels while the stream is being captured, and replays work",
          "[cuda]") {
  Fixture f;
  auto stream = f.NewStream();
  auto flag = *f.backend->CreateHostFlag();
  auto done = *f.backend->CreateHostFlag();
  REQUIRE(f.fake->BeginCapture(f.Native(*stream), cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(stream->WaitHostFlag(*flag, 1).ok());
  REQUIRE(stream->SignalHostFlag(*done, 2).ok());
  CHECK(f.fake->CapturedNames(f.Native(*stream)) ==
        std::vector<std::string>{"wait_kernel", "signal_kernel"});
  CHECK(f.fake->Pending(f.Native(*stream)) == 0);  // captured, not run
  CHECK(f.fake->memops().empty());
  // Host functions would be freed after their first replay: refused.
  CHECK(stream->LaunchHostFunc([] {}).code() == absl::StatusCode::kFailedPrecondition);
  FakeCudaApi::Graph graph;
  REQUIRE(f.fake->EndCapture(f.Native(*stream), &graph) == cudaSuccess);
  auto replay = f.NewStream();
  for (int round = 0; round < 3; ++round) {
    done->Store(0);
    REQUIRE(f.fake->LaunchGraph(graph, f.Native(*replay)) == cudaSuccess);
    f.fake->RunAll();
    CHECK(done->Load() == (round == 0 ? 0u : 2u));  // the gate opens after the first replay
    flag->Store(1);
    f.fake->RunAll();
    CHECK(done->Load() == 2);
  }
  REQUIRE(stream->WaitHostFlag(*flag, 3).ok());  // not capturing: the memop again
  CHECK(f.fake->memops().size() == 1);
  flag->Store(3);
  f.fake->RunAll();
}

TEST_CASE("cuda: kStreamMemOp without driver support is UNIMPLEMENTED", "[cuda]") {
  auto fake = std::make_shared<FakeCudaApi>(1);
  fake->set_has_stream_memops(false);
  auto backend = *CreateCudaBackend(
      fake, 0, Options(ReadyEventMode::kCopyEngineFlag, StreamWaitMode::kStreamMemOp));
  auto stream = *backend->CreateStream();
  auto flag = *backend->CreateHostFlag();
  const absl::Status status = stream->WaitHostFlag(*flag, 1);
  CHECK(status.code() == absl::StatusCode::kUnimplemented);
  CHECK_THAT(std::string(status.message()), Catch::Contains("cuStreamWaitValue32"));
  CHECK(fake->Calls("wait_kernel") == 0);
  CHECK(fake->violations().empty());
}

TEST_CASE("cuda: kAuto switches to kernels for good when the driver refuses memops", "[cuda]") {
  Fixture f;
  auto stream = f.NewStream();
  auto flag = *f.backend->CreateHostFlag();
  f.fake->FailNextDriver("cuStreamWaitValue32", CUDA_ERROR_NOT_SUPPORTED);
  REQUIRE(stream->WaitHostFlag(*flag, 1).ok());
  REQUIRE(stream->WaitHostFlag(*flag, 2).ok());
  REQUIRE(stream->SignalHostFlag(*flag, 3).ok());
  CHECK(f.fake->Calls("cuStreamWaitValue32") == 1);
  CHECK(f.fake->Calls("cuStreamWriteValue32") == 0);
  CHECK(f.fake->PendingNames(f.Native(*stream)) ==
        std::vector<std::string>{"wait_kernel", "wait_kernel", "signal_kernel"});
}

TEST_CASE("cuda: kStreamMemOp surfaces driver errors instead of falling back", "[cuda]") {
  Fixture f(1, Options(ReadyEventMode::kCopyEngineFlag, StreamWaitMode::kStreamMemOp));
  auto stream = f.NewStream();
  auto flag = *f.backend->CreateHostFlag();
  f.fake->FailNextDriver("cuStreamWaitValue32", CUDA_ERROR_NOT_SUPPORTED);
  const absl::Status status = stream->WaitHostFlag(*flag, 1);
  CHECK(status.code() == absl::StatusCode::kUnimplemented);
  CHECK_THAT(std::string(status.message()), Catch::Contains("CUDA_ERROR_NOT_SUPPORTED"));
  CHECK(f.fake->Calls("wait_kernel") == 0);
}

TEST_CASE("cuda: flush_remote_writes adds CU_STREAM_WAIT_VALUE_FLUSH", "[cuda]") {
  Fixture f(cuda::testing::FlushCapableDevice(), 0, cuda::testing::FlushRemoteWrites());
  auto stream = f.NewStream();
  auto flag = *f.backend->CreateHostFlag();
  REQUIRE(stream->WaitHostFlag(*flag, 1).ok());
  REQUIRE(f.fake->memops().size() == 1);
  CHECK(f.fake->memops()[0].flags == (CU_STREAM_WAIT_VALUE_GEQ | CU_STREAM_WAIT_VALUE_FLUSH));
}

TEST_CASE("cuda: flag waits compare cyclically, as CU_STREAM_WAIT_VALUE_GEQ does", "[cuda]") {
  for (StreamWaitMode mode : {StreamWaitMode::kStreamMemOp, StreamWaitMode::kKernel}) {
    Fixture f(1, Options(ReadyEventMode::kCopyEngineFlag, mode));
    auto stream = f.NewStream();
    auto flag = *f.backend->CreateHostFlag();
    auto done = *f.backend->CreateHostFlag();
    flag->Store(0xFFFF'FFF0u);
    REQUIRE(stream->WaitHostFlag(*flag, 0xFFFF'FFF8u).ok());
    REQUIRE(stream->SignalHostFlag(*done, 1).ok());
    f.fake->RunAll();
    CHECK(done->Load() == 0);
    flag->Store(3);  // wrapped past the target
    f.fake->RunAll();
    CHECK(done->Load() == 1);
  }
}

TEST_CASE("cuda: SignalHostFlag writes after earlier work, via memop or kernel", "[cuda]") {
  for (StreamWaitMode mode : {StreamWaitMode::kAuto, StreamWaitMode::kKernel}) {
    Fixture f(1, Options(ReadyEventMode::kCopyEngineFlag, mode));
    auto stream = f.NewStream();
    auto flag = *f.backend->CreateHostFlag();
    CHECK(flag->Load() == 0);
    std::atomic<int> ran{0};
    REQUIRE(stream->LaunchHostFunc([&] { ran = 1; }).ok());
    REQUIRE(stream->SignalHostFlag(*flag, 42).ok());
    CHECK(flag->Load() == 0);
    f.fake->RunAll();
    CHECK(ran == 1);
    CHECK(flag->Load() == 42);
    if (mode == StreamWaitMode::kAuto) {
      REQUIRE(f.fake->memops().size() == 1);
      CHECK(f.fake->memops()[0].flags == CU_STREAM_WRITE_VALUE_DEFAULT);
    } else {
      CHECK(f.fake->Calls("signal_kernel") == 1);
    }
  }
}

TEST_CASE("cuda: LaunchHostFunc runs in stream order and frees the closure on failure", "[cuda]") {
  Fixture f;
  auto stream = f.NewStream();
  std::vector<int> order;
  auto token = std::make_shared<int>(0);
  REQUIRE(stream->LaunchHostFunc([&order, token] { order.push_back(1); }).ok());
  REQUIRE(stream->LaunchHostFunc([&order] { order.push_back(2); }).ok());
  CHECK(token.use_count() == 2);
  f.fake->RunAll();
  CHECK(order == std::vector<int>{1, 2});
  CHECK(token.use_count() == 1);  // run once, then freed
  f.fake->FailNext("cudaLaunchHostFunc", cudaErrorInvalidResourceHandle);
  CHECK_FALSE(stream->LaunchHostFunc([token] {}).ok());
  CHECK(token.use_count() == 1);
}

TEST_CASE("cuda: a wrapped external stream is used but not destroyed", "[cuda]") {
  Fixture f;
  cudaStream_t external = nullptr;
  REQUIRE(f.fake->StreamCreateWithFlags(&external, 0) == cudaSuccess);
  {
    auto wrapped = WrapCudaStream(*f.backend, external);
    REQUIRE(wrapped.ok());
    auto event = *f.backend->CreateEvent();
    REQUIRE(event->Record(**wrapped).ok());
    CHECK(f.fake->Pending(external) == 1);
  }
  CHECK(f.fake->Calls("cudaStreamDestroy") == 0);
  auto mock = CreateCpuMockBackend();
  CHECK(WrapCudaStream(*mock, external).status().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(f.fake->StreamDestroy(external) == cudaSuccess);
}

// --- Locate and dma-buf -----------------------------------------------------------

TEST_CASE("cuda: Locate reports device, lower-case PCI id and sysfs NUMA node", "[cuda]") {
  const std::filesystem::path root =
      std::filesystem::temp_directory_path() / ("stepmesh_sysfs_" + std::to_string(getpid()));
  std::filesystem::create_directories(root / "bus/pci/devices/0000:19:00.0");
  std::ofstream(root / "bus/pci/devices/0000:19:00.0/numa_node") << "1\n";
  CudaBackendOptions options;
  options.sysfs_root = root.string();
  Fixture f(12, options, 9);
  auto device = *f.backend->Allocate(4096, MemoryKind::kDevice);
  auto location = f.backend->Locate(static_cast<char*>(device->data()) + 100);
  REQUIRE(location.ok());
  CHECK(location->device == Device::Cuda(9));
  CHECK(location->pci_bus_id == "0000:19:00.0");
  CHECK(location->numa_node == 1);
  auto again = f.backend->Locate(device->data());
  CHECK(f.fake->Calls("cudaDeviceGetPCIBusId") == 1);  // cached per device

  auto pinned = *f.backend->Allocate(64, MemoryKind::kHostPinned);
  int on_stack = 0;
  for (const void* host :
       {static_cast<const void*>(pinned->data()), static_cast<const void*>(&on_stack)}) {
    auto where = f.backend->Locate(host);
    REQUIRE(where.ok());
    CHECK(where->device == Device::Cpu());
    CHECK(where->numa_node == -1);
    CHECK(where->pci_bus_id.empty());
  }
  std::filesystem::remove_all(root);
}

TEST_CASE("cuda: Locate without a sysfs entry gives NUMA -1", "[cuda]") {
  CudaBackendOptions options;
  options.sysfs_root = "/nonexistent-stepmesh-sysfs";
  Fixture f(1, options);
  auto device = *f.backend->Allocate(64, MemoryKind::kDevice);
  auto location = *f.backend->Locate(device->data());
  CHECK(location.numa_node == -1);
  CHECK(location.pci_bus_id == "0000:10:00.0");
}

TEST_CASE("cuda: ExportDmabuf exports the page-aligned range and the offset into it", "[cuda]") {
  Fixture f;
  auto device = *f.backend->Allocate(3 * 4096, MemoryKind::kDevice);
  char* base = static_cast<char*>(device->data());
  uint64_t offset = 0;
  auto fd = f.backend->ExportDmabuf(base + 100, 5000, &offset);
  REQUIRE(fd.ok());
  CHECK(*fd >= 0);
  ::close(*fd);
  CHECK(offset == 100);
  REQUIRE(f.fake->exported_ranges().size() == 1);
  CHECK(f.fake->exported_ranges()[0].first == reinterpret_cast<uintptr_t>(base));
  CHECK(f.fake->exported_ranges()[0].second == 8192);  // covers [100, 5100)

  auto pinned = *f.backend->Allocate(64, MemoryKind::kHostPinned);
  CHECK(f.backend->ExportDmabuf(pinned->data(), 64, &offset).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(f.backend->ExportDmabuf(base, 0, &offset).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(f.backend->ExportDmabuf(base, 64, nullptr).status().code() ==
        absl::StatusCode::kInvalidArgument);
  f.fake->FailNextDriver("cuMemGetHandleForAddressRange", CUDA_ERROR_NOT_SUPPORTED);
  CHECK(f.backend->ExportDmabuf(base, 64, &offset).status().code() ==
        absl::StatusCode::kUnimplemented);
}

TEST_CASE("cuda: ExportDmabuf is UNIMPLEMENTED when the driver lacks the entry point", "[cuda]") {
  Fixture f;
  f.fake->set_has_dmabuf(false);
  auto device = *f.backend->Allocate(4096, MemoryKind::kDevice);
  uint64_t offset = 0;
  CHECK(f.backend->ExportDmabuf(device->data(), 4096, &offset).status().code() ==
        absl::StatusCode::kUnimplemented);
}

TEST_CASE("cuda: device allocations are whole pages, so any export stays inside one", "[cuda]") {
  Fixture f;
  auto device = *f.backend->Allocate(5000, MemoryKind::kDevice);
  CHECK(device->bytes() == 5000);
  uint64_t offset = 0;
  auto fd = f.backend->ExportDmabuf(static_cast<char*>(device->data()) + 4000, 1000, &offset);
  REQUIRE(fd.ok());  // the range rounds up to 8192: still this allocation
  ::close(*fd);
  CHECK(offset == 4000);
}

TEST_CASE("cuda: FlushRemoteWrites flushes only where the GPU needs and allows it", "[cuda]") {
  SECTION("writes not ordered, host flush available: one flush per call, on the device") {
    auto fake = std::make_shared<FakeCudaApi>(4);
    fake->set_attribute(cudaDevAttrGPUDirectRDMAFlushWritesOptions,
                        cudaFlushGPUDirectRDMAWritesOptionHost);
    Fixture f(fake, 3);
    REQUIRE(f.fake->SetDevice(1) == cudaSuccess);
    CHECK(f.backend->FlushRemoteWrites().ok());
    CHECK(f.backend->FlushRemoteWrites().ok());
    CHECK(f.fake->Calls("cudaDeviceFlushGPUDirectRDMAWrites") == 2);
    CHECK(f.fake->Calls("cudaDeviceGetAttribute") == 2);  // probed once
    CHECK(f.fake->CurrentDeviceOfThisThread() == 1);
  }
  SECTION("writes ordered for the owner: nothing to do") {
    auto fake = std::make_shared<FakeCudaApi>(1);
    fake->set_attribute(cudaDevAttrGPUDirectRDMAWritesOrdering,
                        cudaGPUDirectRDMAWritesOrderingOwner);
    Fixture f(fake, 0);
    CHECK(f.backend->FlushRemoteWrites().ok());
    CHECK(f.fake->Calls("cudaDeviceFlushGPUDirectRDMAWrites") == 0);
  }
  SECTION("neither: FAILED_PRECONDITION naming the way out, no flush call") {
    Fixture f;
    const absl::Status status = f.backend->FlushRemoteWrites();
    CHECK(status.code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(status.message()), Catch::Contains("STEPMESH_RDMA_GPUDIRECT=off"));
    CHECK(f.fake->Calls("cudaDeviceFlushGPUDirectRDMAWrites") == 0);
  }
  SECTION("a failing probe is reported") {
    auto fake = std::make_shared<FakeCudaApi>(1);
    fake->FailNext("cudaDeviceGetAttribute", cudaErrorInvalidDevice);
    Fixture f(fake, 0);
    CHECK(!f.backend->FlushRemoteWrites().ok());
  }
}

TEST_CASE("cuda: WaitHostFlagNext in a captured graph waits for one new increment per replay",
          "[cuda]") {
  Fixture f;
  auto capture = f.NewStream();
  auto replay = f.NewStream();
  auto counter = *f.backend->CreateHostFlag();
  auto cursor = *f.backend->CreateHostFlag();
  auto done = *f.backend->CreateHostFlag();
  REQUIRE(f.fake->BeginCapture(f.Native(*capture), cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(capture->WaitHostFlagNext(*counter, *cursor).ok());
  REQUIRE(capture->SignalHostFlag(*done, 1).ok());
  FakeCudaApi::Graph graph;
  REQUIRE(f.fake->EndCapture(f.Native(*capture), &graph) == cudaSuccess);
  CHECK(f.fake->memops().empty());
  for (uint32_t step = 1; step <= 100; ++step) {
    done->Store(0);
    REQUIRE(f.fake->LaunchGraph(graph, f.Native(*replay)) == cudaSuccess);
    f.fake->RunAll();
    CHECK(done->Load() == 0);  // this replay waits for the next arrival
    counter->Store(step);
    f.fake->RunAll();
    CHECK(done->Load() == 1);
    CHECK(cursor->Load() == step);
  }
}

TEST_CASE("cuda: WaitCounterAtLeast in a captured graph reads both words at every replay",
          "[cuda]") {
  Fixture f;
  auto capture = f.NewStream();
  auto replay = f.NewStream();
  auto counter_mem = *f.backend->Allocate(sizeof(int64_t), MemoryKind::kHostMapped);
  auto target_mem = *f.backend->Allocate(sizeof(int64_t), MemoryKind::kHostMapped);
  auto* counter = static_cast<int64_t*>(counter_mem->data());
  auto* target = static_cast<int64_t*>(target_mem->data());
  auto done = *f.backend->CreateHostFlag();
  REQUIRE(f.fake->BeginCapture(f.Native(*capture), cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(capture->WaitCounterAtLeast(counter, target).ok());
  REQUIRE(capture->SignalHostFlag(*done, 1).ok());
  FakeCudaApi::Graph graph;
  REQUIRE(f.fake->EndCapture(f.Native(*capture), &graph) == cudaSuccess);
  CHECK(f.fake->KernelLoaded(0, "wait_counter_kernel"));  // loaded with the backend
  for (int64_t step = 1; step <= 20; ++step) {
    done->Store(0);
    std::atomic_ref<int64_t>(*target).store(step);  // StepMesh's seq_add_one
    REQUIRE(f.fake->LaunchGraph(graph, f.Native(*replay)) == cudaSuccess);
    f.fake->RunAll();
    CHECK(done->Load() == 0);  // counter step - 1 < target step
    std::atomic_ref<int64_t>(*counter).store(step);
    f.fake->RunAll();
    CHECK(done->Load() == 1);
  }
  // Pageable memory is refused, naming the word.
  int64_t on_stack = 0;
  const absl::Status refused = replay->WaitCounterAtLeast(&on_stack, target);
  CHECK(absl::IsInvalidArgument(refused));
  CHECK_THAT(std::string(refused.message()), Catch::Contains("counter is pageable"));
}

TEST_CASE("cuda: a captured go increment and done wait post once per replay", "[cuda]") {
  // The device-triggered send of docs/cuda.md: the graph bumps `go` and then
  // waits until a host trigger has made `done` catch up, at every replay.
  Fixture f;
  auto capture = f.NewStream();
  auto replay = f.NewStream();
  auto words = *f.backend->Allocate(2 * sizeof(int64_t), MemoryKind::kHostMapped);
  auto* go = static_cast<int64_t*>(words->data());
  auto* done = go + 1;
  *go = *done = 0;  // the allocation starts with garbage
  auto after = *f.backend->CreateHostFlag();
  REQUIRE(f.fake->BeginCapture(f.Native(*capture), cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(capture->IncrementCounter(go).ok());
  REQUIRE(capture->WaitCounterAtLeast(done, go).ok());
  REQUIRE(capture->SignalHostFlag(*after, 1).ok());
  FakeCudaApi::Graph graph;
  REQUIRE(f.fake->EndCapture(f.Native(*capture), &graph) == cudaSuccess);
  CHECK(std::atomic_ref<int64_t>(*go).load() == 0);            // captured, not run
  CHECK(f.fake->KernelLoaded(0, "increment_counter_kernel"));  // loaded with the backend
  for (int64_t step = 1; step <= 100; ++step) {
    after->Store(0);
    REQUIRE(f.fake->LaunchGraph(graph, f.Native(*replay)) == cudaSuccess);
    f.fake->RunAll();
    REQUIRE(std::atomic_ref<int64_t>(*go).load() == step);  // one increment per replay
    CHECK(after->Load() == 0);                    // done (step - 1) < go (step): the stream waits
    std::atomic_ref<int64_t>(*done).store(step);  // the trigger posted and completed
    f.fake->RunAll();
    CHECK(after->Load() == 1);
  }
  int64_t on_stack = 0;
  const absl::Status refused = replay->IncrementCounter(&on_stack);
  CHECK(absl::IsInvalidArgument(refused));
  CHECK_THAT(std::string(refused.message()), Catch::Contains("IncrementCounter: the counter"));
  CHECK(absl::IsInvalidArgument(replay->IncrementCounter(nullptr)));
  CHECK(absl::IsUnimplemented(replay->BeginCapture()));  // CUDA captures with CUDA itself
}

TEST_CASE("cuda: counter kernels and event records run on the backend's device, not the caller's",
          "[cuda]") {
  // A multi-GPU host: the backend drives device 1 while the calling thread
  // (vLLM's capturing thread, say) has device 0 current. A kernel launch
  // into a device-1 stream then fails, and handle 0 is device 0's legacy
  // stream, where a device-1 event cannot be recorded.
  for (ReadyEventMode mode : {ReadyEventMode::kCudaEvent, ReadyEventMode::kCopyEngineFlag}) {
    Fixture f(/*devices=*/2, Options(mode), /*device=*/1);
    // The ops queued on `device`'s legacy stream (the fake resolves handle 0
    // by the calling thread's current device).
    auto legacy_pending = [&](int device) {
      REQUIRE(f.fake->SetDevice(device) == cudaSuccess);
      std::vector<std::string> names = f.fake->PendingNames(nullptr);
      REQUIRE(f.fake->SetDevice(0) == cudaSuccess);
      return names;
    };
    auto stream = f.NewStream();
    auto legacy = *WrapCudaStream(*f.backend, nullptr);
    auto words = *f.backend->Allocate(2 * sizeof(int64_t), MemoryKind::kHostMapped);
    auto* go = static_cast<int64_t*>(words->data());
    auto* done = go + 1;
    *go = *done = 0;
    REQUIRE(f.fake->SetDevice(0) == cudaSuccess);  // the application's own choice

    CHECK(stream->IncrementCounter(go).ToString() == "OK");
    CHECK(stream->WaitCounterAtLeast(done, go).ToString() == "OK");
    CHECK(f.fake->PendingNames(f.Native(*stream)) ==
          std::vector<std::string>{"increment_counter_kernel", "wait_counter_kernel"});
    CHECK(legacy->IncrementCounter(done).ToString() == "OK");
    CHECK(legacy_pending(1) == std::vector<std::string>{"increment_counter_kernel"});
    CHECK(legacy_pending(0).empty());

    auto on_stream = *f.backend->CreateEvent();
    auto on_legacy = *f.backend->CreateEvent();
    CHECK(on_stream->Record(*stream).ToString() == "OK");
    CHECK(RecordOnCudaStream(*on_legacy, nullptr).ToString() == "OK");
    const std::string record = mode == ReadyEventMode::kCudaEvent ? "event_record" : "memcpy";
    CHECK(f.fake->PendingNames(f.Native(*stream)).back() == record);
    CHECK(legacy_pending(1) == std::vector<std::string>{"increment_counter_kernel", record});
    CHECK(legacy_pending(0).empty());
    CHECK(f.fake->CurrentDeviceOfThisThread() == 0);  // the caller's device, restored

    f.fake->RunAll();
    CHECK(std::atomic_ref<int64_t>(*go).load() == 1);
    CHECK(std::atomic_ref<int64_t>(*done).load() == 1);
    CHECK(f.Ready(*on_stream));
    CHECK(f.Ready(*on_legacy));
  }
}

TEST_CASE("cuda: WaitHostFlagNext outside graphs, and released for shutdown", "[cuda]") {
  Fixture f(1, Options(ReadyEventMode::kCopyEngineFlag, StreamWaitMode::kKernel));
  auto stream = f.NewStream();
  auto counter = *f.backend->CreateHostFlag();
  auto cursor = *f.backend->CreateHostFlag();
  counter->Store(1);  // one arrival already there
  REQUIRE(stream->WaitHostFlagNext(*counter, *cursor).ok());
  REQUIRE(stream->WaitHostFlagNext(*counter, *cursor).ok());
  REQUIRE(stream->WaitHostFlagNext(*counter, *cursor).ok());
  f.fake->RunAll();
  CHECK(cursor->Load() == 1);
  CHECK(f.fake->Pending(f.Native(*stream)) == 2);
  counter->ReleaseWaiters();  // nothing more will come
  f.fake->RunAll();
  CHECK(f.fake->Pending(f.Native(*stream)) == 0);
  CHECK(cursor->Load() == 3);
  CudaBackendOptions memop_only;
  memop_only.stream_wait_mode = StreamWaitMode::kStreamMemOp;
  Fixture g(1, memop_only);
  auto other = g.NewStream();
  auto c = *g.backend->CreateHostFlag();
  auto d = *g.backend->CreateHostFlag();
  CHECK(other->WaitHostFlagNext(*c, *d).code() == absl::StatusCode::kFailedPrecondition);
}

// --- Options and the public interop calls ---------------------------------------------

TEST_CASE("cuda: options the device cannot honour, or nonsense, fail creation", "[cuda]") {
  auto fake = std::make_shared<FakeCudaApi>(1);
  CudaBackendOptions negative;
  negative.event_pool_size = -1;
  CHECK(CreateCudaBackend(fake, 0, negative).status().code() == absl::StatusCode::kInvalidArgument);
  CudaBackendOptions interval;
  interval.fault_check_interval = absl::ZeroDuration();
  CHECK(CreateCudaBackend(fake, 0, interval).status().code() == absl::StatusCode::kInvalidArgument);
  CudaBackendOptions one_queue;
  one_queue.stream_wait_mode = StreamWaitMode::kStreamMemOp;
  one_queue.device_max_connections = 1;
  CHECK(CreateCudaBackend(fake, 0, one_queue).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  CudaBackendOptions flush_kernel;
  flush_kernel.flush_remote_writes = true;
  flush_kernel.stream_wait_mode = StreamWaitMode::kKernel;
  fake->set_attribute(cudaDevAttrCanFlushRemoteWrites, 1);
  CHECK(CreateCudaBackend(fake, 0, flush_kernel).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(fake->LiveStreams() == 0);
  CHECK(fake->violations().empty());
}

TEST_CASE("cuda: with one hardware queue kAuto waits with the kernel", "[cuda]") {
  CudaBackendOptions options;
  options.device_max_connections = 1;
  Fixture f(1, options);
  CHECK(CheckWaitOrdering(f) == std::vector<std::string>{"wait_kernel"});
  CHECK(f.fake->Calls("cuStreamWaitValue32") == 0);
}

TEST_CASE("cuda: high_priority_streams = false leaves CreateStream's streams at the default",
          "[cuda]") {
  CudaBackendOptions options;
  options.high_priority_streams = false;
  Fixture f(1, options);
  auto stream = f.NewStream();
  CHECK(f.fake->PriorityOfStream(f.Native(*stream)) == 0);
}

TEST_CASE("cuda: the flag kernels are loaded when the backend is made", "[cuda]") {
  auto fake = std::make_shared<FakeCudaApi>(3);
  Fixture f(fake, 2);
  CHECK(f.fake->KernelLoaded(2, "wait_kernel"));
  CHECK(f.fake->KernelLoaded(2, "signal_kernel"));
  CHECK(f.fake->KernelLoaded(2, "wait_next_kernel"));
  CHECK_FALSE(f.fake->KernelLoaded(0, "wait_kernel"));
}

TEST_CASE("cuda: PreloadCudaKernels loads an application's kernels on the backend's device",
          "[cuda]") {
  auto fake = std::make_shared<FakeCudaApi>(2);
  Fixture f(fake, 1);
  static int kernel_a, kernel_b;  // stand-ins for __global__ functions' host stubs
  const void* kernels[] = {&kernel_a, &kernel_b};
  REQUIRE(PreloadCudaKernels(*f.backend, kernels).ok());
  CHECK(f.fake->KernelLoaded(1, FakeCudaApi::KernelName(&kernel_a)));
  CHECK(f.fake->KernelLoaded(1, FakeCudaApi::KernelName(&kernel_b)));
  const void* null_kernel[] = {nullptr};
  CHECK_FALSE(PreloadCudaKernels(*f.backend, null_kernel).ok());
  auto mock = CreateCpuMockBackend();
  CHECK(PreloadCudaKernels(*mock, kernels).code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("cuda: RecordOnCudaStream records on a native stream, the legacy one included",
          "[cuda]") {
  for (ReadyEventMode mode : {ReadyEventMode::kCopyEngineFlag, ReadyEventMode::kCudaEvent}) {
    Fixture f(1, Options(mode));
    cudaStream_t native = nullptr;
    REQUIRE(f.fake->StreamCreateWithFlags(&native, cudaStreamNonBlocking) == cudaSuccess);
    for (cudaStream_t stream : {native, static_cast<cudaStream_t>(nullptr)}) {
      auto event = *f.backend->CreateEvent();
      REQUIRE(RecordOnCudaStream(*event, stream).ok());
      CHECK_FALSE(f.Ready(*event));
      f.fake->RunAll();
      CHECK(f.Ready(*event));
    }
    auto mock = CreateCpuMockBackend();
    auto mock_event = *mock->CreateEvent();
    CHECK(RecordOnCudaStream(*mock_event, native).code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(f.fake->StreamDestroy(native) == cudaSuccess);
  }
}

TEST_CASE("cuda: a copy-engine event checks for a fault only after fault_check_interval",
          "[cuda]") {
  CudaBackendOptions options = Options(ReadyEventMode::kCopyEngineFlag);
  options.fault_check_interval = absl::Milliseconds(200);
  Fixture f(1, options);
  auto stream = f.NewStream();
  auto gate = *f.backend->CreateHostFlag();
  auto event = *f.backend->CreateEvent();
  REQUIRE(stream->WaitHostFlag(*gate, 1).ok());
  REQUIRE(event->Record(*stream).ok());
  const int queries = f.fake->Calls("cudaStreamQuery");
  for (int i = 0; i < 1000; ++i) CHECK_FALSE(f.Ready(*event));
  CHECK(f.fake->Calls("cudaStreamQuery") == queries);  // pending < 200 ms: host loads only
  absl::SleepFor(absl::Milliseconds(250));
  for (int i = 0; i < 1000; ++i) CHECK_FALSE(f.Ready(*event));
  CHECK(f.fake->Calls("cudaStreamQuery") - queries == 1);  // at most once per interval
  gate->Store(1);
  f.fake->RunAll();
  CHECK(f.Ready(*event));
}

// --- Lifetime -------------------------------------------------------------------------

TEST_CASE("cuda: every CUDA resource is released, whatever the destruction order", "[cuda]") {
  for (ReadyEventMode mode : {ReadyEventMode::kCopyEngineFlag, ReadyEventMode::kCudaEvent}) {
    auto fake = std::make_shared<FakeCudaApi>(2);
    {
      auto backend = *CreateCudaBackend(fake, 1, Options(mode));
      auto stream = *backend->CreateStream();
      auto event = *backend->CreateEvent();
      auto flag = *backend->CreateHostFlag();
      auto memory = *backend->Allocate(128, MemoryKind::kHostMapped);
      REQUIRE(event->Record(*stream).ok());
      backend.reset();  // objects outlive their backend
      REQUIRE(stream->WaitHostFlag(*flag, 0).ok());
      fake->RunAll();
      CHECK(*event->Query());
    }
    CHECK(fake->LiveAllocations() == 0);
    CHECK(fake->LiveStreams() == 0);
    CHECK(fake->LiveEvents() == 0);
    CHECK(fake->violations().empty());
  }
}

}  // namespace
}  // namespace stepmesh
