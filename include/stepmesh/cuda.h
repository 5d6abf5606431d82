#pragma once
// CUDA interop for the "cuda" backend (docs/cuda.md). No CUDA header is
// included: a stream travels as `void*` holding a cudaStream_t, so code built
// without the CUDA toolkit (or against another CUDA version) can include this.
// In a libstepmesh built without CUDA every function here returns
// UNIMPLEMENTED.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "stepmesh/backend.h"
#include "stepmesh/export.h"

namespace stepmesh {

// How a ready event (GPU stream -> send thread) is recorded and polled.
enum class ReadyEventMode : uint8_t {
  // Record() enqueues a 4-byte device-to-host copy of a sequence value into a
  // pinned host word; Query() is one acquire load of that word. The copy runs
  // on a copy engine (no SM) and polling takes no driver lock. Default, as in
  // StepMesh (STEPMESH_MEM_SYNC=1).
  kCopyEngineFlag,
  // Record() is cudaEventRecord, Query() is cudaEventQuery: a driver call per
  // poll, but nothing extra enqueued on the stream.
  kCudaEvent,
};

// How a stream waits on a host flag (arrival -> GPU stream).
enum class StreamWaitMode : uint8_t {
  // cuStreamWaitValue32/cuStreamWriteValue32 when the driver has them, the
  // stream is not being captured into a graph and the device has more than
  // one hardware queue; the flag kernels otherwise.
  kAuto,
  // Always the stream memory operations; UNIMPLEMENTED when unavailable.
  kStreamMemOp,
  // Always the one-thread kernels (graph-safe; holds one SM slot while waiting).
  kKernel,
};

struct CudaBackendOptions {
  ReadyEventMode ready_event_mode = ReadyEventMode::kCopyEngineFlag;
  StreamWaitMode stream_wait_mode = StreamWaitMode::kAuto;
  // Events made when the backend is created; CreateEvent beyond that many
  // live events is RESOURCE_EXHAUSTED. Growing later would allocate pinned
  // memory, which waits for the whole device: with a stream waiting on an
  // arrival that this thread is about to report, that wait never ends.
  int event_pool_size = 256;
  // Stream waits flush outstanding remote (GPUDirect RDMA) writes before
  // later work runs (CU_STREAM_WAIT_VALUE_FLUSH). Needs the stream memory
  // operations and a device that can flush (cudaDevAttrCanFlushRemoteWrites);
  // creating the backend fails with FAILED_PRECONDITION otherwise, and a wait
  // that would have to use a kernel (graph capture) is refused, never weaker.
  bool flush_remote_writes = false;
  // CreateStream's streams get the device's highest priority, so the flag
  // kernels and copies on them are not queued behind long model kernels of
  // lower-priority streams. The backend's own copy streams always do.
  bool high_priority_streams = true;
  // The process's CUDA_DEVICE_MAX_CONNECTIONS: the hardware queues CUDA maps
  // streams to, round robin (0: CreateCudaBackend reads the variable itself;
  // unset there means CUDA's default of 8). A cuStreamWaitValue32 at a queue's
  // head holds up every stream on that queue, the backend's own copies
  // included, so kAuto waits with the kernel once the backend's streams (its
  // 3 copy lanes plus every stream it made or wrapped) outnumber the queues,
  // and always with 1 (Megatron-LM, Transformer Engine); kStreamMemOp is then
  // refused at creation. Streams the application made without the backend
  // are not counted: with many of those, use kKernel (docs/cuda.md, rule 7).
  int device_max_connections = 0;
  // A copy-engine ready event pending this long makes Query() also ask the
  // device whether it faulted (a faulted device never runs the flag copy, so
  // the event would otherwise stay pending forever).
  absl::Duration fault_check_interval = absl::Milliseconds(5);
  // Where PCI devices' numa_node files live; tests point it at a fake tree.
  std::string sysfs_root = "/sys";
};

// A backend on CUDA device `device` (any index the driver reports; no cap).
// UNAVAILABLE when there is no driver or no device, INVALID_ARGUMENT for an
// index out of range, FAILED_PRECONDITION for options the device cannot honour.
STEPMESH_EXPORT absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    int device, const CudaBackendOptions& options = {});

// The cudaStream_t behind a Stream made by a CUDA backend (as void*), for
// capturing it into a graph or handing it to kernels; INVALID_ARGUMENT for
// other streams.
STEPMESH_EXPORT absl::StatusOr<void*> NativeCudaStream(Stream& stream);

// Wraps an existing cudaStream_t (e.g. a framework's current stream; null is
// the legacy default stream) without taking ownership; `backend` must be a
// CUDA backend. The stream must outlive the wrapper and every event recorded
// on it until that event completed.
STEPMESH_EXPORT absl::StatusOr<std::unique_ptr<Stream>> WrapCudaStream(Backend& backend,
                                                                       void* cuda_stream);

// Records `event` (made by a CUDA backend) on a native cudaStream_t, as
// Event::Record on a wrapped stream does, without making a wrapper.
STEPMESH_EXPORT absl::Status RecordOnCudaStream(Event& event, void* cuda_stream);

// Loads kernels (the host-side addresses of __global__ functions, as given to
// cudaLaunchKernel) into the backend's device now. Under lazy loading, the
// default since CUDA 12.2, a kernel's first launch waits for the whole device:
// if a stream is then waiting on a host flag that the launching thread is to
// raise, it waits forever. Call it at start-up for the kernels an application
// launches while streams wait on arrivals. The backend loads its own flag
// kernels when it is created.
STEPMESH_EXPORT absl::Status PreloadCudaKernels(Backend& backend,
                                                absl::Span<const void* const> kernels);

}  // namespace stepmesh
