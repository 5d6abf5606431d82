#pragma once

// Helpers shared by the .cu files of afd_model_cuda; not part of the API.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace afd::cuda::internal {

inline constexpr int kElementwiseThreads = 256;

// Grid for a grid-stride elementwise kernel: enough blocks to fill an H200
// (132 SMs x 16 resident blocks) without launching millions of tiny blocks.
inline unsigned int ElementwiseBlocks(int64_t count) {
  const int64_t needed = (count + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<unsigned int>(std::clamp<int64_t>(needed, 1, 132 * 16));
}

// The status of the launch just made, and of any earlier asynchronous error.
inline cudaError_t LaunchStatus() { return cudaGetLastError(); }

// 16-byte asynchronous global -> shared copy (sm_80+), shared by the attention
// and GEMM pipelines. src-size 0 zero-fills the 16 bytes: rows past a valid
// range become 0, so 0-probability x garbage can never produce a NaN.
__device__ __forceinline__ void CpAsync16(void* shared, const void* global, bool valid) {
  const unsigned int address = static_cast<unsigned int>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ float WarpSum(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
  }
  return value;
}

__device__ __forceinline__ float WarpMax(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = fmaxf(value, __shfl_xor_sync(0xFFFFFFFFu, value, offset));
  }
  return value;
}

}  // namespace afd::cuda::internal
