#include "examples/afd_model/kernels/cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "examples/afd_model/kernels/codec.h"
#include "examples/afd_model/kernels/vector_ops.h"

namespace afd::cpu {

void RmsNorm(const float* x, const float* gamma, int64_t rows, int64_t dim, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * dim;
    const float mean_square = Dot(row, row, dim) / static_cast<float>(dim);
    const float inv_rms = 1.0f / std::sqrt(mean_square + eps);
    float* out = y + r * dim;
    for (int64_t i = 0; i < dim; ++i) out[i] = row[i] * inv_rms * gamma[i];
  }
}

void Linear(const float* x, int64_t rows, int64_t in, const float* w, int64_t out, float* y) {
  // Blocking over tokens keeps a tile of x hot in L1/L2 while each weight
  // row is streamed once per block instead of once per token.
  constexpr int64_t kTokenBlock = 8;
  for (int64_t r0 = 0; r0 < rows; r0 += kTokenBlock) {
    const int64_t r1 = std::min(rows, r0 + kTokenBlock);
    for (int64_t o = 0; o < out; ++o) {
      const float* w_row = w + o * in;
      for (int64_t r = r0; r < r1; ++r) y[r * out + o] = Dot(x + r * in, w_row, in);
    }
  }
}

void EmbeddingLookup(const float* table, const int32_t* ids, int64_t tokens, int64_t hidden,
                     float* out) {
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(out + t * hidden, table + static_cast<int64_t>(ids[t]) * hidden,
                sizeof(float) * hidden);
  }
}

void AddInPlace(const float* x, int64_t count, float* acc) {
  for (int64_t i = 0; i < count; ++i) acc[i] += x[i];
}

void ArgmaxRows(const float* logits, int64_t rows, int64_t cols, int32_t* ids) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * cols;
    int64_t best = 0;
    for (int64_t c = 1; c < cols; ++c) {
      if (row[c] > row[best]) best = c;
    }
    ids[r] = static_cast<int32_t>(best);
  }
}

void RopeNeoxInPlace(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                     const int32_t* positions, float theta) {
  RopePartialNeoxInPlace(x, tokens, heads, head_dim, head_dim, positions, theta);
}

void RopePartialNeoxInPlace(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                            int64_t rotary_dim, const int32_t* positions, float theta) {
  const int64_t half = rotary_dim / 2;
  std::vector<float> cosines(half);
  std::vector<float> sines(half);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq =
          std::pow(static_cast<double>(theta),
                   -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim));
      const double angle = static_cast<double>(positions[t]) * inv_freq;
      cosines[i] = static_cast<float>(std::cos(angle));
      sines[i] = static_cast<float>(std::sin(angle));
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* lo = x + (t * heads + h) * head_dim;
      float* hi = lo + half;
      for (int64_t i = 0; i < half; ++i) {
        const float a = lo[i];
        const float b = hi[i];
        lo[i] = a * cosines[i] - b * sines[i];
        hi[i] = b * cosines[i] + a * sines[i];
      }
    }
  }
}

void MqaAttention(const float* q, int64_t queries, int64_t heads, int64_t head_dim, const float* k,
                  const float* v, int64_t kv_len, const int32_t* query_positions, float scale,
                  float* out) {
  std::vector<float> scores(kv_len);
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t visible = std::min<int64_t>(kv_len, query_positions[i] + 1);
    if (visible <= 0) {
      // Nothing to attend to (negative position, empty cache): zeros, not
      // 0 / 0.
      std::fill(out + i * heads * head_dim, out + (i + 1) * heads * head_dim, 0.0f);
      continue;
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float* query = q + (i * heads + h) * head_dim;
      float max_score = -INFINITY;
      for (int64_t s = 0; s < visible; ++s) {
        scores[s] = Dot(query, k + s * head_dim, head_dim) * scale;
        max_score = std::max(max_score, scores[s]);
      }
      float denominator = 0.0f;
      for (int64_t s = 0; s < visible; ++s) {
        scores[s] = std::exp(scores[s] - max_score);
        denominator += scores[s];
      }
      float* o = out + (i * heads + h) * head_dim;
      std::fill(o, o + head_dim, 0.0f);
      for (int64_t s = 0; s < visible; ++s) {
        Axpy(scores[s], v + s * head_dim, head_dim, o);
      }
      const float inv_denominator = 1.0f / denominator;
      for (int64_t c = 0; c < head_dim; ++c) o[c] *= inv_denominator;
    }
  }
}

void SiluMul(const float* gate, const float* up, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

int64_t SwiGluScratchFloats(int64_t rows, int64_t inter) { return 2 * rows * inter; }

void SwiGlu(const float* x, int64_t rows, int64_t hidden, const float* w_gate, const float* w_up,
            const float* w_down, int64_t inter, float* scratch, float* y) {
  float* gate = scratch;
  float* up = scratch + rows * inter;
  Linear(x, rows, hidden, w_gate, inter, gate);
  Linear(x, rows, hidden, w_up, inter, up);
  SiluMul(gate, up, rows * inter, gate);
  Linear(gate, rows, inter, w_down, hidden, y);
}

void RouterSoftmaxTopK(const float* logits, int64_t tokens, int64_t experts, int k,
                       int32_t* topk_ids, float* topk_weights) {
  std::vector<float> probabilities(experts);
  std::vector<char> taken(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = logits + t * experts;
    const float max_logit = *std::max_element(row, row + experts);
    float denominator = 0.0f;
    for (int64_t e = 0; e < experts; ++e) {
      probabilities[e] = std::exp(row[e] - max_logit);
      denominator += probabilities[e];
    }
    for (int64_t e = 0; e < experts; ++e) probabilities[e] /= denominator;
    std::fill(taken.begin(), taken.end(), 0);
    // k is tiny (3), so k linear scans beat a sort; the strict ">" keeps the
    // lower id on ties.
    for (int j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e) {
        if (taken[e]) continue;
        if (best < 0 || probabilities[e] > probabilities[best]) best = e;
      }
      taken[best] = 1;
      topk_ids[t * k + j] = static_cast<int32_t>(best);
      topk_weights[t * k + j] = probabilities[best];
    }
  }
}

int64_t GroupedExpertScratchFloats(int64_t tokens, int64_t hidden, int64_t inter) {
  // Gathered inputs, SwiGLU scratch and the expert's outputs.
  return tokens * hidden + SwiGluScratchFloats(tokens, inter) + tokens * hidden;
}

void GroupedExpertSwiGlu(const float* x, int64_t tokens, int64_t hidden, const int32_t* topk_ids,
                         const float* topk_weights, int k, const int32_t* expert_to_slot,
                         int64_t num_experts, int64_t slots, const float* w_gate, const float* w_up,
                         const float* w_down, int64_t inter, float* scratch, float* y) {
  // Bucket the (token, weight) pairs by slot first so each expert runs one
  // dense GEMM over its tokens instead of one GEMV per token.
  std::vector<std::vector<int64_t>> routed_pairs(slots);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int j = 0; j < k; ++j) {
      const int32_t expert = topk_ids[t * k + j];
      if (expert < 0 || expert >= num_experts) continue;
      const int32_t slot = expert_to_slot[expert];
      if (slot >= 0) routed_pairs[slot].push_back(t * k + j);
    }
  }
  float* gathered = scratch;
  float* swiglu_scratch = gathered + tokens * hidden;
  float* expert_out = swiglu_scratch + SwiGluScratchFloats(tokens, inter);
  const int64_t expert_matrix = inter * hidden;
  for (int64_t slot = 0; slot < slots; ++slot) {
    const std::vector<int64_t>& pairs = routed_pairs[slot];
    if (pairs.empty()) continue;
    const int64_t n = static_cast<int64_t>(pairs.size());
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(gathered + i * hidden, x + (pairs[i] / k) * hidden, sizeof(float) * hidden);
    }
    SwiGlu(gathered, n, hidden, w_gate + slot * expert_matrix, w_up + slot * expert_matrix,
           w_down + slot * expert_matrix, inter, swiglu_scratch, expert_out);
    for (int64_t i = 0; i < n; ++i) {
      Axpy(topk_weights[pairs[i]], expert_out + i * hidden, hidden, y + (pairs[i] / k) * hidden);
    }
  }
}

void QuantizeFp8PerGroup(const float* x, int64_t tokens, int64_t hidden, int64_t group,
                         uint8_t* codes, float* scales) {
  const int64_t groups = hidden / group;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t base = t * hidden + g * group;
      float amax = 0.0f;
      for (int64_t c = 0; c < group; ++c) amax = std::max(amax, std::fabs(x[base + c]));
      const float scale = Fp8GroupScale(amax);
      scales[t * groups + g] = scale;
      for (int64_t c = 0; c < group; ++c) {
        codes[base + c] = EncodeFp8E4m3(x[base + c] / scale);
      }
    }
  }
}

void DequantizeFp8PerGroup(const uint8_t* codes, const float* scales, int64_t tokens,
                           int64_t hidden, int64_t group, float* x) {
  const int64_t groups = hidden / group;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t base = t * hidden + g * group;
      const float scale = scales[t * groups + g];
      for (int64_t c = 0; c < group; ++c) {
        x[base + c] = DecodeFp8E4m3(codes[base + c]) * scale;
      }
    }
  }
}

void EncodeBf16Array(const float* x, int64_t count, uint16_t* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = EncodeBf16(x[i]);
}

void DecodeBf16Array(const uint16_t* x, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = DecodeBf16(x[i]);
}

void SumBf16Partials(const uint16_t* const* partials, int num_partials, int64_t count, float* sum) {
  if (num_partials == 0) {
    std::fill(sum, sum + count, 0.0f);
    return;
  }
  DecodeBf16Array(partials[0], count, sum);
  for (int p = 1; p < num_partials; ++p) {
    const uint16_t* partial = partials[p];
    for (int64_t i = 0; i < count; ++i) sum[i] += DecodeBf16(partial[i]);
  }
}

}  // namespace afd::cpu
