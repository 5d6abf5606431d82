#pragma once
// The "cuda" Backend. No CUDA header is included here, so the core's factory
// can include this file from any translation unit.
//
// Ready events (GPU stream -> send thread) come in two modes, see
// ReadyEventMode; GPU waits on host flags (arrival -> GPU stream) use
// cuStreamWaitValue32 or a one-thread wait kernel, see StreamWaitMode.
// docs/cuda.md explains when to pick which.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "stepmesh/backend.h"

namespace stepmesh {

namespace cuda {
class CudaApi;
}  // namespace cuda

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

enum class StreamWaitMode : uint8_t {
  // cuStreamWaitValue32/cuStreamWriteValue32 when the driver has them and the
  // stream is not being captured into a graph; the flag kernels otherwise.
  kAuto,
  // Always the stream memory operations; UNIMPLEMENTED when unavailable.
  kStreamMemOp,
  // Always the one-thread kernels (graph-safe; holds one SM slot while waiting).
  kKernel,
};

struct CudaBackendOptions {
  ReadyEventMode ready_event_mode = ReadyEventMode::kCopyEngineFlag;
  StreamWaitMode stream_wait_mode = StreamWaitMode::kAuto;
  // Events created up front; the pool grows on demand and never shrinks.
  int initial_events = 16;
  // Ask cuStreamWaitValue32 to flush outstanding remote (GPUDirect RDMA)
  // writes before later work runs (CU_STREAM_WAIT_VALUE_FLUSH). Needs device
  // support; not available on the kernel path.
  bool flush_remote_writes = false;
  // Where PCI devices' numa_node files live; tests point it at a fake tree.
  std::string sysfs_root = "/sys";
};

// A backend on CUDA device `device` (any index the driver reports; no cap).
// UNAVAILABLE when there is no driver or no device, INVALID_ARGUMENT for an
// index out of range.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device,
                                                           const CudaBackendOptions& options = {});

// As above over an explicit CudaApi (tests pass a fake).
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(std::shared_ptr<cuda::CudaApi> api,
                                                           int device,
                                                           const CudaBackendOptions& options = {});

// The cudaStream_t behind a Stream made by a CUDA backend (as void*), for
// capturing it into a graph or handing it to kernels; INVALID_ARGUMENT for
// other streams.
absl::StatusOr<void*> NativeCudaStream(Stream& stream);

// Wraps an existing cudaStream_t (e.g. a framework's current stream) without
// taking ownership; `backend` must be a CUDA backend and outlive the result.
absl::StatusOr<std::unique_ptr<Stream>> WrapCudaStream(Backend& backend, void* cuda_stream);

}  // namespace stepmesh
