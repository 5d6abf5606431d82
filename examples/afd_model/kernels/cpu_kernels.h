#pragma once

// CPU kernels of the Step-3 example model: the reference implementation and
// the CI path. Plain functions over raw row-major buffers so that the CUDA
// kernels (examples/afd_model/cuda/) can mirror every entry point 1:1.
//
// Conventions shared by every function:
//  - Matrices are row-major. A linear layer's weight is [out, in] (the
//    Hugging Face layout), so y = x W^T and every output is a dot product of
//    two contiguous rows.
//  - `rows`/`tokens` count tokens; sizes are int64_t.
//  - Outputs never alias inputs unless the comment says "in place".
//  - Results are deterministic: the summation order depends only on the
//    shapes, never on threads or timing.

#include <cstdint>

namespace afd::cpu {

// ---------------------------------------------------------------- basics

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * gamma. May run in place (y == x).
void RmsNorm(const float* x, const float* gamma, int64_t rows, int64_t dim, float eps, float* y);

// y[rows, out] = x[rows, in] * w^T with w [out, in].
void Linear(const float* x, int64_t rows, int64_t in, const float* w, int64_t out, float* y);

// out[t] = table[ids[t]], rows of `hidden` floats.
void EmbeddingLookup(const float* table, const int32_t* ids, int64_t tokens, int64_t hidden,
                     float* out);

// acc[i] += x[i].
void AddInPlace(const float* x, int64_t count, float* acc);

// ids[r] = argmax of logits[r, :]; ties go to the lower index.
void ArgmaxRows(const float* logits, int64_t rows, int64_t cols, int32_t* ids);

// ---------------------------------------------------------------- attention

// NeoX (half-split) RoPE over the full head dimension, in place.
// x is [tokens, heads, head_dim]; pairs (i, i + head_dim/2) rotate by
// positions[t] * theta^(-2i/head_dim). Angles are computed in double.
void RopeNeoxInPlace(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                     const int32_t* positions, float theta);

// NeoX RoPE over the first `rotary_dim` of every head's `head_dim` values
// (partial RoPE, Step-5's global layers and indexer), in place: pairs
// (i, i + rotary_dim/2), i < rotary_dim/2, rotate by
// positions[t] * theta^(-2i/rotary_dim); the other values are untouched.
// RopeNeoxInPlace is the case rotary_dim == head_dim.
void RopePartialNeoxInPlace(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                            int64_t rotary_dim, const int32_t* positions, float theta);

// Multi-query causal attention of one sequence: every query head shares the
// single K head and the single V head.
//   q      [queries, heads, head_dim] (already rotated)
//   k, v   [kv_len, head_dim]         (cache of the sequence, k rotated)
//   query_positions[i]: query i attends to cache rows 0..query_positions[i]
//   (a query that sees no row, negative position or kv_len 0, gets zeros).
//   out    [queries, heads, head_dim]
// Prefill is queries == kv_len with positions 0..T-1 (offset by the cache
// length before the chunk); decode is one query at kv_len - 1.
void MqaAttention(const float* q, int64_t queries, int64_t heads, int64_t head_dim, const float* k,
                  const float* v, int64_t kv_len, const int32_t* query_positions, float scale,
                  float* out);

// ---------------------------------------------------------------- FFN

// silu(gate) * up, elementwise: out[i] = gate[i] * sigmoid(gate[i]) * up[i].
// May run in place (out == gate or out == up).
void SiluMul(const float* gate, const float* up, int64_t count, float* out);

// Floats of scratch SwiGlu needs.
int64_t SwiGluScratchFloats(int64_t rows, int64_t inter);

// y[rows, hidden] (overwritten) = down(silu(x gate^T) * (x up^T)).
//   w_gate, w_up [inter, hidden]; w_down [hidden, inter].
void SwiGlu(const float* x, int64_t rows, int64_t hidden, const float* w_gate, const float* w_up,
            const float* w_down, int64_t inter, float* scratch, float* y);

// Router: softmax over `experts` logits (fp32, max-subtracted), then top-k
// by probability, ties to the lower expert id, in descending order; the
// weights are the softmax probabilities (no renormalisation).
//   logits [tokens, experts]; topk_ids/topk_weights [tokens, k].
void RouterSoftmaxTopK(const float* logits, int64_t tokens, int64_t experts, int k,
                       int32_t* topk_ids, float* topk_weights);

// Floats of scratch GroupedExpertSwiGlu needs.
int64_t GroupedExpertScratchFloats(int64_t tokens, int64_t hidden, int64_t inter);

// Routed experts of one FFN partition, ACCUMULATED into y:
//   y[t] += sum over j < k with slot = expert_to_slot[topk_ids[t, j]] >= 0 of
//           topk_weights[t, j] * SwiGLU_slot(x[t])
// Experts are visited in increasing slot order and, within an expert, the
// tokens in increasing order, so each token's terms are added in increasing
// slot order (= increasing expert id when slots follow expert ids).
//   x [tokens, hidden]; y [tokens, hidden]
//   w_gate, w_up [slots, inter, hidden]; w_down [slots, hidden, inter]
//   expert_to_slot [num_experts]: local slot of an owned expert, -1 if not.
//   topk_ids values must lie in [0, num_experts).
void GroupedExpertSwiGlu(const float* x, int64_t tokens, int64_t hidden, const int32_t* topk_ids,
                         const float* topk_weights, int k, const int32_t* expert_to_slot,
                         int64_t num_experts, int64_t slots, const float* w_gate, const float* w_up,
                         const float* w_down, int64_t inter, float* scratch, float* y);

// ---------------------------------------------------------------- codecs

// Per token, per `group` consecutive channels: scale = amax/448 (1 if the
// group is all zero), code = E4M3_RNE(x / scale) (IEEE division).
//   x [tokens, hidden]; codes [tokens, hidden]; scales [tokens, hidden/group].
// hidden must be a multiple of group.
void QuantizeFp8PerGroup(const float* x, int64_t tokens, int64_t hidden, int64_t group,
                         uint8_t* codes, float* scales);

// x[t, c] = decode(codes[t, c]) * scales[t, c / group].
void DequantizeFp8PerGroup(const uint8_t* codes, const float* scales, int64_t tokens,
                           int64_t hidden, int64_t group, float* x);

// Round-to-nearest-even fp32 -> bf16 bit patterns, and back.
void EncodeBf16Array(const float* x, int64_t count, uint16_t* out);
void DecodeBf16Array(const uint16_t* x, int64_t count, float* out);

// The attention side's reduction module: sum[i] = p_0[i] + p_1[i] + ... in
// fp32, partials decoded from bf16 and added in index order 0, 1, ..., n-1.
void SumBf16Partials(const uint16_t* const* partials, int num_partials, int64_t count, float* sum);

}  // namespace afd::cpu
