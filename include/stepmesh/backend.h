#pragma once
// Accelerator backends. A backend owns device memory, asynchronous streams
// and events; stepmesh's send thread waits on events so the caller never
// blocks, and a stream can wait for a host-side flag (an arrival) without a
// host synchronisation. Implementations: "cpu_mock" (threads emulating
// streams) and "cuda". No accelerator header is included here.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "stepmesh/export.h"
#include "stepmesh/tensor.h"

namespace stepmesh {

class Stream;
class StreamGraph;

// An owned allocation; freed by its destructor.
class STEPMESH_EXPORT Memory {
 public:
  virtual ~Memory() = default;
  virtual void* data() const = 0;
  virtual size_t bytes() const = 0;
  virtual Device device() const = 0;
  TensorView View(DType dtype, Shape shape) const { return {data(), dtype, shape, device()}; }
};

enum class MemoryKind : uint8_t {
  kDevice,      // accelerator memory (host memory on cpu_mock)
  kHostPinned,  // page-locked host memory, fast to copy
  kHostMapped,  // pinned host memory also addressable from the device
};

// A point in a stream's work. Reusable: Record() again after completion.
class STEPMESH_EXPORT Event {
 public:
  virtual ~Event() = default;
  // Marks the point after all work enqueued on `stream` so far.
  virtual absl::Status Record(Stream& stream) = 0;
  // Non-blocking: true once the recorded point is reached (true if never recorded).
  virtual absl::StatusOr<bool> Query() = 0;
  // Blocks until reached, or DEADLINE_EXCEEDED.
  virtual absl::Status Wait(absl::Duration timeout) = 0;
};

// A 32-bit word in host memory that both the host and the device can see.
// Host writes are release stores; stream waits observe them without host sync.
// Destroying a flag first releases every stream wait on it (ReleaseWaiters):
// a stream must never wait on freed memory.
class STEPMESH_EXPORT HostFlag {
 public:
  virtual ~HostFlag() = default;
  virtual void Store(uint32_t value) = 0;
  virtual uint32_t Load() const = 0;
  // Moves the flag past every value a stream was told to wait for so far
  // (WaitHostFlag, WaitHostFlagNext): for shutdown, when what those streams
  // wait for will never come. The work behind the waits then runs.
  virtual void ReleaseWaiters() = 0;
};

// An in-order queue of asynchronous work.
class STEPMESH_EXPORT Stream {
 public:
  virtual ~Stream() = default;
  virtual absl::Status CopyAsync(void* dst, const void* src, size_t bytes) = 0;
  // Runs `fn` on the host when the stream reaches this point (the CPU kernels of
  // the example run this way on cpu_mock; cudaLaunchHostFunc on CUDA).
  virtual absl::Status LaunchHostFunc(std::function<void()> fn) = 0;
  // Later work waits until flag >= value, compared wrap-safe as
  // int32_t(flag - value) >= 0 so counters may run past 2^32 (cuStreamWaitValue32
  // GEQ semantics, or a wait kernel).
  virtual absl::Status WaitHostFlag(HostFlag& flag, uint32_t value) = 0;
  // Later work waits for the next increment of a counter the host bumps per
  // event: until counter >= cursor + 1 (wrap-safe), and then the stream itself
  // sets cursor to that value. The target is read when the stream gets
  // there, not when this is called, so a captured CUDA graph that contains it
  // waits for one more increment at every replay. One stream (or graph) per
  // cursor. Always a kernel on CUDA (graph-safe, one SM slot while waiting).
  virtual absl::Status WaitHostFlagNext(HostFlag& counter, HostFlag& cursor) = 0;
  // The stream writes `value` to `flag` when it reaches this point.
  virtual absl::Status SignalHostFlag(HostFlag& flag, uint32_t value) = 0;
  // Later work waits until *counter >= *target: two int64 words the stream
  // addresses (host memory on cpu_mock; mapped pinned host memory or device
  // memory on CUDA), both read when the stream gets there, so a captured CUDA
  // graph that contains it reads them again at every replay (StepMesh's
  // wait_flag). Both must stay valid until the wait ran. A kernel on CUDA
  // (graph-safe, one SM slot while waiting). UNIMPLEMENTED where a backend
  // has no such wait.
  virtual absl::Status WaitCounterAtLeast(const int64_t* counter, const int64_t* target) {
    (void)counter;
    (void)target;
    return absl::UnimplementedError("this backend's streams cannot wait on an int64 counter");
  }
  // When the stream gets here, *counter += 1: one atomic add, a system-scope
  // release, so the host (a trigger, stepmesh/trigger.h) that sees the new
  // value also sees the work enqueued before it. The address is captured, the
  // value is not: a replayed graph increments it again every time (a graph's
  // kernel arguments are frozen at capture, so thresholds built on this are
  // relative: WaitCounterAtLeast(done, go)). Host memory on cpu_mock; mapped
  // pinned host memory on CUDA (a one-thread kernel). UNIMPLEMENTED where a
  // backend has none.
  virtual absl::Status IncrementCounter(int64_t* counter) {
    (void)counter;
    return absl::UnimplementedError("this backend's streams cannot increment a counter");
  }
  // Graph capture, as cudaStreamBeginCapture/EndCapture: from BeginCapture on,
  // the stream's operations (copies, host functions, waits, signals,
  // increments) are recorded instead of run, and host code between them is not
  // part of the graph; EndCapture returns what was recorded. Events cannot be
  // recorded and the stream cannot be synchronised while capturing
  // (FAILED_PRECONDITION). While any stream of a backend captures, its
  // allocations (Backend::Allocate, CreateHostFlag) are refused on every
  // thread and break the capture, whose later operations and EndCapture then
  // fail: CUDA's global
  // capture mode (the default, torch.cuda.graph's) refuses cudaMalloc /
  // cudaHostAlloc process-wide; cpu_mock models it per backend object. On
  // CUDA capture with CUDA itself
  // (torch.cuda.graph, cudaStreamBeginCapture on NativeCudaStream): these
  // return UNIMPLEMENTED there.
  virtual absl::Status BeginCapture() {
    return absl::UnimplementedError("this backend's streams capture with the accelerator's API");
  }
  virtual absl::StatusOr<std::unique_ptr<StreamGraph>> EndCapture() {
    return absl::UnimplementedError("this backend's streams capture with the accelerator's API");
  }
  virtual bool IsCapturing() const { return false; }
  virtual absl::Status Synchronize(absl::Duration timeout) = 0;
};

// The operations one capture recorded (Stream::EndCapture). Launch enqueues
// exactly those, in order, on a stream of the same backend and returns at
// once (cudaGraphLaunch): the work runs asynchronously there, and launches
// queue behind each other. Addresses are the captured ones; values read
// from memory (WaitCounterAtLeast, WaitHostFlagNext) are read when each
// replay gets there.
class STEPMESH_EXPORT StreamGraph {
 public:
  virtual ~StreamGraph() = default;
  virtual absl::Status Launch(Stream& stream) = 0;
  // The operations recorded, for tests and diagnostics.
  virtual size_t size() const = 0;
};

// Where memory lives, for choosing a nearby NIC and cores.
struct MemoryLocation {
  Device device;
  int numa_node = -1;      // -1: unknown
  std::string pci_bus_id;  // "0000:3b:00.0"; empty for host memory
};

class STEPMESH_EXPORT Backend {
 public:
  virtual ~Backend() = default;
  virtual absl::string_view name() const = 0;
  virtual Device device() const = 0;

  virtual absl::StatusOr<std::unique_ptr<Memory>> Allocate(size_t bytes, MemoryKind kind) = 0;
  virtual absl::StatusOr<std::unique_ptr<Stream>> CreateStream() = 0;
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;
  virtual absl::StatusOr<std::unique_ptr<HostFlag>> CreateHostFlag() = 0;
  // Synchronous copy between any two addresses this backend understands.
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes) = 0;
  // Where `ptr` lives; null: the backend's own device (its PCI address picks the NIC).
  virtual absl::StatusOr<MemoryLocation> Locate(const void* ptr) = 0;
  // A dma-buf fd for device memory (GPUDirect RDMA via ibv_reg_dmabuf_mr);
  // UNIMPLEMENTED where the backend or platform has none. Caller closes the fd.
  virtual absl::StatusOr<int> ExportDmabuf(const void* ptr, size_t bytes, uint64_t* offset) {
    (void)ptr, (void)bytes, (void)offset;
    return absl::UnimplementedError("dma-buf export not supported by this backend");
  }
  // Makes writes a NIC made straight into this backend's device memory
  // (GPUDirect RDMA) visible to stream work enqueued after the call returns.
  // The core calls it after such an arrival and before it reports one; a no-op
  // where the device orders those writes itself.
  virtual absl::Status FlushRemoteWrites() { return absl::OkStatus(); }
};

struct CpuMockOptions {
  // Each stream item is held this long before it runs: makes ordering bugs visible.
  absl::Duration injected_delay = absl::ZeroDuration();
};

// "cpu_mock" or "cuda" (when built with CUDA). NOT_FOUND / UNAVAILABLE otherwise.
STEPMESH_EXPORT absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view name,
                                                                       int device);
STEPMESH_EXPORT std::unique_ptr<Backend> CreateCpuMockBackend(const CpuMockOptions& options = {});

}  // namespace stepmesh
