#pragma once

// CUDA kernels of the Step-5 variant's global sparse layers for a decode
// batch: indexer scores, top-k block selection and sparse attention over the
// selected blocks' original K/V (docs/model.md, "Step-5-Preview"). They
// mirror step5/step5_kernels.h, batched over the tokens of a step:
//  - every pointer is a device pointer; work is enqueued on `stream`, the
//    result is the launch status (cudaGetLastError after the launch);
//  - IndexerScores adds up in the CPU's exact order with un-contracted
//    products (no FMA), so its scores are bit-identical to the CPU's, and
//    SelectTopKBlocks is exact: the same scores select the same blocks;
//  - SparseDecodeAttention uses an online softmax over 32-position tiles (a
//    different summation order from the CPU's three passes and CUDA's expf):
//    equal to fp32 rounding.
//
// Token t of the batch belongs to sequence query_sequence[t] at position
// query_position[t]; its history is floor(position / block_size) blocks.
// Caches are per sequence: summaries [sequences, max_blocks, P] (E4M3 codes),
// K and V [sequences, max_len, groups, d] (fp32, post-norm, rotated K).

#include <cuda_runtime.h>

#include <cstdint>

namespace afd::step5::cuda {

// scores[t, g, r] for r < history(t) (other entries untouched):
//   sum_{h < heads_per_group} head_weights[t, g*hpg + h] *
//       ReLU(Q8(q)[t, g*hpg + h] . Q8(c)[sequence(t), r])
// query_codes [n, groups*hpg, dim] (E4M3); head_weights [n, groups*hpg];
// scores [n, groups, max_blocks]. groups * hpg * dim <= 8192.
cudaError_t IndexerScores(const uint8_t* query_codes, const float* head_weights,
                          const int32_t* query_sequence, const int32_t* query_position, int64_t n,
                          int64_t groups, int64_t heads_per_group, int64_t dim, int64_t block_size,
                          const uint8_t* summaries, int64_t max_blocks, float* scores,
                          cudaStream_t stream);

// Per (t, g): the min(k, history(t)) best of scores[t, g, 0..history) by
// (score descending, block id ascending), written ascending to
// selected[t, g, 0..count) and -1 after; selected_count[t, g] = count.
// Scores must not be NaN (-0 and +0 are equal, as on the CPU).
cudaError_t SelectTopKBlocks(const float* scores, const int32_t* query_position, int64_t n,
                             int64_t groups, int64_t max_blocks, int64_t block_size, int64_t k,
                             int32_t* selected, int32_t* selected_count, cudaStream_t stream);

// out[t, h] = softmax attention of q[t, h] (group g = h / (heads / groups))
// over the positions of the selected blocks of (t, g), ascending, then the
// current block's positions up to query_position[t].
// q, out [n, heads, d]; head_dim <= 256; heads / groups <= 32.
cudaError_t SparseDecodeAttention(const float* q, int64_t n, int64_t heads, int64_t groups,
                                  int64_t head_dim, const float* k_cache, const float* v_cache,
                                  int64_t max_len, const int32_t* query_sequence,
                                  const int32_t* query_position, int64_t block_size,
                                  const int32_t* selected, const int32_t* selected_count, int64_t k,
                                  float scale, float* out, cudaStream_t stream);

}  // namespace afd::step5::cuda
