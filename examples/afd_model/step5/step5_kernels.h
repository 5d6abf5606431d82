#pragma once

// CPU kernels of the Step-5-Preview attention (docs/model.md,
// "Step-5-Preview"): LayerNorm, the head-wise sigmoid gate, the block indexer (FP8 block summaries,
// weighted-ReLU scores, top-k with its tie rule), sparse attention over selected blocks,
// sliding-window GQA and the sigmoid router (partial RoPE is afd::cpu::RopePartialNeoxInPlace).
// Same conventions as kernels/cpu_kernels.h: raw row-major buffers, int64_t sizes, [out, in]
// weights, results that depend only on the shapes (never on batching), so streaming decode and
// prefill agree bit for bit. The CUDA twins are in step5/cuda/.
//
// GQA layout: q [heads, d] per token; K/V rows [groups, d] per position;
// query head h reads group g(h) = h / (heads / groups).

#include <cstdint>

namespace afd::step5::cpu {

// ---------------------------------------------------------------- basics

// y[r] = (x[r] - mean) / sqrt(var + eps) * gamma + beta, mean and the biased
// variance in fp32. May run in place.
void LayerNorm(const float* x, const float* gamma, const float* beta, int64_t rows, int64_t dim,
               float eps, float* y);

// o[t, h, :] *= sigmoid(gate[t, h]) (the head-wise output gate), in place.
//   gate [tokens, heads]; o [tokens, heads, head_dim].
void HeadSigmoidGate(const float* gate, int64_t tokens, int64_t heads, int64_t head_dim, float* o);

// codes[i] = E4M3_RNE(x[i]) with no scale (saturating at +-448): the
// indexer's Q8 cast.
void CastFp8E4m3(const float* x, int64_t count, uint8_t* codes);

// ---------------------------------------------------------------- indexer

// The summary of one complete block of `block_size` tokens, per coordinate d:
//   a[j, d] = softmax over j of logits[j, d]   (max-subtracted, fp32)
//   c[d]    = sum_j a[j, d] * proxy_keys[j, d]
//   codes[d] = E4M3(BF16(c[d]))                 (stored FP8, no scale)
// proxy_keys, logits [block_size, dim] (the block's tokens in order).
void BlockSummary(const float* proxy_keys, const float* logits, int64_t block_size, int64_t dim,
                  uint8_t* codes);

// Indexer scores of ONE query token against `blocks` summaries:
//   scores[g, r] = sum_{h < heads_per_group} head_weights[g, h] *
//                  ReLU(Q8(q)[g, h] . Q8(c)[r])
// summed over h in order, fp32. query_codes [groups, heads_per_group, dim]
// and summary_codes [blocks, dim] are E4M3 codes; head_weights
// [groups, heads_per_group] already carry the 1/sqrt(heads_per_group) scale.
// scratch: (groups * heads_per_group + 1) * dim floats. scores [groups, blocks].
void IndexerScores(const uint8_t* query_codes, const float* head_weights, int64_t groups,
                   int64_t heads_per_group, int64_t dim, const uint8_t* summary_codes,
                   int64_t blocks, float* scratch, float* scores);

// Top-k history blocks of one (token, group): the min(k, count) best of
// scores[0, count) ordered by (score descending, block id ascending), so a
// tie at the cut takes a prefix of the tied blocks in ascending id. Writes
// them to `selected` in ASCENDING block id order and returns how many.
// Scores must not be NaN. order_scratch holds `count` ints.
int64_t SelectTopKBlocks(const float* scores, int64_t count, int64_t k, int32_t* order_scratch,
                         int32_t* selected);

// ---------------------------------------------------------------- attention

// Sparse attention of ONE query token at position `pos` of a global layer.
// Head h (group g) attends, with one softmax, over the original K/V of group g
// at the positions of its selected history blocks (selected + g * stride,
// selected_count[g] ids in ascending order, each `block_size` positions) and
// then of the current block block_size*floor(pos/block_size) .. pos (the
// causal mask inside the current block). The selected blocks must lie before
// the current one. Positions are visited in ascending order.
//   q [heads, d] (rotated); k_cache, v_cache [>= pos + 1, groups, d];
//   scores_scratch: (stride + 1) * block_size floats; out [heads, d].
void SparseBlockAttention(const float* q, int64_t heads, int64_t groups, int64_t head_dim,
                          const float* k_cache, const float* v_cache, int64_t pos,
                          int64_t block_size, const int32_t* selected,
                          const int64_t* selected_count, int64_t stride, float scale,
                          float* scores_scratch, float* out);

// Sliding-window attention of ONE query token at position `pos`: positions
// max(0, pos - window + 1) .. pos (the window counts the current token), in
// ascending order. K/V of position p live in ring slot p % ring_slots
// (ring_slots >= window; a linear cache is a ring larger than the sequence).
//   q [heads, d]; ring_k, ring_v [ring_slots, groups, d];
//   scores_scratch: window floats; out [heads, d].
void SlidingWindowAttention(const float* q, int64_t heads, int64_t groups, int64_t head_dim,
                            const float* ring_k, const float* ring_v, int64_t ring_slots,
                            int64_t pos, int64_t window, float scale, float* scores_scratch,
                            float* out);

// ---------------------------------------------------------------- router

// Sigmoid router with a selection bias: s = sigmoid(logit) (fp32); the k
// experts with the largest s + bias are chosen (ties to the lower id, in
// descending order of s + bias); their weights are s (the bias only
// selects), divided by the sum of the chosen s when `normalize`, times
// `scaling`.  logits [tokens, experts]; bias [experts]; ids, weights [tokens, k].
void RouterSigmoidTopK(const float* logits, const float* bias, int64_t tokens, int64_t experts,
                       int k, bool normalize, float scaling, int32_t* topk_ids,
                       float* topk_weights);

}  // namespace afd::step5::cpu
