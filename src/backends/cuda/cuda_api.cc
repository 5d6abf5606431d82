// The real CudaApi: forwards to the CUDA runtime (linked statically, so the
// library has no load-time dependency on a GPU) and resolves driver entry
// points through cudaGetDriverEntryPointByVersion on first use. Resolving by
// version pins the ABI we were compiled against; a newer driver still hands
// back that version of the function.

#include "src/backends/cuda/cuda_api.h"

#include <mutex>

#include "src/backends/cuda/driver_entry_point.h"
#include "src/backends/cuda/flag_kernels.h"

namespace stepmesh::cuda {
namespace {

using driver::Resolve;

using StreamValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using GetHandleFn = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType,
                                 unsigned long long);
using GetErrorNameFn = CUresult (*)(CUresult, const char**);
using CtxGetCurrentFn = CUresult (*)(CUcontext*);
using CtxSetCurrentFn = CUresult (*)(CUcontext);
using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// ABI versions of the entry points we call (see cudaTypedefs.h). 12000 selects
// the stream memory operations that are always enabled on CUDA 12+ drivers.
constexpr unsigned int kStreamMemOpsVersion = 12000;
constexpr unsigned int kGetHandleVersion = 11070;
constexpr unsigned int kGetErrorNameVersion = 6000;
constexpr unsigned int kCtxCurrentVersion = 4000;
constexpr unsigned int kGetAddressRangeVersion = 3020;

class RuntimeCudaApi final : public CudaApi {
 public:
  cudaError_t GetDeviceCount(int* count) override { return cudaGetDeviceCount(count); }
  cudaError_t GetDevice(int* device) override { return cudaGetDevice(device); }
  cudaError_t SetDevice(int device) override { return cudaSetDevice(device); }
  cudaError_t DeviceGetPCIBusId(char* bus_id, int len, int device) override {
    return cudaDeviceGetPCIBusId(bus_id, len, device);
  }
  cudaError_t DeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) override {
    return cudaDeviceGetAttribute(value, attr, device);
  }
  cudaError_t DeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTarget target,
                                             cudaFlushGPUDirectRDMAWritesScope scope) override {
    return cudaDeviceFlushGPUDirectRDMAWrites(target, scope);
  }

  cudaError_t Malloc(void** ptr, size_t bytes) override { return cudaMalloc(ptr, bytes); }
  cudaError_t Free(void* ptr) override { return cudaFree(ptr); }
  cudaError_t HostAlloc(void** ptr, size_t bytes, unsigned int flags) override {
    return cudaHostAlloc(ptr, bytes, flags);
  }
  cudaError_t FreeHost(void* ptr) override { return cudaFreeHost(ptr); }
  cudaError_t HostGetDevicePointer(void** device_ptr, void* host_ptr, unsigned int flags) override {
    return cudaHostGetDevicePointer(device_ptr, host_ptr, flags);
  }
  cudaError_t PointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) override {
    return cudaPointerGetAttributes(attributes, ptr);
  }
  cudaError_t Memcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) override {
    return cudaMemcpy(dst, src, bytes, kind);
  }
  cudaError_t MemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                          cudaStream_t stream) override {
    return cudaMemcpyAsync(dst, src, bytes, kind, stream);
  }

  cudaError_t StreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) override {
    return cudaStreamCreateWithFlags(stream, flags);
  }
  cudaError_t DeviceGetStreamPriorityRange(int* least, int* greatest) override {
    return cudaDeviceGetStreamPriorityRange(least, greatest);
  }
  cudaError_t StreamCreateWithPriority(cudaStream_t* stream, unsigned int flags,
                                       int priority) override {
    return cudaStreamCreateWithPriority(stream, flags, priority);
  }
  cudaError_t StreamSynchronize(cudaStream_t stream) override {
    return cudaStreamSynchronize(stream);
  }
  cudaError_t StreamDestroy(cudaStream_t stream) override { return cudaStreamDestroy(stream); }
  cudaError_t StreamQuery(cudaStream_t stream) override { return cudaStreamQuery(stream); }
  cudaError_t StreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) override {
    return cudaStreamIsCapturing(stream, status);
  }
  cudaError_t LaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) override {
    return cudaLaunchHostFunc(stream, fn, user_data);
  }
  cudaError_t EventCreateWithFlags(cudaEvent_t* event, unsigned int flags) override {
    return cudaEventCreateWithFlags(event, flags);
  }
  cudaError_t EventDestroy(cudaEvent_t event) override { return cudaEventDestroy(event); }
  cudaError_t EventRecord(cudaEvent_t event, cudaStream_t stream) override {
    return cudaEventRecord(event, stream);
  }
  cudaError_t EventQuery(cudaEvent_t event) override { return cudaEventQuery(event); }
  cudaError_t ThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) override {
    return cudaThreadExchangeStreamCaptureMode(mode);
  }

  const char* GetErrorName(cudaError_t error) override { return cudaGetErrorName(error); }
  const char* GetErrorString(cudaError_t error) override { return cudaGetErrorString(error); }

  cudaError_t LaunchWaitFlagKernel(cudaStream_t stream, const uint32_t* flag,
                                   uint32_t value) override {
    return cuda::LaunchWaitFlagKernel(stream, flag, value);
  }
  cudaError_t LaunchSignalFlagKernel(cudaStream_t stream, uint32_t* flag, uint32_t value) override {
    return cuda::LaunchSignalFlagKernel(stream, flag, value);
  }
  cudaError_t LaunchWaitNextFlagKernel(cudaStream_t stream, const uint32_t* counter,
                                       uint32_t* cursor) override {
    return cuda::LaunchWaitNextFlagKernel(stream, counter, cursor);
  }
  cudaError_t LaunchWaitCounterKernel(cudaStream_t stream, const int64_t* counter,
                                      const int64_t* target) override {
    return cuda::LaunchWaitCounterKernel(stream, counter, target);
  }
  cudaError_t LaunchIncrementCounterKernel(cudaStream_t stream, int64_t* counter) override {
    return cuda::LaunchIncrementCounterKernel(stream, counter);
  }
  cudaError_t LoadFlagKernels() override { return cuda::LoadFlagKernels(); }
  cudaError_t LoadKernel(const void* kernel) override {
    // Asking for a kernel's attributes loads it into the current context.
    cudaFuncAttributes attributes{};
    return cudaFuncGetAttributes(&attributes, kernel);
  }

  bool HasStreamMemOps() override {
    ResolveOnce();
    return wait_value32_ != nullptr && write_value32_ != nullptr;
  }
  CUresult StreamWaitValue32(CUstream stream, CUdeviceptr addr, uint32_t value,
                             unsigned int flags) override {
    ResolveOnce();
    if (wait_value32_ == nullptr) return CUDA_ERROR_NOT_FOUND;
    return wait_value32_(stream, addr, value, flags);
  }
  CUresult StreamWriteValue32(CUstream stream, CUdeviceptr addr, uint32_t value,
                              unsigned int flags) override {
    ResolveOnce();
    if (write_value32_ == nullptr) return CUDA_ERROR_NOT_FOUND;
    return write_value32_(stream, addr, value, flags);
  }
  bool HasDmabufExport() override {
    ResolveOnce();
    return get_handle_ != nullptr;
  }
  CUresult MemGetHandleForAddressRange(void* handle, CUdeviceptr ptr, size_t bytes,
                                       CUmemRangeHandleType type,
                                       unsigned long long flags) override {
    ResolveOnce();
    if (get_handle_ == nullptr) return CUDA_ERROR_NOT_FOUND;
    return get_handle_(handle, ptr, bytes, type, flags);
  }
  CUresult CtxGetCurrent(CUcontext* context) override {
    ResolveOnce();
    if (ctx_get_current_ == nullptr) return CUDA_ERROR_NOT_FOUND;
    return ctx_get_current_(context);
  }
  CUresult CtxSetCurrent(CUcontext context) override {
    ResolveOnce();
    if (ctx_set_current_ == nullptr) return CUDA_ERROR_NOT_FOUND;
    return ctx_set_current_(context);
  }
  CUresult MemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) override {
    ResolveOnce();
    if (get_address_range_ == nullptr) return CUDA_ERROR_NOT_FOUND;
    return get_address_range_(base, size, ptr);
  }
  const char* GetDriverErrorName(CUresult error) override {
    ResolveOnce();
    const char* name = nullptr;
    if (get_error_name_ == nullptr || get_error_name_(error, &name) != CUDA_SUCCESS ||
        name == nullptr) {
      return "CUDA_ERROR_UNKNOWN_CODE";
    }
    return name;
  }

 private:
  // Lazily, because resolving initialises the runtime: constructing the API
  // must stay free on machines without a GPU.
  void ResolveOnce() {
    std::call_once(resolved_, [this] {
      wait_value32_ = Resolve<StreamValue32Fn>("cuStreamWaitValue32", kStreamMemOpsVersion);
      write_value32_ = Resolve<StreamValue32Fn>("cuStreamWriteValue32", kStreamMemOpsVersion);
      get_handle_ = Resolve<GetHandleFn>("cuMemGetHandleForAddressRange", kGetHandleVersion);
      get_error_name_ = Resolve<GetErrorNameFn>("cuGetErrorName", kGetErrorNameVersion);
      ctx_get_current_ = Resolve<CtxGetCurrentFn>("cuCtxGetCurrent", kCtxCurrentVersion);
      ctx_set_current_ = Resolve<CtxSetCurrentFn>("cuCtxSetCurrent", kCtxCurrentVersion);
      get_address_range_ =
          Resolve<GetAddressRangeFn>("cuMemGetAddressRange", kGetAddressRangeVersion);
    });
  }

  std::once_flag resolved_;
  StreamValue32Fn wait_value32_ = nullptr;
  StreamValue32Fn write_value32_ = nullptr;
  GetHandleFn get_handle_ = nullptr;
  GetErrorNameFn get_error_name_ = nullptr;
  CtxGetCurrentFn ctx_get_current_ = nullptr;
  CtxSetCurrentFn ctx_set_current_ = nullptr;
  GetAddressRangeFn get_address_range_ = nullptr;
};

}  // namespace

std::shared_ptr<CudaApi> CreateRuntimeCudaApi() { return std::make_shared<RuntimeCudaApi>(); }

}  // namespace stepmesh::cuda
