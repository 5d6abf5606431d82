#pragma once
// CudaApi: the one seam between the CUDA backend and CUDA itself (the idea of
// NCCL's cudawrap). The backend calls nothing from CUDA directly, so
//  * its logic (event pooling, wait-path selection, error mapping) runs in CI
//    against a fake that has no GPU and no driver, and
//  * driver entry points (cuStreamWaitValue32, cuMemGetHandleForAddressRange)
//    are resolved at run time through cudaGetDriverEntryPointByVersion, so the
//    library neither links libcuda nor fails to load where it is missing.
//
// Methods mirror the CUDA calls one to one (same arguments, same error codes);
// the only additions are the two flag kernels, kernel loading and Has*()
// capability queries.

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace stepmesh::cuda {

class CudaApi {
 public:
  virtual ~CudaApi() = default;

  // --- Runtime: devices -----------------------------------------------------
  virtual cudaError_t GetDeviceCount(int* count) = 0;
  virtual cudaError_t GetDevice(int* device) = 0;
  // Makes `device` current on the calling thread and, from CUDA 12 on,
  // creates its primary context (device memory, ~0.5 GB) if it has none yet.
  virtual cudaError_t SetDevice(int device) = 0;
  virtual cudaError_t DeviceGetPCIBusId(char* bus_id, int len, int device) = 0;
  virtual cudaError_t DeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) = 0;
  // Waits until GPUDirect RDMA writes that reached the current device are
  // visible to it (CUDA 11.3+; the device must list the host flush option).
  virtual cudaError_t DeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTarget target,
                                                     cudaFlushGPUDirectRDMAWritesScope scope) = 0;

  // --- Runtime: memory ------------------------------------------------------
  virtual cudaError_t Malloc(void** ptr, size_t bytes) = 0;
  virtual cudaError_t Free(void* ptr) = 0;
  virtual cudaError_t HostAlloc(void** ptr, size_t bytes, unsigned int flags) = 0;
  virtual cudaError_t FreeHost(void* ptr) = 0;
  virtual cudaError_t HostGetDevicePointer(void** device_ptr, void* host_ptr,
                                           unsigned int flags) = 0;
  virtual cudaError_t PointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) = 0;
  virtual cudaError_t Memcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) = 0;
  virtual cudaError_t MemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                                  cudaStream_t stream) = 0;

  // --- Runtime: streams and events ------------------------------------------
  virtual cudaError_t StreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) = 0;
  // Lower numbers are higher priorities; `greatest` is the highest one.
  virtual cudaError_t DeviceGetStreamPriorityRange(int* least, int* greatest) = 0;
  virtual cudaError_t StreamCreateWithPriority(cudaStream_t* stream, unsigned int flags,
                                               int priority) = 0;
  virtual cudaError_t StreamSynchronize(cudaStream_t stream) = 0;
  virtual cudaError_t StreamDestroy(cudaStream_t stream) = 0;
  virtual cudaError_t StreamQuery(cudaStream_t stream) = 0;
  virtual cudaError_t StreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) = 0;
  virtual cudaError_t LaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) = 0;
  virtual cudaError_t EventCreateWithFlags(cudaEvent_t* event, unsigned int flags) = 0;
  virtual cudaError_t EventDestroy(cudaEvent_t event) = 0;
  virtual cudaError_t EventRecord(cudaEvent_t event, cudaStream_t stream) = 0;
  virtual cudaError_t EventQuery(cudaEvent_t event) = 0;
  // Swaps the calling thread's stream-capture interaction mode (push/pop).
  virtual cudaError_t ThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) = 0;

  virtual const char* GetErrorName(cudaError_t error) = 0;
  virtual const char* GetErrorString(cudaError_t error) = 0;

  // --- Flag kernels (flag_kernels.cu); one thread each, graph-capturable ----
  // Later work on `stream` waits until (int32_t)(*flag - value) >= 0, the same
  // cyclic comparison as CU_STREAM_WAIT_VALUE_GEQ. `flag` is a device pointer.
  virtual cudaError_t LaunchWaitFlagKernel(cudaStream_t stream, const uint32_t* flag,
                                           uint32_t value) = 0;
  // Writes `value` to `flag` (system-scope release) when the stream gets there.
  virtual cudaError_t LaunchSignalFlagKernel(cudaStream_t stream, uint32_t* flag,
                                             uint32_t value) = 0;
  // Later work waits until (int32_t)(*counter - (*cursor + 1)) >= 0, then the
  // kernel stores *cursor + 1 to *cursor: the target is read when the kernel
  // runs, so a replayed graph waits for one more increment each time.
  virtual cudaError_t LaunchWaitNextFlagKernel(cudaStream_t stream, const uint32_t* counter,
                                               uint32_t* cursor) = 0;
  // Later work waits until *counter >= *target (int64 device pointers, both
  // read when the kernel runs).
  virtual cudaError_t LaunchWaitCounterKernel(cudaStream_t stream, const int64_t* counter,
                                              const int64_t* target) = 0;
  // *counter += 1 (system-scope atomic, after a release fence) when the stream
  // gets there; `counter` is a device pointer (mapped pinned host memory).
  virtual cudaError_t LaunchIncrementCounterKernel(cudaStream_t stream, int64_t* counter) = 0;
  // Loads the flag kernels into the current context now. Under lazy loading
  // (the default since CUDA 12.2) a kernel is loaded at its first launch, and
  // loading waits for the whole device: with a wait kernel spinning on a flag
  // the launching thread would raise, that wait never ends.
  virtual cudaError_t LoadFlagKernels() = 0;
  // The same for any kernel (the host stub of a __global__ function).
  virtual cudaError_t LoadKernel(const void* kernel) = 0;

  // --- Driver entry points; CUDA_ERROR_NOT_FOUND when unresolved ------------
  virtual bool HasStreamMemOps() = 0;
  virtual CUresult StreamWaitValue32(CUstream stream, CUdeviceptr addr, uint32_t value,
                                     unsigned int flags) = 0;
  virtual CUresult StreamWriteValue32(CUstream stream, CUdeviceptr addr, uint32_t value,
                                      unsigned int flags) = 0;
  virtual bool HasDmabufExport() = 0;
  virtual CUresult MemGetHandleForAddressRange(void* handle, CUdeviceptr ptr, size_t bytes,
                                               CUmemRangeHandleType type,
                                               unsigned long long flags) = 0;
  // The calling thread's current context; null when it has none (the runtime
  // would then create device 0's primary context on its next call).
  virtual CUresult CtxGetCurrent(CUcontext* context) = 0;
  virtual CUresult CtxSetCurrent(CUcontext context) = 0;
  // Base and size of the allocation that contains `ptr`.
  virtual CUresult MemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) = 0;
  // Name of a driver error ("CUDA_ERROR_NOT_SUPPORTED"); never null.
  virtual const char* GetDriverErrorName(CUresult error) = 0;
};

// The real thing: CUDA runtime (statically linked) plus driver entry points
// resolved on first use of a device. Never fails; a missing driver shows up as
// errors from the calls themselves (cudaErrorInsufficientDriver & co).
std::shared_ptr<CudaApi> CreateRuntimeCudaApi();

}  // namespace stepmesh::cuda
