// One-thread kernels that wait on / write a 32-bit word in mapped host memory.
// They occupy one SM slot while waiting, which is the price of being usable
// inside a captured CUDA graph; outside graphs the backend prefers stream
// memory operations, which use no SM at all.

#include "src/backends/cuda/flag_kernels.h"

namespace stepmesh::cuda {
namespace {

// Acquire at system scope: the host (or a NIC) writes the flag over PCIe, and
// work after the wait must observe whatever was published before the flag.
// A plain load could be hoisted out of the loop by the compiler (the bug in
// StepMesh's spin flag); an ld.acquire.sys is re-issued on every iteration.
__device__ __forceinline__ uint32_t LoadAcquireSystem(const uint32_t* flag) {
  uint32_t value;
  asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

__device__ __forceinline__ int64_t LoadAcquireSystem64(const int64_t* word) {
  int64_t value;
  asm volatile("ld.acquire.sys.s64 %0, [%1];" : "=l"(value) : "l"(word) : "memory");
  return value;
}

__device__ __forceinline__ void StoreReleaseSystem(uint32_t* flag, uint32_t value) {
  asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

__global__ void WaitFlagKernel(const uint32_t* flag, uint32_t value) {
  // Cyclic comparison, as CU_STREAM_WAIT_VALUE_GEQ: sequence numbers may wrap.
  while (static_cast<int32_t>(LoadAcquireSystem(flag) - value) < 0) {
    // Back off a little: every poll is a PCIe read of host memory.
    __nanosleep(128);
  }
}

__global__ void SignalFlagKernel(uint32_t* flag, uint32_t value) {
  StoreReleaseSystem(flag, value);
}

// The target comes from memory, not from the launch: a graph replaying this
// node waits for the next increment of `counter` every time. Only this kernel
// writes `cursor` (one stream per cursor), so a plain read-modify-write will do.
__global__ void WaitNextFlagKernel(const uint32_t* counter, uint32_t* cursor) {
  const uint32_t target = LoadAcquireSystem(cursor) + 1;
  while (static_cast<int32_t>(LoadAcquireSystem(counter) - target) < 0) __nanosleep(128);
  StoreReleaseSystem(cursor, target);
}

// Both words are read when it runs (a replayed graph waits for the values of
// that replay); the target may be device memory an earlier kernel of the
// stream wrote, the counter host memory the host bumps.
__global__ void WaitCounterKernel(const int64_t* counter, const int64_t* target) {
  const int64_t want = LoadAcquireSystem64(target);
  while (LoadAcquireSystem64(counter) < want) __nanosleep(128);
}

// Publishes the stream's earlier work, then bumps the counter the host polls:
// a host that reads the new value (acquire) sees what the stream wrote before.
// The address is the kernel's argument, the value lives in memory: a graph
// replaying this node increments again each time.
__global__ void IncrementCounterKernel(int64_t* counter) {
  __threadfence_system();
  atomicAdd_system(reinterpret_cast<unsigned long long*>(counter), 1ull);
}

}  // namespace

// cudaLaunchKernel rather than <<<>>>: it returns the launch error itself,
// where cudaGetLastError could report (and clear) an unrelated earlier error
// of the calling thread.
cudaError_t LaunchWaitFlagKernel(cudaStream_t stream, const uint32_t* flag, uint32_t value) {
  void* args[] = {&flag, &value};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&WaitFlagKernel), dim3(1), dim3(1), args, 0,
                          stream);
}

cudaError_t LaunchSignalFlagKernel(cudaStream_t stream, uint32_t* flag, uint32_t value) {
  void* args[] = {&flag, &value};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&SignalFlagKernel), dim3(1), dim3(1), args,
                          0, stream);
}

cudaError_t LaunchWaitNextFlagKernel(cudaStream_t stream, const uint32_t* counter,
                                     uint32_t* cursor) {
  void* args[] = {&counter, &cursor};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&WaitNextFlagKernel), dim3(1), dim3(1),
                          args, 0, stream);
}

cudaError_t LaunchWaitCounterKernel(cudaStream_t stream, const int64_t* counter,
                                    const int64_t* target) {
  void* args[] = {&counter, &target};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&WaitCounterKernel), dim3(1), dim3(1), args,
                          0, stream);
}

cudaError_t LaunchIncrementCounterKernel(cudaStream_t stream, int64_t* counter) {
  void* args[] = {&counter};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&IncrementCounterKernel), dim3(1), dim3(1),
                          args, 0, stream);
}

cudaError_t LoadFlagKernels() {
  // cudaFuncGetAttributes finishes loading a lazily loaded kernel, with any
  // device-wide wait that takes, here rather than at a first launch.
  cudaFuncAttributes attributes{};
  cudaError_t error =
      cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&WaitFlagKernel));
  if (error != cudaSuccess) return error;
  error = cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&WaitNextFlagKernel));
  if (error != cudaSuccess) return error;
  error = cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&WaitCounterKernel));
  if (error != cudaSuccess) return error;
  error =
      cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&IncrementCounterKernel));
  if (error != cudaSuccess) return error;
  return cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&SignalFlagKernel));
}

}  // namespace stepmesh::cuda
