// The CUDA backend. Everything goes through CudaApi (cuda_api.h), so these files
// are exercised in CI against a fake, and on GPU machines against the runtime:
// the state shared by all (cuda_device_context.h), memory and host flags
// (cuda_host_flag.h), the event pool, streams and events (cuda_stream.h), and
// here the Backend and the public entry points of stepmesh/cuda.h.
//
// Ownership: every object handed out (Memory, Stream, Event, HostFlag) holds a
// shared_ptr to what it needs (the device context, the event pool), so
// destruction order between them and the Backend does not matter.
//
// Rules these files keep, each because breaking it hangs or corrupts a real
// process (docs/cuda.md, "What the backend never does"):
//  * No legacy default stream: its implicit synchronisation with every
//    blocking stream (PyTorch's default stream is one) would queue the
//    backend's copies behind an application's wait for the very reply those
//    copies produce. Copies go on the backend's own non-blocking streams.
//  * No device switch on a thread that has no current context: "restoring"
//    device 0 afterwards would create device 0's primary context.
//  * Nothing that waits for the whole device (allocation, kernel loading)
//    after creation, except in destructors, and a HostFlag releases the
//    stream waits on it before it goes.
//  * The backend's calls run in relaxed stream-capture mode, as NCCL's proxy
//    thread does, so they never break an application thread's graph capture.

#include "src/backends/cuda/cuda_backend.h"

#include <unistd.h>

#include <memory>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/backends/cuda/cuda_api.h"
#include "src/backends/cuda/cuda_device_context.h"
#include "src/backends/cuda/cuda_host_flag.h"
#include "src/backends/cuda/cuda_status.h"
#include "src/backends/cuda/cuda_stream.h"
#include "src/base/logging.h"
#include "stepmesh/options.h"
#include "stepmesh/status.h"

namespace stepmesh {
namespace cuda {
namespace {

class CudaBackend final : public Backend {
 public:
  CudaBackend(std::shared_ptr<DeviceContext> context, std::shared_ptr<EventPool> pool)
      : context_(std::move(context)), pool_(std::move(pool)) {}

  absl::string_view name() const override { return "cuda"; }
  Device device() const override { return Device::Cuda(context_->device()); }

  absl::StatusOr<std::unique_ptr<Memory>> Allocate(size_t bytes, MemoryKind kind) override {
    CudaApi& api = context_->api();
    ScopedDevice scoped(api, context_->device());
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    // cudaMalloc(0) succeeds with a null pointer; hand out a real one instead.
    size_t request = std::max<size_t>(bytes, 1);
    if (kind == MemoryKind::kDevice) {
      // Whole host pages, so that ExportDmabuf's page-rounded range can stay
      // inside this one allocation (GPUDirect registration).
      const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
      request = (request + page - 1) / page * page;
    }
    void* data = nullptr;
    cudaError_t error = cudaSuccess;
    const char* call = "cudaMalloc";
    switch (kind) {
      case MemoryKind::kDevice:
        error = api.Malloc(&data, request);
        break;
      case MemoryKind::kHostPinned:
        call = "cudaHostAlloc(pinned)";
        error = api.HostAlloc(&data, request, cudaHostAllocPortable);
        break;
      case MemoryKind::kHostMapped:
        call = "cudaHostAlloc(mapped)";
        error = api.HostAlloc(&data, request, kMappedFlags);
        break;
    }
    STEPMESH_RETURN_IF_ERROR(CudaStatus(
        api, error, absl::StrCat(call, " of ", bytes, " bytes on device ", context_->device())));
    return std::make_unique<CudaMemory>(context_, data, bytes, kind);
  }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    CudaApi& api = context_->api();
    ScopedDevice scoped(api, context_->device());
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    cudaStream_t stream = nullptr;
    // Non-blocking: no implicit synchronisation with the legacy default stream,
    // which other libraries in the process may be using.
    STEPMESH_RETURN_IF_ERROR(CudaStatus(
        api,
        api.StreamCreateWithPriority(&stream, cudaStreamNonBlocking, context_->stream_priority()),
        "cudaStreamCreateWithPriority"));
    return std::make_unique<CudaStream>(context_, stream, /*owned=*/true);
  }

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    STEPMESH_ASSIGN_OR_RETURN(EventSlot * slot, pool_->Acquire());
    return std::make_unique<CudaEvent>(pool_, slot);
  }

  absl::StatusOr<std::unique_ptr<HostFlag>> CreateHostFlag() override {
    CudaApi& api = context_->api();
    ScopedDevice scoped(api, context_->device());
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    void* host = nullptr;
    STEPMESH_RETURN_IF_ERROR(CudaStatus(api, api.HostAlloc(&host, kHostFlagBytes, kMappedFlags),
                                        "cudaHostAlloc(host flag)"));
    std::memset(host, 0, kHostFlagBytes);
    void* device = nullptr;
    const cudaError_t error = api.HostGetDevicePointer(&device, host, 0);
    if (error != cudaSuccess) {
      (void)api.FreeHost(host);
      return CudaStatus(api, error, "cudaHostGetDevicePointer(host flag)");
    }
    return std::make_unique<CudaHostFlag>(context_, static_cast<uint32_t*>(host),
                                          static_cast<uint32_t*>(device));
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    return context_->Copy(dst, src, bytes);
  }

  absl::StatusOr<MemoryLocation> Locate(const void* ptr) override {
    if (ptr == nullptr) {  // the backend's own device
      const int device = context_->device();
      STEPMESH_ASSIGN_OR_RETURN(auto topology, context_->DeviceTopology(device));
      return MemoryLocation{Device::Cuda(device), topology.second, std::move(topology.first)};
    }
    STEPMESH_ASSIGN_OR_RETURN(const cudaPointerAttributes attributes, Attributes(ptr));
    if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) {
      return MemoryLocation{Device::Cpu(), -1, ""};
    }
    STEPMESH_ASSIGN_OR_RETURN(auto topology, context_->DeviceTopology(attributes.device));
    return MemoryLocation{Device::Cuda(attributes.device), topology.second,
                          std::move(topology.first)};
  }

  absl::StatusOr<int> ExportDmabuf(const void* ptr, size_t bytes, uint64_t* offset) override {
    if (offset == nullptr || bytes == 0) {
      return absl::InvalidArgumentError("ExportDmabuf: needs a non-empty range and an offset");
    }
    CudaApi& api = context_->api();
    if (!api.HasDmabufExport()) {
      return absl::UnimplementedError(
          "ExportDmabuf: the driver has no cuMemGetHandleForAddressRange (needs CUDA 11.7+)");
    }
    STEPMESH_ASSIGN_OR_RETURN(const cudaPointerAttributes attributes, Attributes(ptr));
    if (attributes.type != cudaMemoryTypeDevice) {
      return absl::InvalidArgumentError("ExportDmabuf: not CUDA device memory");
    }
    ScopedDevice scoped(api, attributes.device);
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    const uintptr_t address = reinterpret_cast<uintptr_t>(ptr);
    // The driver exports whole host pages, whichever allocations they hold;
    // the NIC may then reach all of them through the fd. So the pages must
    // lie inside the one allocation that holds the tensor: a sub-allocation
    // (a caching allocator's block, a small cudaMalloc) that shares a page
    // with its neighbours is refused, and the caller registers it otherwise.
    CUdeviceptr allocation = 0;
    size_t allocation_bytes = 0;
    STEPMESH_RETURN_IF_ERROR(CuResultStatus(
        api,
        api.MemGetAddressRange(&allocation, &allocation_bytes, static_cast<CUdeviceptr>(address)),
        "ExportDmabuf: cuMemGetAddressRange"));
    const uintptr_t alloc_begin = static_cast<uintptr_t>(allocation);
    const uintptr_t alloc_end = alloc_begin + allocation_bytes;
    if (address + bytes > alloc_end) {
      return absl::InvalidArgumentError(
          absl::StrCat("ExportDmabuf: ", bytes, " bytes at 0x", absl::Hex(address),
                       " run past the end of their CUDA allocation [0x", absl::Hex(alloc_begin),
                       ", 0x", absl::Hex(alloc_end), ")"));
    }
    // The driver wants a host-page-aligned range; the NIC gets the offset of
    // `ptr` inside it (ibv_reg_dmabuf_mr's offset argument).
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t base = address & ~(page - 1);
    const uintptr_t end = (address + bytes + page - 1) & ~(page - 1);
    if (base < alloc_begin || end > alloc_end) {
      return absl::FailedPreconditionError(
          absl::StrCat("ExportDmabuf: the page-aligned range [0x", absl::Hex(base), ", 0x",
                       absl::Hex(end), ") a dma-buf needs reaches outside the CUDA allocation [0x",
                       absl::Hex(alloc_begin), ", 0x", absl::Hex(alloc_end),
                       ") that holds the tensor, into memory a NIC must not reach"));
    }
    int fd = -1;
    STEPMESH_RETURN_IF_ERROR(CuResultStatus(
        api,
        api.MemGetHandleForAddressRange(&fd, static_cast<CUdeviceptr>(base), end - base,
                                        CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
        "cuMemGetHandleForAddressRange(dma-buf)"));
    *offset = address - base;
    return fd;
  }

  absl::Status FlushRemoteWrites() override {
    std::call_once(remote_writes_once_, [this] { remote_writes_ = ProbeRemoteWrites(); });
    if (!remote_writes_.ok()) return remote_writes_.status();
    switch (*remote_writes_) {
      case RemoteWrites::kOrdered:
        return absl::OkStatus();
      case RemoteWrites::kUnflushable:
        // Never a silent weaker path: the core would report an arrival whose
        // bytes the device may not see yet.
        return absl::FailedPreconditionError(absl::StrCat(
            "cuda:", context_->device(),
            " neither orders GPUDirect RDMA writes (cudaDevAttrGPUDirectRDMAWritesOrdering) nor "
            "can flush them from the host (cudaDevAttrGPUDirectRDMAFlushWritesOptions), so data "
            "a NIC writes into its memory may be read stale; stage device tensors through host "
            "memory instead (STEPMESH_RDMA_GPUDIRECT=off)"));
      case RemoteWrites::kFlushFromHost:
        break;
    }
    CudaApi& api = context_->api();
    RelaxedCapture relaxed(api);
    ScopedDevice scoped(api, context_->device());
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    return CudaStatus(
        api,
        api.DeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                           cudaFlushGPUDirectRDMAWritesToOwner),
        "cudaDeviceFlushGPUDirectRDMAWrites");
  }

  const std::shared_ptr<DeviceContext>& context() const { return context_; }

 private:
  enum class RemoteWrites : uint8_t { kOrdered, kFlushFromHost, kUnflushable };

  // What this device needs before its streams may read what a NIC wrote.
  absl::StatusOr<RemoteWrites> ProbeRemoteWrites() {
    CudaApi& api = context_->api();
    const int device = context_->device();
    int ordering = 0;
    int flush_options = 0;
    STEPMESH_RETURN_IF_ERROR(CudaStatus(
        api, api.DeviceGetAttribute(&ordering, cudaDevAttrGPUDirectRDMAWritesOrdering, device),
        "cudaDeviceGetAttribute(GPUDirectRDMAWritesOrdering)"));
    if (ordering >= cudaGPUDirectRDMAWritesOrderingOwner) return RemoteWrites::kOrdered;
    STEPMESH_RETURN_IF_ERROR(CudaStatus(
        api,
        api.DeviceGetAttribute(&flush_options, cudaDevAttrGPUDirectRDMAFlushWritesOptions, device),
        "cudaDeviceGetAttribute(GPUDirectRDMAFlushWritesOptions)"));
    if (flush_options & cudaFlushGPUDirectRDMAWritesOptionHost) return RemoteWrites::kFlushFromHost;
    return RemoteWrites::kUnflushable;
  }

  absl::StatusOr<cudaPointerAttributes> Attributes(const void* ptr) {
    CudaApi& api = context_->api();
    STEPMESH_RETURN_IF_ERROR(BindThread(api, context_->device()));
    cudaPointerAttributes attributes{};
    const cudaError_t error = api.PointerGetAttributes(&attributes, ptr);
    if (error == cudaErrorInvalidValue) {
      // Plain host memory the driver never saw (older drivers say so this way).
      attributes.type = cudaMemoryTypeUnregistered;
      return attributes;
    }
    STEPMESH_RETURN_IF_ERROR(CudaStatus(api, error, "cudaPointerGetAttributes"));
    return attributes;
  }

  const std::shared_ptr<DeviceContext> context_;
  const std::shared_ptr<EventPool> pool_;
  std::once_flag remote_writes_once_;
  absl::StatusOr<RemoteWrites> remote_writes_ = absl::UnknownError("not probed");
};

// Options the device cannot honour fail creation rather than weaken later.
absl::Status CheckOptions(CudaApi& api, int device, const CudaBackendOptions& options) {
  if (options.event_pool_size < 0) {
    return absl::InvalidArgumentError("CudaBackendOptions::event_pool_size is negative");
  }
  if (options.fault_check_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("CudaBackendOptions::fault_check_interval must be positive");
  }
  if (options.stream_wait_mode == StreamWaitMode::kStreamMemOp &&
      options.device_max_connections == 1) {
    return absl::FailedPreconditionError(
        "StreamWaitMode::kStreamMemOp with CUDA_DEVICE_MAX_CONNECTIONS=1: a stream memory-op "
        "wait would block the device's only hardware queue, the backend's own copies included; "
        "use kAuto or kKernel");
  }
  if (!options.flush_remote_writes) return absl::OkStatus();
  if (options.stream_wait_mode == StreamWaitMode::kKernel || options.device_max_connections == 1) {
    return absl::FailedPreconditionError(
        "CudaBackendOptions::flush_remote_writes needs stream memory-op waits "
        "(CU_STREAM_WAIT_VALUE_FLUSH); the wait kernel cannot flush remote writes");
  }
  if (!api.HasStreamMemOps()) {
    return absl::FailedPreconditionError(
        "CudaBackendOptions::flush_remote_writes: the driver exposes no cuStreamWaitValue32");
  }
  int can_flush = 0;
  STEPMESH_RETURN_IF_ERROR(
      CudaStatus(api, api.DeviceGetAttribute(&can_flush, cudaDevAttrCanFlushRemoteWrites, device),
                 "cudaDeviceGetAttribute(CanFlushRemoteWrites)"));
  if (can_flush == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CudaBackendOptions::flush_remote_writes: device ", device,
        " cannot flush remote writes (cudaDevAttrCanFlushRemoteWrites is 0, as on most x86 "
        "hosts); leave it off: the core flushes arrivals with FlushRemoteWrites()"));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace cuda

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(std::shared_ptr<cuda::CudaApi> api,
                                                           int device,
                                                           const CudaBackendOptions& options) {
  if (api == nullptr) return absl::InvalidArgumentError("CreateCudaBackend: no CudaApi");
  if (device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device index ", device, " is negative"));
  }
  int count = 0;
  const cudaError_t error = api->GetDeviceCount(&count);
  if (error != cudaSuccess) {
    return cuda::CudaStatus(*api, error,
                            "cuda backend: cudaGetDeviceCount failed (no NVIDIA driver or GPU?)");
  }
  if (count == 0) return absl::UnavailableError("cuda backend: no CUDA device is visible");
  if (device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: device ", device, " does not exist (", count, " visible)"));
  }
  // CUDA itself reads CUDA_DEVICE_MAX_CONNECTIONS; so must we, also for
  // direct users (Megatron sets it to 1) who never went through MeshOptions.
  CudaBackendOptions effective = options;
  if (effective.device_max_connections == 0) {
    STEPMESH_ASSIGN_OR_RETURN(effective.device_max_connections, CudaDeviceMaxConnectionsFromEnv());
  }
  STEPMESH_RETURN_IF_ERROR(cuda::CheckOptions(*api, device, effective));
  STEPMESH_ASSIGN_OR_RETURN(auto context,
                            cuda::DeviceContext::Create(std::move(api), device, effective));
  STEPMESH_ASSIGN_OR_RETURN(auto pool, cuda::EventPool::Create(context, options.event_pool_size));
  return std::unique_ptr<Backend>(new cuda::CudaBackend(std::move(context), std::move(pool)));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device,
                                                           const CudaBackendOptions& options) {
  return CreateCudaBackend(cuda::CreateRuntimeCudaApi(), device, options);
}

absl::StatusOr<void*> NativeCudaStream(Stream& stream) {
  auto* cuda_stream = dynamic_cast<cuda::CudaStream*>(&stream);
  if (cuda_stream == nullptr) {
    return absl::InvalidArgumentError("NativeCudaStream: not a CUDA backend stream");
  }
  return static_cast<void*>(cuda_stream->handle());
}

absl::StatusOr<std::unique_ptr<Stream>> WrapCudaStream(Backend& backend, void* cuda_stream) {
  auto* cuda_backend = dynamic_cast<cuda::CudaBackend*>(&backend);
  if (cuda_backend == nullptr) {
    return absl::InvalidArgumentError("WrapCudaStream: not a CUDA backend");
  }
  return std::unique_ptr<Stream>(new cuda::CudaStream(
      cuda_backend->context(), static_cast<cudaStream_t>(cuda_stream), /*owned=*/false));
}

absl::Status RecordOnCudaStream(Event& event, void* cuda_stream) {
  auto* cuda_event = dynamic_cast<cuda::CudaEvent*>(&event);
  if (cuda_event == nullptr) {
    return absl::InvalidArgumentError(
        "RecordOnCudaStream: the event was not made by a CUDA backend");
  }
  return cuda_event->RecordOn(static_cast<cudaStream_t>(cuda_stream));
}

absl::Status PreloadCudaKernels(Backend& backend, absl::Span<const void* const> kernels) {
  auto* cuda_backend = dynamic_cast<cuda::CudaBackend*>(&backend);
  if (cuda_backend == nullptr) {
    return absl::InvalidArgumentError("PreloadCudaKernels: not a CUDA backend");
  }
  cuda::DeviceContext& context = *cuda_backend->context();
  cuda::ScopedDevice scoped(context.api(), context.device());
  STEPMESH_RETURN_IF_ERROR(scoped.status());
  for (size_t i = 0; i < kernels.size(); ++i) {
    STEPMESH_RETURN_IF_ERROR(cuda::CudaStatus(context.api(), context.api().LoadKernel(kernels[i]),
                                              absl::StrCat("PreloadCudaKernels: kernel ", i)));
  }
  return absl::OkStatus();
}

}  // namespace stepmesh
