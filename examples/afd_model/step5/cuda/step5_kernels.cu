#include <algorithm>
#include <cstdint>

#include "examples/afd_model/cuda/internal.cuh"
#include "examples/afd_model/kernels/codec.h"
#include "examples/afd_model/step5/cuda/step5_cuda.h"

namespace afd::step5::cuda {
namespace {

constexpr int kScoreThreads = 128;     // blocks of one token per CTA
constexpr int kMaxIndexFloats = 8192;  // groups * heads_per_group * dim
constexpr int kSelectThreads = 256;
constexpr int kAttentionWarps = 8;
constexpr int kTile = 32;             // positions per K/V tile (one per lane)
constexpr int kMaxHeadsPerWarp = 4;   // heads_per_group <= 32
constexpr int kMaxCoordsPerLane = 8;  // head_dim <= 256

using afd::cuda::internal::LaunchStatus;
using afd::cuda::internal::WarpMax;
using afd::cuda::internal::WarpSum;

__device__ __forceinline__ int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }

// afd::cpu::Dot's exact order: eight interleaved partial sums, a pairwise
// final sum, then the tail; every product and sum rounded on its own (no
// FMA), as the x86-64 build computes it. `b` is E4M3 codes decoded through
// the table.
__device__ float DotCpuOrder(const float* a, const uint8_t* b_codes, const float* table,
                             int64_t n) {
  float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
#pragma unroll
    for (int lane = 0; lane < 8; ++lane) {
      lanes[lane] = __fadd_rn(lanes[lane], __fmul_rn(a[i + lane], table[b_codes[i + lane]]));
    }
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail = __fadd_rn(tail, __fmul_rn(a[i], table[b_codes[i]]));
  const float left = __fadd_rn(__fadd_rn(lanes[0], lanes[4]), __fadd_rn(lanes[1], lanes[5]));
  const float right = __fadd_rn(__fadd_rn(lanes[2], lanes[6]), __fadd_rn(lanes[3], lanes[7]));
  return __fadd_rn(__fadd_rn(left, right), tail);
}

// One CTA per (token, 128 history blocks): the token's queries are decoded
// into shared memory once (every thread reads the same element at a time: a
// broadcast), each thread scores one block for every group.
__global__ void IndexerScoresKernel(const uint8_t* __restrict__ query_codes,
                                    const float* __restrict__ head_weights,
                                    const int32_t* __restrict__ query_sequence,
                                    const int32_t* __restrict__ query_position, int64_t groups,
                                    int64_t heads_per_group, int64_t dim, int64_t block_size,
                                    const uint8_t* __restrict__ summaries, int64_t max_blocks,
                                    float* __restrict__ scores) {
  extern __shared__ float shared[];
  float* table = shared;          // [256]
  float* queries = shared + 256;  // [heads, dim]
  const int64_t t = blockIdx.x;
  const int64_t heads = groups * heads_per_group;
  for (int i = threadIdx.x; i < 256; i += blockDim.x) {
    table[i] = DecodeFp8E4m3(static_cast<uint8_t>(i));
  }
  __syncthreads();
  const uint8_t* q = query_codes + t * heads * dim;
  for (int64_t i = threadIdx.x; i < heads * dim; i += blockDim.x) queries[i] = table[q[i]];
  __syncthreads();
  const int64_t history = Min64(query_position[t] / block_size, max_blocks);
  const int64_t r = int64_t{blockIdx.y} * blockDim.x + threadIdx.x;
  if (r >= history) return;
  const uint8_t* row = summaries + (int64_t{query_sequence[t]} * max_blocks + r) * dim;
  const float* w = head_weights + t * heads;
  for (int64_t g = 0; g < groups; ++g) {
    float score = 0.0f;
    for (int64_t h = 0; h < heads_per_group; ++h) {
      const int64_t head = g * heads_per_group + h;
      const float dot = DotCpuOrder(queries + head * dim, row, table, dim);
      score = __fadd_rn(score, __fmul_rn(w[head], dot < 0.0f ? 0.0f : dot));
    }
    scores[(t * groups + g) * max_blocks + r] = score;
  }
}

// A 64-bit key whose unsigned order is (score descending, id ascending)
// turned around: larger key = better block. Keys are unique per row, so the
// k-th largest key splits the row into exactly k winners.
__device__ __forceinline__ uint64_t SelectionKey(float score, uint32_t id) {
  uint32_t bits = __float_as_uint(score == 0.0f ? 0.0f : score);  // -0 == +0
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(bits) << 32) | (0xFFFFFFFFu - id);
}

// One CTA per (token, group): radix select of the k-th largest key, 8 bits
// per pass from the top, then an ordered compaction of the winners (a block
// scan over ids in ascending order), so the output is sorted by block id.
__global__ void SelectTopKKernel(const float* __restrict__ scores,
                                 const int32_t* __restrict__ query_position, int64_t groups,
                                 int64_t max_blocks, int64_t block_size, int64_t k,
                                 int32_t* __restrict__ selected,
                                 int32_t* __restrict__ selected_count) {
  __shared__ uint32_t histogram[256];
  __shared__ uint64_t prefix_shared;
  __shared__ int64_t remaining_shared;
  __shared__ int32_t scan[kSelectThreads];
  const int64_t row_index = blockIdx.x;  // t * groups + g
  const int64_t t = row_index / groups;
  const int64_t count = Min64(query_position[t] / block_size, max_blocks);
  const int64_t take = Min64(k, count);
  const float* row = scores + row_index * max_blocks;
  int32_t* out = selected + row_index * k;
  for (int64_t i = take + threadIdx.x; i < k; i += blockDim.x) out[i] = -1;
  if (threadIdx.x == 0) selected_count[row_index] = static_cast<int32_t>(take);
  if (take == 0) return;

  uint64_t threshold = 0;  // the take-th largest key; every key >= it wins
  if (take < count) {
    if (threadIdx.x == 0) {
      prefix_shared = 0;
      remaining_shared = take;
    }
    uint64_t mask = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < 256; i += blockDim.x) histogram[i] = 0;
      __syncthreads();
      const uint64_t prefix = prefix_shared;
      for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
        const uint64_t key = SelectionKey(row[i], static_cast<uint32_t>(i));
        if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 0xFF], 1u);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        int64_t remaining = remaining_shared;
        int bin = 255;
        for (; bin > 0; --bin) {
          if (histogram[bin] >= remaining) break;
          remaining -= histogram[bin];
        }
        remaining_shared = remaining;
        prefix_shared = prefix | (static_cast<uint64_t>(bin) << shift);
      }
      mask |= uint64_t{0xFF} << shift;
      __syncthreads();
    }
    threshold = prefix_shared;
  }

  // Ordered compaction: chunk by chunk, each thread's flag, an inclusive
  // scan in shared memory, winners written at base + rank.
  int64_t base = 0;
  for (int64_t chunk = 0; chunk < count; chunk += blockDim.x) {
    const int64_t i = chunk + threadIdx.x;
    const bool win = i < count && SelectionKey(row[i], static_cast<uint32_t>(i)) >= threshold;
    scan[threadIdx.x] = win ? 1 : 0;
    __syncthreads();
    for (int offset = 1; offset < blockDim.x; offset <<= 1) {
      const int32_t add = threadIdx.x >= offset ? scan[threadIdx.x - offset] : 0;
      __syncthreads();
      scan[threadIdx.x] += add;
      __syncthreads();
    }
    if (win) out[base + scan[threadIdx.x] - 1] = static_cast<int32_t>(i);
    const int32_t total = scan[blockDim.x - 1];
    __syncthreads();
    base += total;
  }
}

// One CTA per (token, group). K/V tiles of 32 positions are staged in shared
// memory once and shared by all heads of the group (the point of GQA); warp w
// owns heads w, w + 8, ... with an online softmax each: lane j scores
// position j of the tile, then every lane accumulates its own output
// coordinates (c = lane + 32 m) over the tile's positions.
__global__ void SparseDecodeAttentionKernel(
    const float* __restrict__ q, int64_t heads, int64_t groups, int64_t head_dim,
    const float* __restrict__ k_cache, const float* __restrict__ v_cache, int64_t max_len,
    const int32_t* __restrict__ query_sequence, const int32_t* __restrict__ query_position,
    int64_t block_size, const int32_t* __restrict__ selected,
    const int32_t* __restrict__ selected_count, int64_t k, float scale, float* __restrict__ out) {
  extern __shared__ float shared[];
  const int64_t hpg = heads / groups;
  const int64_t key_stride = head_dim + 1;    // padded: lanes read different rows
  float* queries = shared;                    // [hpg, d]
  float* keys = queries + hpg * head_dim;     // [kTile, d + 1]
  float* values = keys + kTile * key_stride;  // [kTile, d]
  __shared__ int64_t tile_rows[kTile];        // K/V row offsets of the tile

  const int64_t row_index = blockIdx.x;  // t * groups + g
  const int64_t t = row_index / groups;
  const int64_t g = row_index % groups;
  const int64_t pos = query_position[t];
  const int64_t count = selected_count[row_index];
  const int32_t* blocks = selected + row_index * k;
  const int64_t current_begin = pos / block_size * block_size;
  const int64_t total = count * block_size + (pos - current_begin + 1);
  const int64_t sequence_base = int64_t{query_sequence[t]} * max_len;
  const int64_t row_floats = groups * head_dim;

  for (int64_t i = threadIdx.x; i < hpg * head_dim; i += blockDim.x) {
    queries[i] = q[(t * heads + g * hpg) * head_dim + i];
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  float m[kMaxHeadsPerWarp], l[kMaxHeadsPerWarp], o[kMaxHeadsPerWarp][kMaxCoordsPerLane];
#pragma unroll
  for (int j = 0; j < kMaxHeadsPerWarp; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
#pragma unroll
    for (int c = 0; c < kMaxCoordsPerLane; ++c) o[j][c] = 0.0f;
  }

  for (int64_t tile = 0; tile < total; tile += kTile) {
    const int64_t valid = Min64(kTile, total - tile);
    __syncthreads();  // the previous tile is consumed (and queries are loaded)
    if (threadIdx.x < kTile) {
      const int64_t index = tile + threadIdx.x;
      int64_t position = 0;
      if (index < count * block_size) {
        position = int64_t{blocks[index / block_size]} * block_size + index % block_size;
      } else if (index < total) {
        position = current_begin + (index - count * block_size);
      }
      tile_rows[threadIdx.x] = ((sequence_base + position) * row_floats) + g * head_dim;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < valid * head_dim; i += blockDim.x) {
      const int64_t p = i / head_dim;
      const int64_t c = i % head_dim;
      keys[p * key_stride + c] = k_cache[tile_rows[p] + c];
      values[p * head_dim + c] = v_cache[tile_rows[p] + c];
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kMaxHeadsPerWarp; ++j) {
      const int64_t h = warp + int64_t{j} * kAttentionWarps;
      if (h >= hpg) continue;  // warp-uniform: the shuffles below see every lane
      const float* qh = queries + h * head_dim;
      float score = -INFINITY;
      if (lane < valid) {
        float dot = 0.0f;
        for (int64_t c = 0; c < head_dim; ++c) dot += qh[c] * keys[lane * key_stride + c];
        score = dot * scale;
      }
      const float new_max = fmaxf(m[j], WarpMax(score));
      const float p = lane < valid ? expf(score - new_max) : 0.0f;
      const float correction = m[j] == -INFINITY ? 0.0f : expf(m[j] - new_max);
      l[j] = l[j] * correction + WarpSum(p);
      m[j] = new_max;
#pragma unroll
      for (int c = 0; c < kMaxCoordsPerLane; ++c) o[j][c] *= correction;
      for (int64_t pp = 0; pp < valid; ++pp) {
        const float weight = __shfl_sync(0xFFFFFFFFu, p, static_cast<int>(pp));
#pragma unroll
        for (int c = 0; c < kMaxCoordsPerLane; ++c) {
          const int64_t coord = lane + 32 * c;
          if (coord < head_dim) o[j][c] += weight * values[pp * head_dim + coord];
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kMaxHeadsPerWarp; ++j) {
    const int64_t h = warp + int64_t{j} * kAttentionWarps;
    if (h >= hpg) continue;
    float* dst = out + (t * heads + g * hpg + h) * head_dim;
    const float inv = 1.0f / l[j];
#pragma unroll
    for (int c = 0; c < kMaxCoordsPerLane; ++c) {
      const int64_t coord = lane + 32 * c;
      if (coord < head_dim) dst[coord] = o[j][c] * inv;
    }
  }
}

}  // namespace

cudaError_t IndexerScores(const uint8_t* query_codes, const float* head_weights,
                          const int32_t* query_sequence, const int32_t* query_position, int64_t n,
                          int64_t groups, int64_t heads_per_group, int64_t dim, int64_t block_size,
                          const uint8_t* summaries, int64_t max_blocks, float* scores,
                          cudaStream_t stream) {
  const int64_t floats = groups * heads_per_group * dim;
  if (n <= 0 || max_blocks <= 0) return cudaSuccess;
  if (floats > kMaxIndexFloats || block_size <= 0) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned int>(n),
                  static_cast<unsigned int>((max_blocks + kScoreThreads - 1) / kScoreThreads));
  const size_t smem = sizeof(float) * (256 + floats);
  cudaError_t status = cudaFuncSetAttribute(
      IndexerScoresKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (status != cudaSuccess) return status;
  IndexerScoresKernel<<<grid, kScoreThreads, smem, stream>>>(
      query_codes, head_weights, query_sequence, query_position, groups, heads_per_group, dim,
      block_size, summaries, max_blocks, scores);
  return LaunchStatus();
}

cudaError_t SelectTopKBlocks(const float* scores, const int32_t* query_position, int64_t n,
                             int64_t groups, int64_t max_blocks, int64_t block_size, int64_t k,
                             int32_t* selected, int32_t* selected_count, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (k <= 0 || block_size <= 0 || max_blocks > (int64_t{1} << 31)) {
    return cudaErrorInvalidValue;
  }
  SelectTopKKernel<<<static_cast<unsigned int>(n * groups), kSelectThreads, 0, stream>>>(
      scores, query_position, groups, max_blocks, block_size, k, selected, selected_count);
  return LaunchStatus();
}

cudaError_t SparseDecodeAttention(const float* q, int64_t n, int64_t heads, int64_t groups,
                                  int64_t head_dim, const float* k_cache, const float* v_cache,
                                  int64_t max_len, const int32_t* query_sequence,
                                  const int32_t* query_position, int64_t block_size,
                                  const int32_t* selected, const int32_t* selected_count, int64_t k,
                                  float scale, float* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int64_t hpg = heads / groups;
  if (groups <= 0 || heads % groups != 0 || hpg > kAttentionWarps * kMaxHeadsPerWarp ||
      head_dim <= 0 || head_dim > 32 * kMaxCoordsPerLane || block_size <= 0) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = sizeof(float) * (hpg * head_dim + kTile * (head_dim + 1) + kTile * head_dim);
  cudaError_t status =
      cudaFuncSetAttribute(SparseDecodeAttentionKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
  if (status != cudaSuccess) return status;
  SparseDecodeAttentionKernel<<<static_cast<unsigned int>(n * groups), kAttentionWarps * 32, smem,
                                stream>>>(q, heads, groups, head_dim, k_cache, v_cache, max_len,
                                          query_sequence, query_position, block_size, selected,
                                          selected_count, k, scale, out);
  return LaunchStatus();
}

}  // namespace afd::step5::cuda
