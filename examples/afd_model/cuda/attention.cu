// MFA attention: a plain fp32 kernel for any causal pattern (prefill), and
// the batched decode kernel that exploits the single shared KV head.
//
// Decode design (flash-decoding over one KV head): with one K and one V head
// shared by all 64 query heads, each cached K/V row is worth 64 dot products
// and 64 axpys. Reading it once per block and running all heads on it turns
// decode attention from 64 GEMVs into two small GEMMs per tile
// (S = Q K^T: [64 x 32] per 32 tokens; O += P V: [64 x head_dim]), whose
// arithmetic intensity (~32 FLOP per fp32 byte) is above what CUDA cores can
// sustain at HBM speed, so they run on TF32 tensor cores (WMMA). A block owns
// one sequence and a split of kMqaDecodeSplitTokens tokens: it keeps the
// split's whole score row per head in shared memory, so the softmax of the
// split is exact (no online rescaling of the tensor-core accumulators, whose
// element layout WMMA does not expose), writes the unnormalised partial
// output with its max and sum, and a second kernel merges the splits.

#include <mma.h>

#include "examples/afd_model/cuda/cuda_kernels.h"
#include "examples/afd_model/cuda/internal.cuh"

namespace afd::cuda {
namespace {

using internal::CpAsync16;
using internal::CpAsyncCommit;
using internal::CpAsyncWait;

using internal::LaunchStatus;
namespace wmma = nvcuda::wmma;

// ---------------------------------------------------------------- generic

constexpr int kGenericWarps = 4;

// One warp per (query, head), online softmax over the visible rows; lane l
// holds dims l, l + 32, ... so every K/V row read is coalesced.
template <int kPerLane>
__global__ void MqaAttentionKernel(const float* __restrict__ q, int64_t queries, int64_t heads,
                                   const float* __restrict__ k, const float* __restrict__ v,
                                   int64_t kv_len, const int32_t* __restrict__ positions,
                                   float scale, float* __restrict__ out) {
  constexpr int kHeadDim = kPerLane * 32;
  const int lane = threadIdx.x % 32;
  const int64_t warp = blockIdx.x * static_cast<int64_t>(kGenericWarps) + threadIdx.x / 32;
  if (warp >= queries * heads) return;
  const int64_t query = warp / heads;
  const int64_t last = static_cast<int64_t>(positions[query]);
  const int64_t visible = last + 1 < kv_len ? last + 1 : kv_len;
  float* out_row = out + warp * kHeadDim;
  if (visible <= 0) {
    // Nothing visible (a negative position, an empty cache): zeros, as on
    // the CPU, instead of 0 / 0.
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) out_row[lane + 32 * j] = 0.0f;
    return;
  }
  const float* query_row = q + warp * kHeadDim;
  float q_reg[kPerLane];
  float acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    q_reg[j] = query_row[lane + 32 * j];
    acc[j] = 0.0f;
  }
  float running_max = -INFINITY;
  float denominator = 0.0f;
  for (int64_t s = 0; s < visible; ++s) {
    const float* key = k + s * kHeadDim;
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) dot += q_reg[j] * key[lane + 32 * j];
    const float score = internal::WarpSum(dot) * scale;
    const float new_max = fmaxf(running_max, score);
    const float correction = expf(running_max - new_max);  // 0 on the first row
    const float weight = expf(score - new_max);
    denominator = denominator * correction + weight;
    const float* value = v + s * kHeadDim;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      acc[j] = acc[j] * correction + weight * value[lane + 32 * j];
    }
    running_max = new_max;
  }
  const float inv_denominator = 1.0f / denominator;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) out_row[lane + 32 * j] = acc[j] * inv_denominator;
}

// ---------------------------------------------------------------- decode

constexpr int kRows = 64;  // query heads, padded with zero rows
constexpr int kTile = 32;  // tokens per K/V tile in shared memory
constexpr int kChunk = static_cast<int>(kMqaDecodeSplitTokens);
constexpr int kDecodeThreads = 256;   // 8 warps: 4 row tiles x 2 column halves
constexpr int kScoreLd = kChunk + 4;  // +4 floats: spreads rows over banks
static_assert(kChunk % kTile == 0, "a split is a whole number of tiles");

__device__ __forceinline__ int64_t ClampKvLen(int32_t kv_len, int64_t max_kv_len) {
  const int64_t len = kv_len < 0 ? 0 : kv_len;
  return len < max_kv_len ? len : max_kv_len;
}

template <int kHeadDim>
constexpr size_t DecodeSmemBytes() {
  // Q [64][D+4], scores/probabilities [64][chunk+4], two K/V tiles [32][D+4].
  return sizeof(float) * (kRows * (kHeadDim + 4) + kRows * kScoreLd + 2 * kTile * (kHeadDim + 4));
}

template <int kHeadDim>
__device__ __forceinline__ void LoadKvTile(const float* __restrict__ cache, int64_t first_token,
                                           int64_t end_token, float* tile) {
  constexpr int kLd = kHeadDim + 4;
  constexpr int kChunksPerRow = kHeadDim / 4;
  for (int c = threadIdx.x; c < kTile * kChunksPerRow; c += kDecodeThreads) {
    const int row = c / kChunksPerRow;
    const int column = (c % kChunksPerRow) * 4;
    const int64_t token = first_token + row;
    const bool valid = token < end_token;
    const float* source = cache + (valid ? token * kHeadDim + column : 0);
    CpAsync16(tile + row * kLd + column, source, valid);
  }
}

// Grid (splits, batch). Workspace: partial O [batch][splits][64][D], then
// max and sum [batch][splits][64] each.
template <int kHeadDim>
__global__ void __launch_bounds__(kDecodeThreads, 1)
    MqaDecodeSplitKernel(const float* __restrict__ q, int heads, const float* __restrict__ k_cache,
                         const float* __restrict__ v_cache, int64_t cache_stride_rows,
                         const int32_t* __restrict__ kv_lens, int64_t max_kv_len, float scale,
                         float* __restrict__ partial_out, float* __restrict__ partial_max,
                         float* __restrict__ partial_sum) {
  constexpr int kLd = kHeadDim + 4;
  constexpr int kDimFragments = kHeadDim / 32;  // per warp in the P V phase
  extern __shared__ __align__(128) float smem[];
  float* q_s = smem;
  float* scores = q_s + kRows * kLd;
  float* kv_s = scores + kRows * kScoreLd;

  const int split = blockIdx.x;
  const int batch_index = blockIdx.y;
  const int splits = gridDim.x;
  // The workspace holds splits for max_kv_len rows: a longer (or negative)
  // length is clamped the same way here and in the merge kernel.
  const int64_t kv_len = ClampKvLen(kv_lens[batch_index], max_kv_len);
  const int64_t first = static_cast<int64_t>(split) * kChunk;
  if (first >= kv_len) return;  // the merge kernel skips empty splits
  const int count = static_cast<int>(kv_len - first < kChunk ? kv_len - first : kChunk);
  const int tiles = (count + kTile - 1) / kTile;
  const int64_t end = first + count;
  const float* k_seq = k_cache + batch_index * cache_stride_rows * kHeadDim;
  const float* v_seq = v_cache + batch_index * cache_stride_rows * kHeadDim;

  // K tile 0 is in flight while Q is staged (already rounded to TF32, as it
  // is reused by every tile). One 16-byte store per thread: consecutive
  // threads write consecutive float4s, so each quarter-warp store phase
  // covers all 32 banks once (four scalar stores 16 bytes apart would hit
  // only 8 banks, a 4-way conflict each). kLd is a multiple of 4 floats, so
  // every destination is 16-byte aligned.
  LoadKvTile<kHeadDim>(k_seq, first, end, kv_s);
  CpAsyncCommit();
  const float* q_seq = q + static_cast<int64_t>(batch_index) * heads * kHeadDim;
  for (int c = threadIdx.x; c < kRows * kHeadDim / 4; c += kDecodeThreads) {
    const int row = c / (kHeadDim / 4);
    const int column = (c % (kHeadDim / 4)) * 4;
    float4 value = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (row < heads) {
      value = *reinterpret_cast<const float4*>(q_seq + row * kHeadDim + column);
    }
    *reinterpret_cast<float4*>(q_s + row * kLd + column) =
        make_float4(wmma::__float_to_tf32(value.x), wmma::__float_to_tf32(value.y),
                    wmma::__float_to_tf32(value.z), wmma::__float_to_tf32(value.w));
  }

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row_tile = warp / 2;  // 16 heads
  const int half = warp % 2;      // which 16 tokens (S) / which D/2 dims (PV)

  wmma::fragment<wmma::accumulator, 16, 16, 8, float> out_acc[kDimFragments];
#pragma unroll
  for (int f = 0; f < kDimFragments; ++f) wmma::fill_fragment(out_acc[f], 0.0f);

  // Steps 0..tiles-1 stream K tiles, tiles..2*tiles-1 stream V tiles; the
  // next tile is always in flight while the current one is used.
  const int steps = 2 * tiles;
  for (int step = 0; step < steps; ++step) {
    float* current = kv_s + (step % 2) * kTile * kLd;
    if (step + 1 < steps) {
      const int next = step + 1;
      float* next_buffer = kv_s + (next % 2) * kTile * kLd;
      if (next < tiles) {
        LoadKvTile<kHeadDim>(k_seq, first + next * kTile, end, next_buffer);
      } else {
        LoadKvTile<kHeadDim>(v_seq, first + (next - tiles) * kTile, end, next_buffer);
      }
      CpAsyncCommit();
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();

    if (step < tiles) {
      // S[16 heads x 16 tokens] = Q K^T: K rows are the columns of B.
      wmma::fragment<wmma::accumulator, 16, 16, 8, float> s_acc;
      wmma::fill_fragment(s_acc, 0.0f);
#pragma unroll 4
      for (int kk = 0; kk < kHeadDim / 8; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> b;
        wmma::load_matrix_sync(a, q_s + row_tile * 16 * kLd + kk * 8, kLd);
        wmma::load_matrix_sync(b, current + half * 16 * kLd + kk * 8, kLd);
#pragma unroll
        for (int e = 0; e < b.num_elements; ++e) b.x[e] = wmma::__float_to_tf32(b.x[e]);
        wmma::mma_sync(s_acc, a, b, s_acc);
      }
      wmma::store_matrix_sync(scores + row_tile * 16 * kScoreLd + step * kTile + half * 16, s_acc,
                              kScoreLd, wmma::mem_row_major);
    } else {
      const int tile = step - tiles;
      if (tile == 0) {
        // Exact softmax of the split: warp w owns heads 8w..8w+7. Columns
        // past `count` (up to the tile boundary) get probability 0.
        for (int r = warp * 8; r < warp * 8 + 8; ++r) {
          float* row = scores + r * kScoreLd;
          float row_max = -INFINITY;
          for (int c = lane; c < count; c += 32) row_max = fmaxf(row_max, row[c] * scale);
          row_max = internal::WarpMax(row_max);
          float row_sum = 0.0f;
          for (int c = lane; c < tiles * kTile; c += 32) {
            const float p = c < count ? expf(row[c] * scale - row_max) : 0.0f;
            row_sum += p;
            row[c] = wmma::__float_to_tf32(p);
          }
          row_sum = internal::WarpSum(row_sum);
          if (lane == 0) {
            const int64_t slot = (static_cast<int64_t>(batch_index) * splits + split) * kRows + r;
            partial_max[slot] = row_max;
            partial_sum[slot] = row_sum;
          }
        }
        __syncthreads();
      }
      // O[16 heads x D/2] += P[16 x 32 tokens] V[32 tokens x D/2].
#pragma unroll
      for (int kk = 0; kk < kTile / 8; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a;
        wmma::load_matrix_sync(a, scores + row_tile * 16 * kScoreLd + tile * kTile + kk * 8,
                               kScoreLd);
#pragma unroll
        for (int f = 0; f < kDimFragments; ++f) {
          wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> b;
          wmma::load_matrix_sync(b, current + kk * 8 * kLd + (half * kDimFragments + f) * 16, kLd);
#pragma unroll
          for (int e = 0; e < b.num_elements; ++e) b.x[e] = wmma::__float_to_tf32(b.x[e]);
          wmma::mma_sync(out_acc[f], a, b, out_acc[f]);
        }
      }
    }
    // The buffer just used is the target of the next iteration's prefetch.
    __syncthreads();
  }

  float* out_block =
      partial_out +
      ((static_cast<int64_t>(batch_index) * splits + split) * kRows + row_tile * 16) * kHeadDim;
#pragma unroll
  for (int f = 0; f < kDimFragments; ++f) {
    wmma::store_matrix_sync(out_block + (half * kDimFragments + f) * 16, out_acc[f], kHeadDim,
                            wmma::mem_row_major);
  }
}

// Grid (heads, batch), one thread per dim: the standard flash-decoding merge
// out = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s over the live splits.
// A sequence with no live split (kv_len 0) gets zeros, not 0 / 0.
__global__ void MqaDecodeMergeKernel(const float* __restrict__ partial_out,
                                     const float* __restrict__ partial_max,
                                     const float* __restrict__ partial_sum,
                                     const int32_t* __restrict__ kv_lens, int64_t max_kv_len,
                                     int heads, int head_dim, int splits, float* __restrict__ out) {
  const int head = blockIdx.x;
  const int batch_index = blockIdx.y;
  // Only the splits the split kernel wrote: never past `splits` (the
  // workspace of the next sequence) whatever kv_lens holds.
  const int64_t kv_len = ClampKvLen(kv_lens[batch_index], max_kv_len);
  const int live_splits = static_cast<int>((kv_len + kChunk - 1) / kChunk);
  const int live = live_splits < splits ? live_splits : splits;
  const int64_t base = static_cast<int64_t>(batch_index) * splits * kRows + head;
  float* out_row = out + (static_cast<int64_t>(batch_index) * heads + head) * head_dim;
  if (live == 0) {
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) out_row[c] = 0.0f;
    return;
  }
  float global_max = -INFINITY;
  for (int s = 0; s < live; ++s) global_max = fmaxf(global_max, partial_max[base + s * kRows]);
  for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
    float numerator = 0.0f;
    float denominator = 0.0f;
    for (int s = 0; s < live; ++s) {
      const float factor = expf(partial_max[base + s * kRows] - global_max);
      denominator += factor * partial_sum[base + s * kRows];
      numerator += factor * partial_out[(base + s * kRows) * head_dim + c];
    }
    out_row[c] = numerator * (1.0f / denominator);
  }
}

struct DecodeLayout {
  int64_t max_kv_len = 0;
  int64_t splits = 0;
  size_t out_floats = 0;
  size_t stat_floats = 0;
};

DecodeLayout MakeDecodeLayout(int64_t batch, int64_t head_dim, int64_t max_kv_len) {
  DecodeLayout layout;
  layout.max_kv_len = max_kv_len;
  layout.splits = (max_kv_len + kChunk - 1) / kChunk;
  layout.out_floats = static_cast<size_t>(batch * layout.splits * kRows * head_dim);
  // Rounded to 64 floats so every section stays 256-byte aligned (WMMA
  // stores need 32-byte alignment).
  layout.stat_floats = (static_cast<size_t>(batch * layout.splits * kRows) + 63) / 64 * 64;
  return layout;
}

template <int kHeadDim>
cudaError_t LaunchDecode(const float* q, int64_t batch, int64_t heads, const float* k_cache,
                         const float* v_cache, int64_t cache_stride_rows, const int32_t* kv_lens,
                         const DecodeLayout& layout, float scale, float* out, float* workspace,
                         cudaStream_t stream) {
  constexpr size_t kSmem = DecodeSmemBytes<kHeadDim>();
  // Raising the dynamic shared-memory limit is per kernel and cheap; doing
  // it on every call keeps the API free of an init step.
  cudaError_t status =
      cudaFuncSetAttribute(MqaDecodeSplitKernel<kHeadDim>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem));
  if (status != cudaSuccess) return status;
  float* partial_out = workspace;
  float* partial_max = partial_out + layout.out_floats;
  float* partial_sum = partial_max + layout.stat_floats;
  const dim3 grid(static_cast<unsigned int>(layout.splits), static_cast<unsigned int>(batch));
  MqaDecodeSplitKernel<kHeadDim><<<grid, kDecodeThreads, kSmem, stream>>>(
      q, static_cast<int>(heads), k_cache, v_cache, cache_stride_rows, kv_lens, layout.max_kv_len,
      scale, partial_out, partial_max, partial_sum);
  status = LaunchStatus();
  if (status != cudaSuccess) return status;
  const dim3 merge_grid(static_cast<unsigned int>(heads), static_cast<unsigned int>(batch));
  MqaDecodeMergeKernel<<<merge_grid, kHeadDim, 0, stream>>>(
      partial_out, partial_max, partial_sum, kv_lens, layout.max_kv_len, static_cast<int>(heads),
      kHeadDim, static_cast<int>(layout.splits), out);
  return LaunchStatus();
}

}  // namespace

cudaError_t MqaAttention(const float* q, int64_t queries, int64_t heads, int64_t head_dim,
                         const float* k, const float* v, int64_t kv_len,
                         const int32_t* query_positions, float scale, float* out,
                         cudaStream_t stream) {
  if (queries <= 0 || heads <= 0) return cudaSuccess;
  const int64_t warps = queries * heads;
  const auto blocks = static_cast<unsigned int>((warps + kGenericWarps - 1) / kGenericWarps);
  constexpr int kThreads = kGenericWarps * 32;
  switch (head_dim) {
    case 64:
      MqaAttentionKernel<2><<<blocks, kThreads, 0, stream>>>(q, queries, heads, k, v, kv_len,
                                                             query_positions, scale, out);
      break;
    case 128:
      MqaAttentionKernel<4><<<blocks, kThreads, 0, stream>>>(q, queries, heads, k, v, kv_len,
                                                             query_positions, scale, out);
      break;
    case 256:
      MqaAttentionKernel<8><<<blocks, kThreads, 0, stream>>>(q, queries, heads, k, v, kv_len,
                                                             query_positions, scale, out);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return LaunchStatus();
}

size_t MqaDecodeWorkspaceBytes(int64_t batch, int64_t /*heads*/, int64_t head_dim,
                               int64_t max_kv_len) {
  const DecodeLayout layout = MakeDecodeLayout(batch, head_dim, max_kv_len);
  return sizeof(float) * (layout.out_floats + 2 * layout.stat_floats);
}

cudaError_t MqaDecodeAttention(const float* q, int64_t batch, int64_t heads, int64_t head_dim,
                               const float* k_cache, const float* v_cache,
                               int64_t cache_stride_rows, const int32_t* kv_lens,
                               int64_t max_kv_len, float scale, float* out, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  if (heads <= 0 || heads > kRows || max_kv_len <= 0 || batch > 65535 || workspace == nullptr ||
      reinterpret_cast<uintptr_t>(workspace) % 256 != 0 ||
      workspace_bytes < MqaDecodeWorkspaceBytes(batch, heads, head_dim, max_kv_len)) {
    return cudaErrorInvalidValue;
  }
  const DecodeLayout layout = MakeDecodeLayout(batch, head_dim, max_kv_len);
  float* scratch = static_cast<float*>(workspace);
  switch (head_dim) {
    case 64:
      return LaunchDecode<64>(q, batch, heads, k_cache, v_cache, cache_stride_rows, kv_lens, layout,
                              scale, out, scratch, stream);
    case 128:
      return LaunchDecode<128>(q, batch, heads, k_cache, v_cache, cache_stride_rows, kv_lens,
                               layout, scale, out, scratch, stream);
    case 256:
      return LaunchDecode<256>(q, batch, heads, k_cache, v_cache, cache_stride_rows, kv_lens,
                               layout, scale, out, scratch, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace afd::cuda
