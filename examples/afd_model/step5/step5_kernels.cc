#include "examples/afd_model/step5/step5_kernels.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <vector>

#include "examples/afd_model/kernels/codec.h"
#include "examples/afd_model/kernels/vector_ops.h"

namespace afd::step5::cpu {
namespace {

using afd::cpu::Axpy;
using afd::cpu::Dot;

// Every E4M3 code decoded once: scoring decodes a summary row per block and
// query, so the bit manipulation of DecodeFp8E4m3 would dominate otherwise.
const std::array<float, 256>& Fp8Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int code = 0; code < 256; ++code) t[code] = DecodeFp8E4m3(static_cast<uint8_t>(code));
    return t;
  }();
  return table;
}

void DecodeRow(const uint8_t* codes, int64_t count, float* out) {
  const std::array<float, 256>& table = Fp8Table();
  for (int64_t i = 0; i < count; ++i) out[i] = table[codes[i]];
}

// One head's softmax attention over the positions `for_each_row` visits (in
// ascending order; it calls its argument with each position's K/V row
// offset). The same three passes as afd::cpu::MqaAttention: scores and their
// max, exp and the sum, then the weighted V rows in position order, scaled by
// 1/sum at the end.
template <typename ForEachRow>
void AttendHead(const float* q, int64_t head_dim, const float* k, const float* v,
                ForEachRow for_each_row, float scale, float* scores, float* out) {
  float max_score = -INFINITY;
  int64_t n = 0;
  for_each_row([&](int64_t row) {
    scores[n] = Dot(q, k + row, head_dim) * scale;
    max_score = std::max(max_score, scores[n]);
    ++n;
  });
  float denominator = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    scores[i] = std::exp(scores[i] - max_score);
    denominator += scores[i];
  }
  std::fill(out, out + head_dim, 0.0f);
  n = 0;
  for_each_row([&](int64_t row) { Axpy(scores[n++], v + row, head_dim, out); });
  const float inv_denominator = 1.0f / denominator;
  for (int64_t c = 0; c < head_dim; ++c) out[c] *= inv_denominator;
}

}  // namespace

void LayerNorm(const float* x, const float* gamma, const float* beta, int64_t rows, int64_t dim,
               float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * dim;
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum += row[i];
    const float mean = sum / static_cast<float>(dim);
    float squares = 0.0f;
    for (int64_t i = 0; i < dim; ++i) squares += (row[i] - mean) * (row[i] - mean);
    const float inv_std = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
    float* out = y + r * dim;
    for (int64_t i = 0; i < dim; ++i) out[i] = (row[i] - mean) * inv_std * gamma[i] + beta[i];
  }
}

void HeadSigmoidGate(const float* gate, int64_t tokens, int64_t heads, int64_t head_dim, float* o) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const float g = 1.0f / (1.0f + std::exp(-gate[t * heads + h]));
      float* row = o + (t * heads + h) * head_dim;
      for (int64_t c = 0; c < head_dim; ++c) row[c] *= g;
    }
  }
}

void CastFp8E4m3(const float* x, int64_t count, uint8_t* codes) {
  for (int64_t i = 0; i < count; ++i) codes[i] = EncodeFp8E4m3(x[i]);
}

void BlockSummary(const float* proxy_keys, const float* logits, int64_t block_size, int64_t dim,
                  uint8_t* codes) {
  for (int64_t d = 0; d < dim; ++d) {
    float max_logit = -INFINITY;
    for (int64_t j = 0; j < block_size; ++j) max_logit = std::max(max_logit, logits[j * dim + d]);
    float denominator = 0.0f;
    float weighted = 0.0f;
    for (int64_t j = 0; j < block_size; ++j) {
      const float e = std::exp(logits[j * dim + d] - max_logit);
      denominator += e;
      weighted += e * proxy_keys[j * dim + d];
    }
    // sum_j (e_j / Z) k_j == (sum_j e_j k_j) / Z up to rounding; dividing
    // once keeps the per-coordinate work to one division.
    codes[d] = EncodeFp8E4m3(RoundToBf16(weighted / denominator));
  }
}

void IndexerScores(const uint8_t* query_codes, const float* head_weights, int64_t groups,
                   int64_t heads_per_group, int64_t dim, const uint8_t* summary_codes,
                   int64_t blocks, float* scratch, float* scores) {
  const int64_t heads = groups * heads_per_group;
  // Decoded once per call: [heads, dim] queries, then one summary row at a time.
  float* queries = scratch;
  float* summary = scratch + heads * dim;
  DecodeRow(query_codes, heads * dim, queries);
  for (int64_t r = 0; r < blocks; ++r) {
    DecodeRow(summary_codes + r * dim, dim, summary);
    for (int64_t g = 0; g < groups; ++g) {
      float score = 0.0f;
      for (int64_t h = 0; h < heads_per_group; ++h) {
        const int64_t head = g * heads_per_group + h;
        const float dot = Dot(queries + head * dim, summary, dim);
        score += head_weights[head] * std::max(dot, 0.0f);
      }
      scores[g * blocks + r] = score;
    }
  }
}

int64_t SelectTopKBlocks(const float* scores, int64_t count, int64_t k, int32_t* order_scratch,
                         int32_t* selected) {
  const int64_t take = std::min(k, count);
  if (take <= 0) return 0;
  std::iota(order_scratch, order_scratch + count, 0);
  // (score descending, id ascending) is a strict total order, so the chosen
  // set is unique: a tie at the cut keeps the lower ids.
  auto better = [scores](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  if (take < count) {
    std::nth_element(order_scratch, order_scratch + take - 1, order_scratch + count, better);
  }
  std::copy(order_scratch, order_scratch + take, selected);
  std::sort(selected, selected + take);
  return take;
}

void SparseBlockAttention(const float* q, int64_t heads, int64_t groups, int64_t head_dim,
                          const float* k_cache, const float* v_cache, int64_t pos,
                          int64_t block_size, const int32_t* selected,
                          const int64_t* selected_count, int64_t stride, float scale,
                          float* scores_scratch, float* out) {
  const int64_t heads_per_group = heads / groups;
  const int64_t row = groups * head_dim;
  const int64_t current_begin = pos / block_size * block_size;
  for (int64_t g = 0; g < groups; ++g) {
    const int32_t* ids = selected + g * stride;
    const int64_t count = selected_count[g];
    auto for_each_row = [&](auto&& visit) {
      for (int64_t i = 0; i < count; ++i) {
        const int64_t begin = int64_t{ids[i]} * block_size;
        for (int64_t p = begin; p < begin + block_size; ++p) visit(p * row + g * head_dim);
      }
      for (int64_t p = current_begin; p <= pos; ++p) visit(p * row + g * head_dim);
    };
    for (int64_t h = g * heads_per_group; h < (g + 1) * heads_per_group; ++h) {
      AttendHead(q + h * head_dim, head_dim, k_cache, v_cache, for_each_row, scale, scores_scratch,
                 out + h * head_dim);
    }
  }
}

void SlidingWindowAttention(const float* q, int64_t heads, int64_t groups, int64_t head_dim,
                            const float* ring_k, const float* ring_v, int64_t ring_slots,
                            int64_t pos, int64_t window, float scale, float* scores_scratch,
                            float* out) {
  const int64_t heads_per_group = heads / groups;
  const int64_t row = groups * head_dim;
  const int64_t first = std::max<int64_t>(0, pos - window + 1);
  for (int64_t g = 0; g < groups; ++g) {
    auto for_each_row = [&](auto&& visit) {
      for (int64_t p = first; p <= pos; ++p) visit((p % ring_slots) * row + g * head_dim);
    };
    for (int64_t h = g * heads_per_group; h < (g + 1) * heads_per_group; ++h) {
      AttendHead(q + h * head_dim, head_dim, ring_k, ring_v, for_each_row, scale, scores_scratch,
                 out + h * head_dim);
    }
  }
}

void RouterSigmoidTopK(const float* logits, const float* bias, int64_t tokens, int64_t experts,
                       int k, bool normalize, float scaling, int32_t* topk_ids,
                       float* topk_weights) {
  std::vector<float> affinity(experts);
  std::vector<float> choice(experts);
  std::vector<char> taken(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = logits + t * experts;
    for (int64_t e = 0; e < experts; ++e) {
      affinity[e] = 1.0f / (1.0f + std::exp(-row[e]));
      choice[e] = affinity[e] + bias[e];
    }
    std::fill(taken.begin(), taken.end(), 0);
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e) {
        if (taken[e]) continue;
        if (best < 0 || choice[e] > choice[best]) best = e;  // ">" keeps the lower id
      }
      taken[best] = 1;
      topk_ids[t * k + j] = static_cast<int32_t>(best);
      topk_weights[t * k + j] = affinity[best];
      sum += affinity[best];
    }
    const float factor = normalize ? scaling / sum : scaling;
    for (int j = 0; j < k; ++j) topk_weights[t * k + j] *= factor;
  }
}

}  // namespace afd::step5::cpu
