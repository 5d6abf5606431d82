// Small kernels the device engine needs besides the model kernels: greedy
// sampling on the device (so the next step's tokens never visit the host)
// and the KV-cache append.

#include <cmath>

#include "examples/afd_model/cuda/cuda_kernels.h"
#include "examples/afd_model/cuda/internal.cuh"

namespace afd::cuda {
namespace {

using internal::ElementwiseBlocks;
using internal::kElementwiseThreads;
using internal::LaunchStatus;

constexpr int kArgmaxThreads = 256;

// Whether (value b, index b) beats (value a, index a): larger, or equal with
// a lower index (the CPU's first maximum). Index -1 is "nothing yet".
__device__ __forceinline__ bool Better(float vb, int64_t ib, float va, int64_t ia) {
  if (ib < 0) return false;
  if (ia < 0) return true;
  return vb > va || (vb == va && ib < ia);
}

// One block per row; each thread scans a strided column subset (its first
// maximum is its lowest index), then a shared-memory tree keeps the overall
// first maximum.
__global__ void ArgmaxRowsKernel(const float* __restrict__ logits, int64_t cols,
                                 int32_t* __restrict__ ids) {
  __shared__ float values[kArgmaxThreads];
  __shared__ int64_t indices[kArgmaxThreads];
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * cols;
  float best = -INFINITY;
  int64_t best_index = -1;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = row[c];
    if (Better(v, c, best, best_index)) best = v, best_index = c;
  }
  values[threadIdx.x] = best;
  indices[threadIdx.x] = best_index;
  __syncthreads();
  for (int stride = kArgmaxThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      const int other = threadIdx.x + stride;
      if (Better(values[other], indices[other], values[threadIdx.x], indices[threadIdx.x])) {
        values[threadIdx.x] = values[other];
        indices[threadIdx.x] = indices[other];
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) ids[blockIdx.x] = static_cast<int32_t>(indices[0] < 0 ? 0 : indices[0]);
}

__global__ void ScatterRowsKernel(const float* __restrict__ src, int64_t rows, int64_t width,
                                  const int32_t* __restrict__ row_index, float* __restrict__ dst) {
  const int64_t count = rows * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / width;
    dst[static_cast<int64_t>(row_index[r]) * width + (i - r * width)] = src[i];
  }
}

}  // namespace

cudaError_t ArgmaxRows(const float* logits, int64_t rows, int64_t cols, int32_t* ids,
                       cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (cols <= 0 || rows > 0x7FFFFFFF) return cudaErrorInvalidValue;
  ArgmaxRowsKernel<<<static_cast<unsigned int>(rows), kArgmaxThreads, 0, stream>>>(logits, cols,
                                                                                   ids);
  return LaunchStatus();
}

cudaError_t ScatterRows(const float* src, int64_t rows, int64_t width, const int32_t* row_index,
                        float* dst, cudaStream_t stream) {
  if (rows <= 0 || width <= 0) return cudaSuccess;
  ScatterRowsKernel<<<ElementwiseBlocks(rows * width), kElementwiseThreads, 0, stream>>>(
      src, rows, width, row_index, dst);
  return LaunchStatus();
}

}  // namespace afd::cuda
