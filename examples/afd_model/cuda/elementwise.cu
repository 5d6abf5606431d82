// Memory-bound kernels of afd_model_cuda: norms, RoPE, activations, router,
// codecs and weight generation. Everything that must match the CPU bit for
// bit calls the same scalar helpers (kernels/codec.h, weights.h) and writes
// the CPU's expressions with explicit round-to-nearest intrinsics where nvcc
// would otherwise contract a*b - c*d into an FMA.

#include <cuda_fp8.h>

#include "examples/afd_model/cuda/cuda_kernels.h"
#include "examples/afd_model/cuda/internal.cuh"
#include "examples/afd_model/kernels/codec.h"

namespace afd::cuda {
namespace {

using internal::ElementwiseBlocks;
using internal::kElementwiseThreads;
using internal::LaunchStatus;

// ---------------------------------------------------------------- basics

constexpr int kRmsNormThreads = 512;

// One block per row: the sum of squares is a block reduction, then every
// thread scales its own strided elements (so y == x is safe: each element is
// read before the barrier and written only by the thread that read it).
__global__ void RmsNormKernel(const float* __restrict__ x, const float* __restrict__ gamma,
                              int64_t dim, float eps, float* y) {
  __shared__ float warp_sums[kRmsNormThreads / 32];
  const float* row = x + blockIdx.x * dim;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += row[i] * row[i];
  sum = internal::WarpSum(sum);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    float total = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.0f;
    total = internal::WarpSum(total);
    if (threadIdx.x == 0) warp_sums[0] = total;
  }
  __syncthreads();
  // Same expressions as the CPU: mean, 1/sqrt (IEEE), (x * inv_rms) * gamma.
  const float mean_square = warp_sums[0] / static_cast<float>(dim);
  const float inv_rms = 1.0f / sqrtf(mean_square + eps);
  float* out = y + blockIdx.x * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    out[i] = __fmul_rn(__fmul_rn(row[i], inv_rms), gamma[i]);
  }
}

__global__ void EmbeddingLookupKernel(const float* __restrict__ table,
                                      const int32_t* __restrict__ ids, int64_t hidden,
                                      float* __restrict__ out) {
  const float* src = table + static_cast<int64_t>(ids[blockIdx.x]) * hidden;
  float* dst = out + blockIdx.x * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}

__global__ void AddInPlaceKernel(const float* __restrict__ x, int64_t count,
                                 float* __restrict__ acc) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc[i] += x[i];
  }
}

// ---------------------------------------------------------------- weights

template <typename Out>
__global__ void GenerateWeightsKernel(WeightKind kind, uint64_t key, float step, int64_t first,
                                      int64_t count, Out* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float value = WeightValue(kind, key, static_cast<uint64_t>(first + i), step);
    if constexpr (sizeof(Out) == 2) {
      out[i] = EncodeBf16(value);  // exact: generated values are bf16-exact
    } else {
      out[i] = value;
    }
  }
}

// ---------------------------------------------------------------- RoPE

// One block per token: the half-dimension cos/sin table is computed once in
// double (as on the CPU) and shared by every head of the token.
__global__ void RopeNeoxKernel(float* x, int64_t heads, int64_t head_dim,
                               const int32_t* __restrict__ positions, float theta) {
  extern __shared__ float table[];  // cos[half], sin[half]
  const int64_t half = head_dim / 2;
  float* cosines = table;
  float* sines = table + half;
  const double position = static_cast<double>(positions[blockIdx.x]);
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const double inv_freq = pow(static_cast<double>(theta),
                                -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
    const double angle = position * inv_freq;
    cosines[i] = static_cast<float>(cos(angle));
    sines[i] = static_cast<float>(sin(angle));
  }
  __syncthreads();
  float* token = x + blockIdx.x * heads * head_dim;
  for (int64_t j = threadIdx.x; j < heads * half; j += blockDim.x) {
    const int64_t h = j / half;
    const int64_t i = j - h * half;
    float* lo = token + h * head_dim;
    const float a = lo[i];
    const float b = lo[i + half];
    // No FMA contraction, so the bits match the CPU's a*c - b*s.
    lo[i] = __fsub_rn(__fmul_rn(a, cosines[i]), __fmul_rn(b, sines[i]));
    lo[i + half] = __fadd_rn(__fmul_rn(b, cosines[i]), __fmul_rn(a, sines[i]));
  }
}

// ---------------------------------------------------------------- FFN

__global__ void SiluMulKernel(const float* gate, const float* up, int64_t count, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = __fmul_rn(g / (1.0f + expf(-g)), up[i]);
  }
}

// One thread per token, the CPU's loops verbatim: 48 experts x 3 picks is a
// few hundred operations, and keeping the sequential sum keeps the
// probabilities equal to the CPU's up to expf's last ulp.
__global__ void RouterSoftmaxTopKKernel(const float* __restrict__ logits, int64_t tokens,
                                        int64_t experts, int k, int32_t* __restrict__ topk_ids,
                                        float* __restrict__ topk_weights) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= tokens) return;
  const float* row = logits + t * experts;
  float max_logit = row[0];
  for (int64_t e = 1; e < experts; ++e) max_logit = row[e] > max_logit ? row[e] : max_logit;
  float denominator = 0.0f;
  for (int64_t e = 0; e < experts; ++e) denominator += expf(row[e] - max_logit);
  // A bitmask of picked experts (experts <= 1024).
  uint32_t taken[32] = {};
  for (int j = 0; j < k; ++j) {
    int64_t best = -1;
    float best_probability = 0.0f;
    for (int64_t e = 0; e < experts; ++e) {
      if (taken[e >> 5] & (1u << (e & 31))) continue;
      const float probability = expf(row[e] - max_logit) / denominator;
      if (best < 0 || probability > best_probability) {
        best = e;
        best_probability = probability;
      }
    }
    taken[best >> 5] |= 1u << (best & 31);
    topk_ids[t * k + j] = static_cast<int32_t>(best);
    topk_weights[t * k + j] = best_probability;
  }
}

// ---------------------------------------------------------------- codecs

// One warp per (token, group): the amax is a warp max (exact in any order),
// then each lane encodes its strided channels with the shared scalar codec.
// cuda_fp8.h's __nv_cvt_float_to_fp8(.., __NV_SATFINITE, __NV_E4M3) keeps
// NaN as a NaN code, which the wire must never carry, so the shared codec is
// used; the kernel is bandwidth-bound and its integer work hides under the
// loads. CompareCudaFp8Conversion reports how the two compare otherwise.
__global__ void QuantizeFp8Kernel(const float* __restrict__ x, int64_t num_groups, int64_t group,
                                  uint8_t* __restrict__ codes, float* __restrict__ scales) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  if (warp >= num_groups) return;
  // Groups are consecutive in memory: group g of token t is flat group
  // t * groups_per_token + g, so the flat index addresses both buffers.
  const float* in = x + warp * group;
  float amax = 0.0f;
  for (int64_t c = lane; c < group; c += 32) amax = fmaxf(amax, fabsf(in[c]));
  amax = internal::WarpMax(amax);
  const float scale = Fp8GroupScale(amax);
  if (lane == 0) scales[warp] = scale;
  uint8_t* out = codes + warp * group;
  for (int64_t c = lane; c < group; c += 32) {
    out[c] = EncodeFp8E4m3(__fdiv_rn(in[c], scale));
  }
}

__global__ void DequantizeFp8Kernel(const uint8_t* __restrict__ codes,
                                    const float* __restrict__ scales, int64_t count, int64_t group,
                                    float* __restrict__ x) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = __fmul_rn(DecodeFp8E4m3(codes[i]), scales[i / group]);
  }
}

__global__ void EncodeBf16Kernel(const float* __restrict__ x, int64_t count,
                                 uint16_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = EncodeBf16(x[i]);
  }
}

__global__ void DecodeBf16Kernel(const uint16_t* __restrict__ x, int64_t count,
                                 float* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = DecodeBf16(x[i]);
  }
}

// Partials added in index order 0..n-1, as the CPU reduction module.
__global__ void SumBf16PartialsKernel(const uint16_t* const* partials, int num_partials,
                                      int64_t count, float* __restrict__ sum) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float total = num_partials > 0 ? DecodeBf16(partials[0][i]) : 0.0f;
    for (int p = 1; p < num_partials; ++p) total += DecodeBf16(partials[p][i]);
    sum[i] = total;
  }
}

__global__ void CompareCudaFp8Kernel(uint64_t first, uint64_t count, unsigned long long* mismatches,
                                     unsigned int* first_mismatch) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const unsigned int bits = static_cast<unsigned int>(first + i);
    const float value = __uint_as_float(bits);
    const uint8_t ours = EncodeFp8E4m3(value);
    const uint8_t theirs =
        isnan(value)
            ? uint8_t{0}
            : static_cast<uint8_t>(__nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3));
    if (ours != theirs) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_mismatch, bits);
    }
  }
}

}  // namespace

cudaError_t RmsNorm(const float* x, const float* gamma, int64_t rows, int64_t dim, float eps,
                    float* y, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  RmsNormKernel<<<static_cast<unsigned int>(rows), kRmsNormThreads, 0, stream>>>(x, gamma, dim, eps,
                                                                                 y);
  return LaunchStatus();
}

cudaError_t EmbeddingLookup(const float* table, const int32_t* ids, int64_t tokens, int64_t hidden,
                            float* out, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  EmbeddingLookupKernel<<<static_cast<unsigned int>(tokens), kElementwiseThreads, 0, stream>>>(
      table, ids, hidden, out);
  return LaunchStatus();
}

cudaError_t AddInPlace(const float* x, int64_t count, float* acc, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  AddInPlaceKernel<<<ElementwiseBlocks(count), kElementwiseThreads, 0, stream>>>(x, count, acc);
  return LaunchStatus();
}

namespace {

template <typename T>
cudaError_t LaunchGenerateWeights(WeightKind kind, uint64_t key, int64_t fan_in, int64_t first,
                                  int64_t count, T* out, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const float step = PowerOfTwoInverse(WeightExponent(kind, fan_in));
  GenerateWeightsKernel<T><<<ElementwiseBlocks(count), kElementwiseThreads, 0, stream>>>(
      kind, key, step, first, count, out);
  return LaunchStatus();
}

}  // namespace

cudaError_t GenerateWeights(WeightKind kind, uint64_t key, int64_t fan_in, int64_t first,
                            int64_t count, float* out, cudaStream_t stream) {
  return LaunchGenerateWeights(kind, key, fan_in, first, count, out, stream);
}

cudaError_t GenerateWeightsBf16(WeightKind kind, uint64_t key, int64_t fan_in, int64_t first,
                                int64_t count, uint16_t* out, cudaStream_t stream) {
  return LaunchGenerateWeights(kind, key, fan_in, first, count, out, stream);
}

cudaError_t FillTensor(const TensorSpec& spec, uint64_t seed, int64_t first, int64_t count,
                       float* out, cudaStream_t stream) {
  return GenerateWeights(spec.kind, TensorKey(spec.name, seed), spec.fan_in, first, count, out,
                         stream);
}

cudaError_t FillTensorBf16(const TensorSpec& spec, uint64_t seed, int64_t first, int64_t count,
                           uint16_t* out, cudaStream_t stream) {
  return GenerateWeightsBf16(spec.kind, TensorKey(spec.name, seed), spec.fan_in, first, count, out,
                             stream);
}

cudaError_t RopeNeoxInPlace(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                            const int32_t* positions, float theta, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  if (head_dim % 2 != 0) return cudaErrorInvalidValue;
  const size_t table_bytes = sizeof(float) * static_cast<size_t>(head_dim);
  RopeNeoxKernel<<<static_cast<unsigned int>(tokens), kElementwiseThreads, table_bytes, stream>>>(
      x, heads, head_dim, positions, theta);
  return LaunchStatus();
}

cudaError_t SiluMul(const float* gate, const float* up, int64_t count, float* out,
                    cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  SiluMulKernel<<<ElementwiseBlocks(count), kElementwiseThreads, 0, stream>>>(gate, up, count, out);
  return LaunchStatus();
}

cudaError_t RouterSoftmaxTopK(const float* logits, int64_t tokens, int64_t experts, int k,
                              int32_t* topk_ids, float* topk_weights, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  if (experts <= 0 || experts > 1024 || k <= 0 || k > experts) {
    return cudaErrorInvalidValue;
  }
  constexpr int kThreads = 128;
  const auto blocks = static_cast<unsigned int>((tokens + kThreads - 1) / kThreads);
  RouterSoftmaxTopKKernel<<<blocks, kThreads, 0, stream>>>(logits, tokens, experts, k, topk_ids,
                                                           topk_weights);
  return LaunchStatus();
}

cudaError_t QuantizeFp8PerGroup(const float* x, int64_t tokens, int64_t hidden, int64_t group,
                                uint8_t* codes, float* scales, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  if (group <= 0 || hidden % group != 0) return cudaErrorInvalidValue;
  const int64_t num_groups = tokens * (hidden / group);
  constexpr int kThreads = 256;  // 8 groups per block
  const auto blocks = static_cast<unsigned int>((num_groups * 32 + kThreads - 1) / kThreads);
  QuantizeFp8Kernel<<<blocks, kThreads, 0, stream>>>(x, num_groups, group, codes, scales);
  return LaunchStatus();
}

cudaError_t DequantizeFp8PerGroup(const uint8_t* codes, const float* scales, int64_t tokens,
                                  int64_t hidden, int64_t group, float* x, cudaStream_t stream) {
  if (tokens <= 0) return cudaSuccess;
  if (group <= 0 || hidden % group != 0) return cudaErrorInvalidValue;
  const int64_t count = tokens * hidden;
  DequantizeFp8Kernel<<<ElementwiseBlocks(count), kElementwiseThreads, 0, stream>>>(
      codes, scales, count, group, x);
  return LaunchStatus();
}

cudaError_t EncodeBf16Array(const float* x, int64_t count, uint16_t* out, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  EncodeBf16Kernel<<<ElementwiseBlocks(count), kElementwiseThreads, 0, stream>>>(x, count, out);
  return LaunchStatus();
}

cudaError_t DecodeBf16Array(const uint16_t* x, int64_t count, float* out, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  DecodeBf16Kernel<<<ElementwiseBlocks(count), kElementwiseThreads, 0, stream>>>(x, count, out);
  return LaunchStatus();
}

cudaError_t SumBf16Partials(const uint16_t* const* partials, int num_partials, int64_t count,
                            float* sum, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  SumBf16PartialsKernel<<<ElementwiseBlocks(count), kElementwiseThreads, 0, stream>>>(
      partials, num_partials, count, sum);
  return LaunchStatus();
}

cudaError_t CompareCudaFp8Conversion(uint64_t first, uint64_t count, unsigned long long* mismatches,
                                     unsigned int* first_mismatch, cudaStream_t stream) {
  cudaError_t status = cudaMemsetAsync(mismatches, 0, sizeof(*mismatches), stream);
  if (status != cudaSuccess) return status;
  status = cudaMemsetAsync(first_mismatch, 0xFF, sizeof(*first_mismatch), stream);
  if (status != cudaSuccess) return status;
  if (count == 0) return cudaSuccess;
  CompareCudaFp8Kernel<<<132 * 16, kElementwiseThreads, 0, stream>>>(first, count, mismatches,
                                                                     first_mismatch);
  return LaunchStatus();
}

}  // namespace afd::cuda
