// Kernels cuda_gpu_tests needs beyond the backend's own: a device fault on
// demand, and a stand-in for a model kernel that reads what arrived.

#include "tests/cuda/gpu_test_kernels.h"

namespace stepmesh::testing {
namespace {

// Stores through an address no allocation holds: cudaErrorIllegalAddress,
// sticky for the whole context, as a buggy model kernel would cause.
__global__ void FaultKernel(int* nowhere) { *nowhere = 1; }

// out[i] = in[i] + 1, one block of threads striding over the buffer.
__global__ void AddOneKernel(const uint32_t* in, uint32_t* out, size_t count) {
  for (size_t i = threadIdx.x; i < count; i += blockDim.x) out[i] = in[i] + 1;
}

}  // namespace

cudaError_t LaunchFaultKernel(cudaStream_t stream) {
  int* nowhere = reinterpret_cast<int*>(uintptr_t{16});
  void* args[] = {&nowhere};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&FaultKernel), dim3(1), dim3(1), args, 0,
                          stream);
}

cudaError_t LaunchAddOneKernel(cudaStream_t stream, const uint32_t* in, uint32_t* out,
                               size_t count) {
  void* args[] = {&in, &out, &count};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&AddOneKernel), dim3(1), dim3(256), args, 0,
                          stream);
}

const void* AddOneKernelSymbol() { return reinterpret_cast<const void*>(&AddOneKernel); }

}  // namespace stepmesh::testing
