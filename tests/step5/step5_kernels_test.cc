// The Step-5 CPU kernels against their formulas (docs/model.md,
// "Step-5-Preview"): partial RoPE, LayerNorm, the gate, per-coordinate block
// summaries, indexer scores, the top-k tie rule, the causal mask inside the
// current block, sliding-window edges and the sigmoid router.

#include "examples/afd_model/step5/step5_kernels.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "examples/afd_model/kernels/codec.h"
#include "examples/afd_model/kernels/cpu_kernels.h"
#include "tests/support/random_vector.h"

namespace afd::step5 {
namespace {

using stepmesh::testing::RandomNormal;

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST_CASE("partial rope rotates only the prefix, by the formula", "[step5][kernels]") {
  const int64_t tokens = 3, heads = 2, d = 48;
  const std::vector<int32_t> positions = {0, 5, 3000};
  const auto x = RandomNormal(tokens * heads * d, 1);

  const int64_t rotary = 16;
  auto partial = x;
  afd::cpu::RopePartialNeoxInPlace(partial.data(), tokens, heads, d, rotary, positions.data(),
                                   1e7f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* in = x.data() + (t * heads + h) * d;
      const float* out = partial.data() + (t * heads + h) * d;
      for (int64_t i = 0; i < rotary / 2; ++i) {
        const double angle = positions[t] * std::pow(1e7, -2.0 * i / rotary);
        const double lo = in[i] * std::cos(angle) - in[i + rotary / 2] * std::sin(angle);
        const double hi = in[i + rotary / 2] * std::cos(angle) + in[i] * std::sin(angle);
        CHECK(std::fabs(out[i] - lo) < 1e-5);
        CHECK(std::fabs(out[i + rotary / 2] - hi) < 1e-5);
      }
      for (int64_t i = rotary; i < d; ++i) CHECK(out[i] == in[i]);
    }
  }
}

TEST_CASE("layernorm and the head gate follow their formulas", "[step5][kernels]") {
  const int64_t rows = 3, dim = 64;
  const auto x = RandomNormal(rows * dim, 2, 3.0f);
  const auto gamma = RandomNormal(dim, 3);
  const auto beta = RandomNormal(dim, 4);
  std::vector<float> y(rows * dim);
  cpu::LayerNorm(x.data(), gamma.data(), beta.data(), rows, dim, 1e-6f, y.data());
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0.0, var = 0.0;
    for (int64_t i = 0; i < dim; ++i) mean += x[r * dim + i];
    mean /= dim;
    for (int64_t i = 0; i < dim; ++i) var += std::pow(x[r * dim + i] - mean, 2);
    var /= dim;
    for (int64_t i = 0; i < dim; ++i) {
      const double expected = (x[r * dim + i] - mean) / std::sqrt(var + 1e-6) * gamma[i] + beta[i];
      CHECK(std::fabs(y[r * dim + i] - expected) < 1e-4);
    }
  }

  const int64_t tokens = 2, heads = 3, d = 4;
  const auto gate = RandomNormal(tokens * heads, 5, 2.0f);
  const auto o = RandomNormal(tokens * heads * d, 6);
  auto gated = o;
  cpu::HeadSigmoidGate(gate.data(), tokens, heads, d, gated.data());
  for (int64_t i = 0; i < tokens * heads * d; ++i) {
    CHECK(std::fabs(gated[i] - o[i] * Sigmoid(gate[i / d])) < 1e-6);
  }
}

TEST_CASE("block summaries are a softmax per coordinate, stored as e4m3(bf16(c))",
          "[step5][kernels][summary]") {
  const int64_t b = 8, p = 4;
  std::vector<float> keys(b * p), logits(b * p);
  for (int64_t j = 0; j < b; ++j) {
    keys[j * p + 0] = static_cast<float>(j);  // uniform logits: the mean, 3.5
    logits[j * p + 0] = 0.25f;
    keys[j * p + 1] = static_cast<float>(j) + 1;  // token 2 dominates: 3
    logits[j * p + 1] = j == 2 ? 100.0f : 0.0f;
    keys[j * p + 2] = static_cast<float>(j) + 1;  // token 6 dominates: 7
    logits[j * p + 2] = j == 6 ? 100.0f : 0.0f;
    keys[j * p + 3] = -0.5f * static_cast<float>(j);  // two tokens share: -(1+1.5)/2
    logits[j * p + 3] = (j == 2 || j == 3) ? 90.0f : -10.0f;
  }
  std::vector<uint8_t> codes(p);
  cpu::BlockSummary(keys.data(), logits.data(), b, p, codes.data());
  // Each coordinate picked its own token: no single weighting of whole key
  // vectors could produce (3.5, 3, 7, -1.25).
  CHECK(DecodeFp8E4m3(codes[0]) == 3.5f);
  CHECK(DecodeFp8E4m3(codes[1]) == 3.0f);
  CHECK(DecodeFp8E4m3(codes[2]) == 7.0f);
  CHECK(DecodeFp8E4m3(codes[3]) == -1.25f);

  // Random inputs: the stored code is the E4M3 rounding of BF16(c) with c
  // from the formula in double (or its neighbour at a rounding tie).
  const int64_t wide = 256;
  const auto k2 = RandomNormal(b * wide, 7);
  const auto z2 = RandomNormal(b * wide, 8, 2.0f);
  std::vector<uint8_t> c2(wide);
  cpu::BlockSummary(k2.data(), z2.data(), b, wide, c2.data());
  int exact = 0;
  for (int64_t d = 0; d < wide; ++d) {
    double zmax = -1e30, denominator = 0.0, c = 0.0;
    for (int64_t j = 0; j < b; ++j) zmax = std::max(zmax, double{z2[j * wide + d]});
    for (int64_t j = 0; j < b; ++j) denominator += std::exp(z2[j * wide + d] - zmax);
    for (int64_t j = 0; j < b; ++j) {
      c += std::exp(z2[j * wide + d] - zmax) / denominator * k2[j * wide + d];
    }
    const uint8_t expected = EncodeFp8E4m3(RoundToBf16(static_cast<float>(c)));
    if (expected == c2[d]) {
      ++exact;
    } else {
      CHECK(std::abs(int{expected} - int{c2[d]}) == 1);
    }
  }
  CHECK(exact >= wide - 3);
}

TEST_CASE("indexer scores: weighted ReLU of fp8 dot products, summed per group",
          "[step5][kernels][indexer]") {
  const int64_t groups = 2, hg = 3, p = 16, blocks = 5;
  const auto q = RandomNormal(groups * hg * p, 9);
  const auto c = RandomNormal(blocks * p, 10);
  const auto w = RandomNormal(groups * hg, 11);  // signed weights
  std::vector<uint8_t> qc(q.size()), cc(c.size());
  cpu::CastFp8E4m3(q.data(), static_cast<int64_t>(q.size()), qc.data());
  cpu::CastFp8E4m3(c.data(), static_cast<int64_t>(c.size()), cc.data());
  std::vector<float> scratch((groups * hg + 1) * p), scores(groups * blocks);
  cpu::IndexerScores(qc.data(), w.data(), groups, hg, p, cc.data(), blocks, scratch.data(),
                     scores.data());
  int relu_zeros = 0;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < blocks; ++r) {
      double expected = 0.0;
      for (int64_t h = 0; h < hg; ++h) {
        double dot = 0.0;
        for (int64_t i = 0; i < p; ++i) {
          dot += double{DecodeFp8E4m3(qc[(g * hg + h) * p + i])} * DecodeFp8E4m3(cc[r * p + i]);
        }
        relu_zeros += dot <= 0.0;
        expected += w[g * hg + h] * std::max(dot, 0.0);
      }
      CHECK(std::fabs(scores[g * blocks + r] - expected) < 1e-4 * (1 + std::fabs(expected)));
    }
  }
  CHECK(relu_zeros > 0);                                          // the ReLU was exercised
  CHECK(*std::min_element(scores.begin(), scores.end()) < 0.0f);  // signed weights
}

std::vector<int32_t> TopK(const std::vector<float>& scores, int64_t k) {
  std::vector<int32_t> order(scores.size()), selected(scores.size());
  const int64_t n = cpu::SelectTopKBlocks(scores.data(), static_cast<int64_t>(scores.size()), k,
                                          order.data(), selected.data());
  selected.resize(n);
  return selected;
}

TEST_CASE("top-k: ties at the cut take a prefix in ascending block id", "[step5][kernels][topk]") {
  const std::vector<float> scores = {1.0f, 3.0f, 3.0f, 3.0f, 0.0f, 3.0f, -2.0f};
  CHECK(TopK(scores, 1) == std::vector<int32_t>{1});
  CHECK(TopK(scores, 2) == std::vector<int32_t>{1, 2});
  CHECK(TopK(scores, 3) == std::vector<int32_t>{1, 2, 3});
  CHECK(TopK(scores, 5) == std::vector<int32_t>{0, 1, 2, 3, 5});
  CHECK(TopK(scores, 7) == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6});
  CHECK(TopK(scores, 100) == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6});
  CHECK(TopK(std::vector<float>(9, 0.0f), 4) == std::vector<int32_t>{0, 1, 2, 3});
  CHECK(TopK({-1.0f, -0.5f, -3.0f}, 1) == std::vector<int32_t>{1});
  CHECK(TopK({}, 4).empty());

  // Random scores with many exact ties (ReLU zeros and repeated values)
  // against a stable sort by descending score.
  std::mt19937 rng(12);
  std::uniform_int_distribution<int> pick(-3, 3);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> s(1 + trial % 40);
    for (float& v : s) v = static_cast<float>(std::max(0, pick(rng))) * 0.5f;
    const int64_t k = 1 + trial % 7;
    std::vector<int32_t> expected(s.size());
    std::iota(expected.begin(), expected.end(), 0);
    std::stable_sort(expected.begin(), expected.end(),
                     [&](int32_t a, int32_t b) { return s[a] > s[b]; });
    expected.resize(std::min<size_t>(k, s.size()));
    std::sort(expected.begin(), expected.end());
    REQUIRE(TopK(s, k) == expected);
  }
}

// Dense causal GQA of one query over an explicit position list, in double.
std::vector<double> NaiveAttention(const float* q, int64_t heads, int64_t groups, int64_t d,
                                   const std::vector<float>& k, const std::vector<float>& v,
                                   const std::vector<int64_t>& positions, float scale) {
  std::vector<double> out(heads * d, 0.0);
  const int64_t hg = heads / groups;
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t g = h / hg;
    std::vector<double> s;
    for (const int64_t p : positions) {
      double dot = 0.0;
      for (int64_t i = 0; i < d; ++i) dot += double{q[h * d + i]} * k[(p * groups + g) * d + i];
      s.push_back(dot * scale);
    }
    const double m = *std::max_element(s.begin(), s.end());
    double z = 0.0;
    for (double& x : s) z += (x = std::exp(x - m));
    for (size_t j = 0; j < positions.size(); ++j) {
      for (int64_t i = 0; i < d; ++i) {
        out[h * d + i] += s[j] / z * v[(positions[j] * groups + g) * d + i];
      }
    }
  }
  return out;
}

TEST_CASE("sparse attention: selected blocks plus the causal prefix of the current block",
          "[step5][kernels][sparse]") {
  const int64_t heads = 4, groups = 2, d = 8, b = 8, len = 64;
  const float scale = 1.0f / std::sqrt(8.0f);
  auto k = RandomNormal(len * groups * d, 13);
  auto v = RandomNormal(len * groups * d, 14);
  const auto q = RandomNormal(heads * d, 15);
  const int64_t pos = 42;  // current block 5 = positions 40..47; 43..47 are the future
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t p = pos + 1; p < len; ++p) {
    for (int64_t i = 0; i < groups * d; ++i) k[p * groups * d + i] = v[p * groups * d + i] = nan;
  }
  // Group 0 selected blocks {1, 3}; group 1 {0, 2, 4} (ascending, stride 3).
  const std::vector<int32_t> selected = {1, 3, 0, 0, 2, 4};
  const std::vector<int64_t> count = {2, 3};
  std::vector<float> scratch(4 * b), out(heads * d);
  cpu::SparseBlockAttention(q.data(), heads, groups, d, k.data(), v.data(), pos, b, selected.data(),
                            count.data(), 3, scale, scratch.data(), out.data());
  std::vector<int64_t> g0, g1;
  for (int64_t blk : {1, 3})
    for (int64_t p = blk * b; p < blk * b + b; ++p) g0.push_back(p);
  for (int64_t blk : {0, 2, 4})
    for (int64_t p = blk * b; p < blk * b + b; ++p) g1.push_back(p);
  for (int64_t p = 40; p <= pos; ++p) {
    g0.push_back(p);
    g1.push_back(p);
  }
  const auto e0 = NaiveAttention(q.data(), heads, groups, d, k, v, g0, scale);
  const auto e1 = NaiveAttention(q.data(), heads, groups, d, k, v, g1, scale);
  for (int64_t h = 0; h < heads; ++h) {
    const auto& e = h < 2 ? e0 : e1;
    for (int64_t i = 0; i < d; ++i) {
      REQUIRE(std::isfinite(out[h * d + i]));  // nothing past pos was read
      CHECK(std::fabs(out[h * d + i] - e[h * d + i]) < 1e-5);
    }
  }

  // First token of a block: only itself from the current block.
  const int64_t first = 40;
  std::vector<int64_t> none = {0, 0};
  cpu::SparseBlockAttention(q.data(), heads, groups, d, k.data(), v.data(), first, b,
                            selected.data(), none.data(), 3, scale, scratch.data(), out.data());
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t g = h / 2;
    for (int64_t i = 0; i < d; ++i) CHECK(out[h * d + i] == v[(first * groups + g) * d + i]);
  }
}

TEST_CASE("sliding window: the window counts the current token, ring slots wrap",
          "[step5][kernels][sliding]") {
  const int64_t heads = 4, groups = 2, d = 8, window = 5, len = 20;
  const float scale = 0.3f;
  const auto k = RandomNormal(len * groups * d, 16);
  const auto v = RandomNormal(len * groups * d, 17);
  const auto q = RandomNormal(heads * d, 18);
  std::vector<float> scratch(window), out(heads * d);
  for (int64_t pos : {0, 3, 4, 5, 6, 19}) {
    // A linear cache (ring larger than the sequence) with NaN outside the
    // window: reading it would poison the output.
    auto kl = k, vl = v;
    const int64_t first = std::max<int64_t>(0, pos - window + 1);
    for (int64_t p = 0; p < len; ++p) {
      if (p >= first && p <= pos) continue;
      for (int64_t i = 0; i < groups * d; ++i) {
        kl[p * groups * d + i] = vl[p * groups * d + i] = std::numeric_limits<float>::quiet_NaN();
      }
    }
    cpu::SlidingWindowAttention(q.data(), heads, groups, d, kl.data(), vl.data(), len, pos, window,
                                scale, scratch.data(), out.data());
    std::vector<int64_t> visible;
    for (int64_t p = first; p <= pos; ++p) visible.push_back(p);
    CHECK(static_cast<int64_t>(visible.size()) == std::min<int64_t>(pos + 1, window));
    const auto expected = NaiveAttention(q.data(), heads, groups, d, k, v, visible, scale);
    for (int64_t i = 0; i < heads * d; ++i) {
      REQUIRE(std::isfinite(out[i]));
      CHECK(std::fabs(out[i] - expected[i]) < 1e-5);
    }

    // The same through a ring of exactly `window` slots holding the last
    // window positions: identical bits.
    std::vector<float> rk(window * groups * d), rv(window * groups * d), ring_out(heads * d);
    for (int64_t p = first; p <= pos; ++p) {
      std::copy_n(k.data() + p * groups * d, groups * d, rk.data() + (p % window) * groups * d);
      std::copy_n(v.data() + p * groups * d, groups * d, rv.data() + (p % window) * groups * d);
    }
    cpu::SlidingWindowAttention(q.data(), heads, groups, d, rk.data(), rv.data(), window, pos,
                                window, scale, scratch.data(), ring_out.data());
    CHECK(ring_out == out);
  }
}

TEST_CASE("sigmoid router: the bias selects, the sigmoid weighs, weights normalised and scaled",
          "[step5][kernels][router]") {
  const int64_t experts = 6;
  const int k = 2;
  const std::vector<float> logits = {2.0f, 1.0f, 0.5f, 0.5f, -1.0f, 1.5f};
  const std::vector<float> bias = {0.0f, 0.0f, 0.6f, 0.6f, 0.0f, 0.0f};
  std::vector<int32_t> ids(k);
  std::vector<float> weights(k);
  cpu::RouterSigmoidTopK(logits.data(), bias.data(), 1, experts, k, true, 3.0f, ids.data(),
                         weights.data());
  // sigmoid + bias: e0 0.881, e2 = e3 1.222 (tie -> 2 first, then 3), e5 0.818.
  CHECK(ids == std::vector<int32_t>{2, 3});
  CHECK(std::fabs(weights[0] - 1.5) < 1e-6);  // equal sigmoids -> 3.0 / 2 each
  CHECK(std::fabs(weights[1] - 1.5) < 1e-6);

  const std::vector<float> zero_bias(experts, 0.0f);
  cpu::RouterSigmoidTopK(logits.data(), zero_bias.data(), 1, experts, k, true, 3.0f, ids.data(),
                         weights.data());
  CHECK(ids == std::vector<int32_t>{0, 5});
  const double s0 = Sigmoid(2.0), s5 = Sigmoid(1.5);
  CHECK(std::fabs(weights[0] - 3.0 * s0 / (s0 + s5)) < 1e-6);
  CHECK(std::fabs(weights[1] - 3.0 * s5 / (s0 + s5)) < 1e-6);

  cpu::RouterSigmoidTopK(logits.data(), zero_bias.data(), 1, experts, k, false, 1.0f, ids.data(),
                         weights.data());
  CHECK(std::fabs(weights[0] - s0) < 1e-6);
}

}  // namespace
}  // namespace afd::step5
