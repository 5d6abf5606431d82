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
