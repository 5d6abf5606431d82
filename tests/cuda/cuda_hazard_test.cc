// The CUDA backend against the ways it can hang or weaken a guarantee on a
// real GPU (issue 16), one test per hazard, over the strict FakeCudaApi. Each
// names the CUDA rule it relies on. They use only the backend API that
// predates the fixes, so they run against the old backend too (where they
// fail).

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/backends/cuda/cuda_backend.h"
#include "stepmesh/backend.h"
#include "tests/cuda/cuda_backend_fixture.h"
#include "tests/cuda/fake_cuda_api.h"
#include "tests/support/scoped_env.h"

namespace stepmesh {
namespace {

using cuda::testing::FakeCudaApi;
using cuda::testing::Modes;
using Rig = cuda::testing::BackendFixture;

// --- 1. Backend::Copy and the legacy default stream --------------------------

// CUDA: work on the legacy default stream waits for all earlier work of every
// blocking stream. PyTorch's default stream is the legacy stream; a stream the
// application waits on for the reply must not hold up the send thread's copy
// that produces the request.
TEST_CASE(
    "hazard 1: the send thread's copy does not queue behind the application's "
    "blocking stream waiting for the reply",
    "[cuda][hazard]") {
  for (bool legacy : {true, false}) {
    INFO((legacy ? "the legacy default stream (PyTorch's default)" : "a blocking stream"));
    Rig rig;
    cudaStream_t app = nullptr;
    if (!legacy) REQUIRE(rig.fake->StreamCreateWithFlags(&app, 0) == cudaSuccess);
    auto wrapped = *WrapCudaStream(*rig.backend, app);
    auto reply = *rig.backend->CreateHostFlag();
    auto push = *rig.backend->Allocate(4096, MemoryKind::kDevice);
    auto staging = *rig.backend->Allocate(4096, MemoryKind::kHostPinned);
    REQUIRE(wrapped->WaitHostFlag(*reply, 1).ok());  // the model waits for the reply
    absl::Status copied = absl::UnknownError("not run");
    std::thread send_thread(
        [&] { copied = rig.backend->Copy(staging->data(), push->data(), 4096); });
    send_thread.join();
    CHECK(copied.ok());
    reply->Store(1);  // the reply arrives: the application's stream moves on
    rig.fake->RunAll();
    CHECK(rig.fake->Pending(app) == 0);
    if (!legacy) REQUIRE(rig.fake->StreamDestroy(app) == cudaSuccess);
  }
}

// CUDA: cudaMemcpy returns before the data is in place for device-to-device
// copies and for copies from pageable host memory ("API synchronization
// behavior"). Copy is documented as synchronous: the next reader must see it.
TEST_CASE("hazard 1: Copy has finished when it returns, for device-to-device and pageable copies",
          "[cuda][hazard]") {
  Rig rig;
  auto a = *rig.backend->Allocate(4096, MemoryKind::kDevice);
  auto b = *rig.backend->Allocate(4096, MemoryKind::kDevice);
  std::vector<uint8_t> pageable(4096, 0x5A);
  REQUIRE(rig.backend->Copy(a->data(), pageable.data(), pageable.size()).ok());
  std::fill(pageable.begin(), pageable.end(), 0);  // the caller reuses its buffer at once
  std::vector<uint8_t> seen(4096);
  rig.fake->ReadDevice(seen.data(), a->data(), seen.size());  // a kernel reading it now
  CHECK(seen == std::vector<uint8_t>(4096, 0x5A));
  REQUIRE(rig.backend->Copy(b->data(), a->data(), 4096).ok());
  rig.fake->ReadDevice(seen.data(), b->data(), seen.size());
  CHECK(seen == std::vector<uint8_t>(4096, 0x5A));
}

// CUDA: in the default (global) capture mode a potentially unsafe call (a
// synchronous copy, cudaEventQuery) made while any thread captures a graph in
// global mode fails and invalidates that capture. PyTorch captures in global
// mode; stepmesh's threads keep copying and polling meanwhile.
TEST_CASE(
    "hazard 1: copies and polls on stepmesh's threads do not break an application's "
    "global-mode graph capture",
    "[cuda][hazard]") {
  for (ReadyEventMode mode : {ReadyEventMode::kCopyEngineFlag, ReadyEventMode::kCudaEvent}) {
    Rig rig(1, Modes(mode));
    auto compute = rig.NewStream();
    auto event = *rig.backend->CreateEvent();
    REQUIRE(event->Record(*compute).ok());
    auto graph_stream = rig.NewStream();
    auto device = *rig.backend->Allocate(4096, MemoryKind::kDevice);
    auto staging = *rig.backend->Allocate(4096, MemoryKind::kHostPinned);
    REQUIRE(rig.fake->BeginCapture(Rig::Native(*graph_stream), cudaStreamCaptureModeGlobal) ==
            cudaSuccess);
    absl::Status copied, polled;
    std::thread send_thread([&] {
      copied = rig.backend->Copy(staging->data(), device->data(), 4096);
      polled = event->Query().status();
    });
    send_thread.join();
    FakeCudaApi::Graph graph;
    CHECK(rig.fake->EndCapture(Rig::Native(*graph_stream), &graph) == cudaSuccess);
    CHECK(copied.ok());
    CHECK(polled.ok());
    rig.fake->RunAll();
  }
}

// --- 2. A device fault with copy-engine ready events --------------------------

// CUDA: after a fault the device runs nothing more, so the flag copy of a
// copy-engine event never lands and a host load cannot tell. Query() must
// turn the fault into an error (the send loop polls it forever otherwise).
TEST_CASE("hazard 2: a device fault fails a pending copy-engine ready event", "[cuda][hazard]") {
  Rig rig(1, Modes(ReadyEventMode::kCopyEngineFlag));
  auto stream = rig.NewStream();
  auto event = *rig.backend->CreateEvent();
  REQUIRE(event->Record(*stream).ok());
  rig.fake->InjectDeviceFault(0, cudaErrorIllegalAddress);  // a kernel before it faulted
  absl::StatusOr<bool> ready = false;
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  while (ready.ok() && !*ready && absl::Now() < deadline) ready = event->Query();
  INFO("Query() after 2 s: " << (ready.ok() ? (*ready ? "true" : "false (still pending)")
                                            : ready.status().ToString()));
  REQUIRE_FALSE(ready.ok());
  CHECK(ready.status().code() == absl::StatusCode::kInternal);
  CHECK(absl::StrContains(ready.status().message(), "cudaErrorIllegalAddress"));
}

// --- 3. Calls that wait for the whole device -----------------------------------

// CUDA: with lazy loading (default since 12.2) a kernel's first launch waits
// for the whole device. A wait kernel spinning on a flag this very thread is
// to raise later never lets that launch return.
TEST_CASE(
    "hazard 3: the first signal after a pending wait does not wait for the device "
    "(kernels loaded up front)",
    "[cuda][hazard]") {
  Rig rig(1, Modes(ReadyEventMode::kCopyEngineFlag, StreamWaitMode::kKernel));
  auto consumer = rig.NewStream();
  auto producer = rig.NewStream();
  auto arrival = *rig.backend->CreateHostFlag();
  auto done = *rig.backend->CreateHostFlag();
  REQUIRE(consumer->WaitHostFlag(*arrival, 1).ok());  // spins until the data is there
  REQUIRE(producer->SignalHostFlag(*done, 1).ok());   // the first signal kernel ever
  arrival->Store(1);                                  // this thread raises the arrival
  rig.fake->RunAll();
  CHECK(done->Load() == 1);
  CHECK(rig.fake->Pending(Rig::Native(*consumer)) == 0);
}

// CUDA: cudaHostAlloc (pinning) waits for the device. Growing the event pool
// on demand did that while a stream may be waiting on an arrival.
TEST_CASE("hazard 3: creating events while a stream waits allocates nothing", "[cuda][hazard]") {
  Rig rig(1, Modes(ReadyEventMode::kCopyEngineFlag));
  auto stream = rig.NewStream();
  auto arrival = *rig.backend->CreateHostFlag();
  REQUIRE(stream->WaitHostFlag(*arrival, 1).ok());
  const int pinned_before = rig.fake->Calls("cudaHostAlloc");
  std::vector<std::unique_ptr<Event>> events;
  for (int i = 0; i < 100; ++i) {
    auto event = rig.backend->CreateEvent();
    REQUIRE(event.ok());
    events.push_back(std::move(*event));
  }
  CHECK(rig.fake->Calls("cudaHostAlloc") == pinned_before);
  arrival->Store(1);
  rig.fake->RunAll();
}

// CUDA: freeing pinned memory waits for the device, and a stream waiting on a
// freed flag waits forever. Dropping a flag a stream still waits on (shutdown
// after a peer died) must release the wait first.
TEST_CASE("hazard 3: destroying a flag releases the stream waits on it", "[cuda][hazard]") {
  for (StreamWaitMode mode : {StreamWaitMode::kAuto, StreamWaitMode::kKernel}) {
    Rig rig(1, Modes(ReadyEventMode::kCopyEngineFlag, mode));
    auto stream = rig.NewStream();
    auto arrival = *rig.backend->CreateHostFlag();
    REQUIRE(stream->WaitHostFlag(*arrival, 7).ok());
    REQUIRE(stream->WaitHostFlag(*arrival, 5).ok());
    arrival.reset();  // the arrival will never come
    rig.fake->RunAll();
    CHECK(rig.fake->Pending(Rig::Native(*stream)) == 0);
  }
}

// CUDA: cudaFree and cudaFreeHost wait for the whole device. Freeing *other*
// memory (a staging buffer of a tensor being unregistered, a flag of a
// finished request) while a stream waits on an arrival flag that the same
// thread is about to raise never returns on a GPU (#31, item 11).
TEST_CASE("hazard 3: freeing memory while a stream waits on another flag does not block",
          "[cuda][hazard]") {
  for (StreamWaitMode mode : {StreamWaitMode::kAuto, StreamWaitMode::kKernel}) {
    Rig rig(1, Modes(ReadyEventMode::kCopyEngineFlag, mode));
    auto stream = rig.NewStream();
    auto arrival = *rig.backend->CreateHostFlag();
    auto staging = *rig.backend->Allocate(4096, MemoryKind::kHostPinned);
    auto device = *rig.backend->Allocate(4096, MemoryKind::kDevice);
    auto finished = *rig.backend->CreateHostFlag();
    REQUIRE(stream->WaitHostFlag(*arrival, 1).ok());
    // The receive thread: drops memory it no longer needs, then raises the flag.
    const absl::Time start = absl::Now();
    staging.reset();
    device.reset();
    finished.reset();
    const absl::Duration took = absl::Now() - start;
    CHECK(took < absl::Milliseconds(500));  // the fake reports a hang after 1 s
    arrival->Store(1);
    rig.fake->RunAll();
    CHECK(rig.fake->Pending(Rig::Native(*stream)) == 0);
  }
}

// --- 4. Contexts -------------------------------------------------------------

// CUDA 12: cudaSetDevice creates the device's primary context; a thread with
// no current context reads device 0 from cudaGetDevice. Switching to the
// backend's device and "back" to 0 made a context on GPU 0 in every process.
TEST_CASE("hazard 4: a backend on device 1 never creates device 0's context", "[cuda][hazard]") {
  auto fake = std::make_shared<FakeCudaApi>(2);
  std::thread application([&] {  // a thread that never touched CUDA
    auto backend = *CreateCudaBackend(fake, 1, Modes(ReadyEventMode::kCopyEngineFlag));
    auto stream = *backend->CreateStream();
    auto event = *backend->CreateEvent();
    auto flag = *backend->CreateHostFlag();
    auto device = *backend->Allocate(4096, MemoryKind::kDevice);
    auto pinned = *backend->Allocate(4096, MemoryKind::kHostPinned);
    (void)backend->Locate(device->data());
    std::thread send_thread([&] {  // stepmesh's own threads start without a context too
      (void)backend->Copy(pinned->data(), device->data(), 4096);
      (void)event->Query();
    });
    send_thread.join();
    (void)stream->WaitHostFlag(*flag, 0);
    (void)event->Record(*stream);
    fake->RunAll();
  });
  application.join();
  CHECK(fake->primary_contexts_created(1) == 1);
  CHECK(fake->primary_contexts_created(0) == 0);
  CHECK(fake->violations().empty());
}

// The send thread copies every step; switching devices around each copy is
// two driver calls per copy, and needless once the thread is bound.
TEST_CASE("hazard 4: a progress thread gets the device once, not per copy", "[cuda][hazard]") {
  Rig rig(2, {}, 1);
  auto device = *rig.backend->Allocate(4096, MemoryKind::kDevice);
  auto pinned = *rig.backend->Allocate(4096, MemoryKind::kHostPinned);
  const int before = rig.fake->Calls("cudaSetDevice");
  std::thread send_thread([&] {
    for (int i = 0; i < 100; ++i) (void)rig.backend->Copy(pinned->data(), device->data(), 4096);
  });
  send_thread.join();
  CHECK(rig.fake->Calls("cudaSetDevice") - before <= 1);
  CHECK(rig.fake->primary_contexts_created(0) == 0);
}

// --- 5. flush_remote_writes ----------------------------------------------------

// CUDA: CU_STREAM_WAIT_VALUE_FLUSH needs CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES
// (0 on most x86 hosts). Asking for it there must fail when the backend is
// made, not at the first wait, and never silently wait without it.
TEST_CASE("hazard 5: flush_remote_writes on a device that cannot flush fails creation",
          "[cuda][hazard]") {
  auto fake = std::make_shared<FakeCudaApi>(1);  // cudaDevAttrCanFlushRemoteWrites = 0
  auto backend = CreateCudaBackend(fake, 0, cuda::testing::FlushRemoteWrites());
  INFO(backend.status().ToString());
  CHECK(backend.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(fake->violations().empty());
}

TEST_CASE("hazard 5: flush_remote_writes is never dropped for a wait kernel", "[cuda][hazard]") {
  Rig rig(cuda::testing::FlushCapableDevice(), 0, cuda::testing::FlushRemoteWrites());
  auto stream = rig.NewStream();
  auto flag = *rig.backend->CreateHostFlag();
  SECTION("the stream is being captured: the kernel path has no flush") {
    rig.fake->SetCapturing(Rig::Native(*stream), true);
    CHECK(stream->WaitHostFlag(*flag, 1).code() == absl::StatusCode::kFailedPrecondition);
    CHECK(rig.fake->Calls("wait_kernel") == 0);
    rig.fake->SetCapturing(Rig::Native(*stream), false);
  }
  SECTION("the driver refuses the memop: no fallback to the kernel") {
    rig.fake->FailNextDriver("cuStreamWaitValue32", CUDA_ERROR_NOT_SUPPORTED);
    CHECK_FALSE(stream->WaitHostFlag(*flag, 1).ok());
    CHECK(rig.fake->Calls("wait_kernel") == 0);
  }
}

// A device that neither orders NIC writes nor flushes them from the host:
// reporting a device-direct arrival as done would let kernels read stale data.
TEST_CASE("hazard 5: FlushRemoteWrites on a device that can neither order nor flush fails",
          "[cuda][hazard]") {
  Rig rig;
  const absl::Status status = rig.backend->FlushRemoteWrites();
  INFO(status.ToString());
  CHECK(status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_FALSE(absl::StrContains(status.message(), "flush_remote_writes"));
}

// --- 6. Event reuse --------------------------------------------------------------

// A copy-engine event dropped with its flag copy still queued: if its slot goes
// straight back to the pool, the next owner's event is overwritten when the
// old copy lands late, and never completes.
TEST_CASE("hazard 6: an event dropped while its copy is queued does not disturb the next one",
          "[cuda][hazard]") {
  Rig rig(1, Modes(ReadyEventMode::kCopyEngineFlag));
  auto slow = rig.NewStream();
  auto fast = rig.NewStream();
  auto gate = *rig.backend->CreateHostFlag();
  REQUIRE(slow->WaitHostFlag(*gate, 1).ok());
  {
    auto dropped = *rig.backend->CreateEvent();
    REQUIRE(dropped->Record(*slow).ok());  // its copy waits behind the gate
  }
  auto next = *rig.backend->CreateEvent();
  REQUIRE(next->Record(*fast).ok());
  rig.fake->RunStream(Rig::Native(*fast));
  CHECK(*next->Query());
  gate->Store(1);
  rig.fake->RunAll();  // the dropped event's copy lands now
  CHECK(*next->Query());
}

// A record during graph capture is captured, not done: the event would mean
// "once per replay" (flag copy) or nothing. Refused with a clear status.
TEST_CASE("hazard 6: Record on a capturing stream is refused", "[cuda][hazard]") {
  for (ReadyEventMode mode : {ReadyEventMode::kCopyEngineFlag, ReadyEventMode::kCudaEvent}) {
    Rig rig(1, Modes(mode));
    auto stream = rig.NewStream();
    auto event = *rig.backend->CreateEvent();
    rig.fake->SetCapturing(Rig::Native(*stream), true);
    const absl::Status status = event->Record(*stream);
    rig.fake->SetCapturing(Rig::Native(*stream), false);
    INFO(status.ToString());
    CHECK(status.code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(status.message(), "captur"));
  }
}

// The send thread polls while the application records the same event again
// (reuse after completion). Under TSan this is a data race unless the slot's
// fields are atomic; here it must at least always end ready.
TEST_CASE("hazard 6: polling while the owner re-records is safe", "[cuda][hazard]") {
  Rig rig(1, Modes(ReadyEventMode::kCopyEngineFlag));
  auto stream = rig.NewStream();
  auto event = *rig.backend->CreateEvent();
  std::atomic<bool> stop{false};
  std::thread poller([&] {
    while (!stop.load()) (void)event->Query();
  });
  for (int i = 0; i < 200; ++i) {
    REQUIRE(event->Record(*stream).ok());
    rig.fake->RunAll();
  }
  stop = true;
  poller.join();
  CHECK(*event->Query());
}

// --- 7. Priorities -----------------------------------------------------------------

// Flag kernels and copies on default-priority streams queue behind long model
// kernels; the backend's streams get the device's highest priority.
TEST_CASE("hazard 7: the backend's streams have the highest priority", "[cuda][hazard]") {
  Rig rig;
  auto stream = rig.NewStream();
  CHECK(rig.fake->PriorityOfStream(Rig::Native(*stream)) == FakeCudaApi::kGreatestPriority);
  CHECK(rig.fake->FlagsOfStream(Rig::Native(*stream)) == cudaStreamNonBlocking);
  // Its own copy streams too.
  auto device = *rig.backend->Allocate(4096, MemoryKind::kDevice);
  auto pinned = *rig.backend->Allocate(4096, MemoryKind::kHostPinned);
  REQUIRE(rig.backend->Copy(pinned->data(), device->data(), 4096).ok());
  int own = 0;
  for (cudaStream_t s : rig.fake->CreatedStreams()) {
    if (s == Rig::Native(*stream)) continue;
    ++own;
    CHECK(rig.fake->PriorityOfStream(s) == FakeCudaApi::kGreatestPriority);
    CHECK(rig.fake->FlagsOfStream(s) == cudaStreamNonBlocking);
  }
  CHECK(own > 0);
  CHECK(rig.fake->Calls("cudaMemcpy") == 0);  // nothing on the legacy stream
}

// --- 8. dma-buf ranges -------------------------------------------------------------

// cuMemGetHandleForAddressRange exports whole pages. A tensor that starts
// mid-page (a sub-allocation) would export its neighbour's bytes too, for the
// NIC to reach.
TEST_CASE("hazard 8: a dma-buf export never reaches outside the tensor's allocation",
          "[cuda][hazard]") {
  auto fake = std::make_shared<FakeCudaApi>(1);
  fake->set_suballocate(true);
  Rig rig(fake, 0);
  auto neighbour = *rig.backend->Allocate(4096, MemoryKind::kDevice);
  auto tensor = *rig.backend->Allocate(4096, MemoryKind::kDevice);
  const auto begin = reinterpret_cast<uintptr_t>(tensor->data());
  REQUIRE(begin % 4096 != 0);  // the packing this case is about
  uint64_t offset = 0;
  auto fd = rig.backend->ExportDmabuf(tensor->data(), 4096, &offset);
  if (fd.ok()) ::close(*fd);
  for (const auto& [base, bytes] : rig.fake->exported_ranges()) {
    INFO("exported [" << base << ", " << base + bytes << ") for a tensor at [" << begin << ", "
                      << begin + 4096 << ")");
    CHECK(base >= begin);
    CHECK(base + bytes <= begin + 4096);
  }
  CHECK_FALSE(fd.ok());  // no page-aligned range fits: the caller registers it otherwise
}

// --- The fake itself is as strict as CUDA ------------------------------------------

TEST_CASE("fake CUDA: device memory is not host memory", "[cuda][fake]") {
  auto fake = std::make_shared<FakeCudaApi>(1);
  void* device = nullptr;
  REQUIRE(fake->Malloc(&device, 4096) == cudaSuccess);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // Die of the fault itself, quietly, not through the test framework's handler.
    std::signal(SIGSEGV, SIG_DFL);
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, STDERR_FILENO);
    volatile uint8_t byte = *static_cast<volatile uint8_t*>(device);  // host code reading it
    (void)byte;
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK_FALSE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  uint8_t byte = 0;
  fake->ReadDevice(&byte, device, 1);  // inside the fake it is reachable
  CHECK(byte == 0xAB);
  REQUIRE(fake->Free(device) == cudaSuccess);
}

TEST_CASE("fake CUDA: copies are bounds-checked against their allocation", "[cuda][fake]") {
  auto fake = std::make_shared<FakeCudaApi>(1);
  REQUIRE(fake->SetDevice(0) == cudaSuccess);
  void* device = nullptr;
  void* pinned = nullptr;
  REQUIRE(fake->Malloc(&device, 4096) == cudaSuccess);
  REQUIRE(fake->HostAlloc(&pinned, 8192, 0) == cudaSuccess);
  CHECK(fake->MemcpyAsync(pinned, device, 4097, cudaMemcpyDefault, cudaStreamLegacy) ==
        cudaErrorInvalidValue);
  REQUIRE(fake->violations().size() == 1);
  CHECK(absl::StrContains(fake->violations()[0], "past the end"));
  REQUIRE(fake->Free(device) == cudaSuccess);
  REQUIRE(fake->FreeHost(pinned) == cudaSuccess);
}

// A fake that reports a hang after 50 ms, with 4 KiB of device memory and a
// mapped 64-byte host flag (and the flag's device alias), for the cases of the
// fake's own hang rules.
struct MappedFlag {
  std::shared_ptr<FakeCudaApi> fake;
  void* device = nullptr;
  void* flag = nullptr;
  void* alias = nullptr;
};

MappedFlag FakeWithMappedFlag() {
  MappedFlag m{std::make_shared<FakeCudaApi>(1)};
  m.fake->set_hang_timeout(std::chrono::milliseconds(50));
  REQUIRE(m.fake->SetDevice(0) == cudaSuccess);
  REQUIRE(m.fake->Malloc(&m.device, 4096) == cudaSuccess);
  REQUIRE(m.fake->HostAlloc(&m.flag, 64, cudaHostAllocMapped) == cudaSuccess);
  REQUIRE(m.fake->HostGetDevicePointer(&m.alias, m.flag, 0) == cudaSuccess);
  return m;
}

TEST_CASE("fake CUDA: legacy-stream work waits for blocking streams, not non-blocking ones",
          "[cuda][fake]") {
  auto [fake, device, flag, alias] = FakeWithMappedFlag();
  std::vector<uint8_t> host(4096);
  for (unsigned int flags : {cudaStreamNonBlocking, cudaStreamDefault}) {
    std::memset(flag, 0, 64);
    cudaStream_t stream = nullptr;
    REQUIRE(fake->StreamCreateWithFlags(&stream, flags) == cudaSuccess);
    REQUIRE(fake->StreamWaitValue32(reinterpret_cast<CUstream>(stream),
                                    reinterpret_cast<CUdeviceptr>(alias), 1,
                                    CU_STREAM_WAIT_VALUE_GEQ) == CUDA_SUCCESS);
    const cudaError_t copied = fake->Memcpy(host.data(), device, 4096, cudaMemcpyDefault);
    if (flags == cudaStreamNonBlocking) {
      CHECK(copied == cudaSuccess);
      CHECK(fake->violations().empty());
    } else {
      CHECK(copied == cudaErrorLaunchTimeout);
      REQUIRE(fake->violations().size() == 1);
      CHECK(absl::StrContains(fake->violations()[0], "would hang"));
    }
    *static_cast<uint32_t*>(flag) = 1;
    fake->RunAll();
    REQUIRE(fake->StreamDestroy(stream) == cudaSuccess);
  }
  REQUIRE(fake->Free(device) == cudaSuccess);
  REQUIRE(fake->FreeHost(flag) == cudaSuccess);
}

TEST_CASE("fake CUDA: freeing memory while a stream waits on a flag would hang", "[cuda][fake]") {
  auto [fake, device, flag, alias] = FakeWithMappedFlag();
  std::memset(flag, 0, 64);
  cudaStream_t stream = nullptr;
  REQUIRE(fake->StreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(fake->LoadFlagKernels() == cudaSuccess);
  REQUIRE(fake->LaunchWaitFlagKernel(stream, static_cast<uint32_t*>(alias), 1) == cudaSuccess);
  CHECK(fake->Free(device) == cudaErrorLaunchTimeout);
  REQUIRE(fake->violations().size() == 1);
  CHECK(absl::StrContains(fake->violations()[0], "cudaFree (waits for the whole device)"));
  *static_cast<uint32_t*>(flag) = 1;  // released: now it can go
  CHECK(fake->Free(device) == cudaSuccess);
  REQUIRE(fake->StreamDestroy(stream) == cudaSuccess);
  REQUIRE(fake->FreeHost(flag) == cudaSuccess);
}

TEST_CASE("fake CUDA: capture modes decide who may make unsafe calls", "[cuda][fake]") {
  auto fake = std::make_shared<FakeCudaApi>(1);
  REQUIRE(fake->SetDevice(0) == cudaSuccess);
  cudaStream_t stream = nullptr;
  REQUIRE(fake->StreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  for (cudaStreamCaptureMode other_thread_mode :
       {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeRelaxed}) {
    REQUIRE(fake->BeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
    cudaError_t queried = cudaSuccess;
    std::thread other([&] {
      cudaStreamCaptureMode mode = other_thread_mode;
      (void)fake->ThreadExchangeStreamCaptureMode(&mode);
      cudaStream_t own = nullptr;
      (void)fake->StreamCreateWithFlags(&own, cudaStreamNonBlocking);
      queried = fake->StreamQuery(own);
      (void)fake->StreamDestroy(own);
    });
    other.join();
    FakeCudaApi::Graph graph;
    const cudaError_t ended = fake->EndCapture(stream, &graph);
    if (other_thread_mode == cudaStreamCaptureModeGlobal) {
      CHECK(queried == cudaErrorStreamCaptureUnsupported);
      CHECK(ended == cudaErrorStreamCaptureInvalidated);
    } else {
      CHECK(queried == cudaSuccess);
      CHECK(ended == cudaSuccess);
    }
  }
  CHECK(fake->violations().size() == 1);
  REQUIRE(fake->StreamDestroy(stream) == cudaSuccess);
}

TEST_CASE("fake CUDA: runtime calls on a thread without a context make device 0's",
          "[cuda][fake]") {
  auto fake = std::make_shared<FakeCudaApi>(2);
  std::thread fresh([&] {
    int device = -1;
    CHECK(fake->GetDevice(&device) == cudaSuccess);  // reads 0, makes nothing
    CHECK(device == 0);
    CHECK(fake->primary_contexts_created() == 0);
    void* p = nullptr;
    CHECK(fake->Malloc(&p, 64) == cudaSuccess);  // the runtime initialises device 0
    CHECK(fake->primary_contexts_created(0) == 1);
    CHECK(fake->Free(p) == cudaSuccess);
  });
  fresh.join();
}

// --- 9. Shared hardware queues -------------------------------------------------

// CUDA maps streams to CUDA_DEVICE_MAX_CONNECTIONS hardware queues (default
// 8) round robin; a cuStreamWaitValue32 at a queue's head holds up every
// stream on that queue. With more streams than queues, an application stream
// waiting for an arrival shares a queue with one of the backend's copy lanes,
// and the receive thread's copy -- which must land before it raises the flag
// -- never runs. CreateCudaBackend must read the variable itself (direct
// users never pass it) and wait with the kernel once streams outnumber queues.
TEST_CASE("hazard 9: a stream waiting for an arrival does not block the copy that delivers it",
          "[cuda][hazard]") {
  struct Case {
    const char* connections;
    int app_streams;
  };
  for (const Case c : {Case{"2", 2}, Case{"8", 6}}) {
    INFO("CUDA_DEVICE_MAX_CONNECTIONS=" << c.connections << ", " << c.app_streams
                                        << " application streams + 3 copy lanes");
    testing::ScopedEnv env({{"CUDA_DEVICE_MAX_CONNECTIONS", c.connections}});
    auto fake = std::make_shared<FakeCudaApi>(1);
    fake->set_hardware_queues(std::stoi(c.connections));
    fake->set_hang_timeout(std::chrono::milliseconds(200));
    Rig rig(fake, 0);  // default options: kAuto, device_max_connections unset
    std::vector<std::unique_ptr<Stream>> streams;
    for (int i = 0; i < c.app_streams; ++i) streams.push_back(rig.NewStream());
    auto arrival = *rig.backend->CreateHostFlag();
    for (auto& stream : streams) REQUIRE(stream->WaitHostFlag(*arrival, 1).ok());
    // The receive thread: the bytes into the tensor, then the flag.
    auto device = *rig.backend->Allocate(4096, MemoryKind::kDevice);
    std::vector<char> staged(4096, 'x');
    const absl::Status copied = rig.backend->Copy(device->data(), staged.data(), staged.size());
    INFO(copied.ToString());
    CHECK(copied.ok());
    arrival->Store(1);
    fake->RunAll();
    for (auto& stream : streams) CHECK(fake->Pending(Rig::Native(*stream)) == 0);
    CHECK(fake->memops().empty());  // the waits were kernels
  }
}

// Megatron-LM and Transformer Engine set CUDA_DEVICE_MAX_CONNECTIONS=1 and
// create the backend themselves: CreateCudaBackend must see it, not only
// MeshOptions::FromEnv.
TEST_CASE("hazard 9: CreateCudaBackend reads CUDA_DEVICE_MAX_CONNECTIONS itself",
          "[cuda][hazard]") {
  auto fake = std::make_shared<FakeCudaApi>(1);
  {
    testing::ScopedEnv env({{"CUDA_DEVICE_MAX_CONNECTIONS", "1"}});
    auto refused = CreateCudaBackend(
        fake, 0, Modes(ReadyEventMode::kCopyEngineFlag, StreamWaitMode::kStreamMemOp));
    INFO(refused.status().ToString());
    CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
    Rig rig(fake, 0);
    auto stream = rig.NewStream();
    auto flag = *rig.backend->CreateHostFlag();
    REQUIRE(stream->WaitHostFlag(*flag, 1).ok());
    CHECK(fake->memops().empty());  // one queue: the kernel
    flag->Store(1);
    fake->RunAll();
  }
  testing::ScopedEnv bad({{"CUDA_DEVICE_MAX_CONNECTIONS", "lots"}});
  auto rejected = CreateCudaBackend(fake, 0);
  INFO(rejected.status().ToString());
  CHECK(rejected.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(rejected.status().message(), "CUDA_DEVICE_MAX_CONNECTIONS='lots'"));
}

}  // namespace
}  // namespace stepmesh
