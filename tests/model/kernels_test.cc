#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "examples/afd_model/kernels/cpu_kernels.h"
#include "tests/support/random_vector.h"

namespace afd {
namespace {

using stepmesh::testing::RandomNormal;

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return m;
}

TEST_CASE("rmsnorm matches the formula", "[kernels]") {
  const int64_t rows = 3, dim = 40;
  const auto x = RandomNormal(rows * dim, 1);
  const auto gamma = RandomNormal(dim, 2);
  std::vector<float> y(rows * dim);
  cpu::RmsNorm(x.data(), gamma.data(), rows, dim, 1e-5f, y.data());
  std::vector<float> expected(rows * dim);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (int64_t i = 0; i < dim; ++i) ss += double{x[r * dim + i]} * x[r * dim + i];
    const double inv = 1.0 / std::sqrt(ss / dim + 1e-5);
    for (int64_t i = 0; i < dim; ++i) {
      expected[r * dim + i] = static_cast<float>(x[r * dim + i] * inv * gamma[i]);
    }
  }
  CHECK(MaxAbsDiff(y, expected) < 1e-5);
}

TEST_CASE("neox rope matches the direct formula", "[kernels]") {
  const int64_t tokens = 4, heads = 3, d = 64;
  const double theta = 500000.0;
  const std::vector<int32_t> positions = {0, 1, 17, 4000};
  const auto x = RandomNormal(tokens * heads * d, 3);
  auto y = x;
  cpu::RopeNeoxInPlace(y.data(), tokens, heads, d, positions.data(), 5e5f);
  std::vector<float> expected(x.size());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* in = x.data() + (t * heads + h) * d;
      float* out = expected.data() + (t * heads + h) * d;
      for (int64_t i = 0; i < d / 2; ++i) {
        const double angle = positions[t] * std::pow(theta, -2.0 * i / d);
        out[i] = static_cast<float>(in[i] * std::cos(angle) - in[i + d / 2] * std::sin(angle));
        out[i + d / 2] =
            static_cast<float>(in[i + d / 2] * std::cos(angle) + in[i] * std::sin(angle));
      }
    }
  }
  CHECK(MaxAbsDiff(y, expected) < 1e-5);
  // Position 0 is the identity.
  CHECK(std::equal(y.begin(), y.begin() + heads * d, x.begin()));
}

// Naive O(T^2) causal MQA in double.
std::vector<float> NaiveAttention(const std::vector<float>& q, const std::vector<float>& k,
                                  const std::vector<float>& v, int64_t tokens, int64_t heads,
                                  int64_t d) {
  std::vector<float> out(tokens * heads * d);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      std::vector<double> p(t + 1);
      double max_score = -INFINITY;
      for (int64_t s = 0; s <= t; ++s) {
        double dot = 0.0;
        for (int64_t c = 0; c < d; ++c) {
          dot += double{q[(t * heads + h) * d + c]} * k[s * d + c];
        }
        p[s] = dot / std::sqrt(static_cast<double>(d));
        max_score = std::max(max_score, p[s]);
      }
      double total = 0.0;
      for (double& e : p) total += (e = std::exp(e - max_score));
      for (int64_t c = 0; c < d; ++c) {
        double acc = 0.0;
        for (int64_t s = 0; s <= t; ++s) acc += p[s] * v[s * d + c];
        out[(t * heads + h) * d + c] = static_cast<float>(acc / total);
      }
    }
  }
  return out;
}

TEST_CASE("mqa attention: prefill and cached decode match naive", "[kernels]") {
  const int64_t tokens = 13, heads = 4, d = 32;
  const auto q = RandomNormal(tokens * heads * d, 4);
  const auto k = RandomNormal(tokens * d, 5);
  const auto v = RandomNormal(tokens * d, 6);
  const auto expected = NaiveAttention(q, k, v, tokens, heads, d);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  std::vector<int32_t> positions(tokens);
  std::iota(positions.begin(), positions.end(), 0);
  std::vector<float> prefill(tokens * heads * d);
  cpu::MqaAttention(q.data(), tokens, heads, d, k.data(), v.data(), tokens, positions.data(), scale,
                    prefill.data());
  CHECK(MaxAbsDiff(prefill, expected) < 1e-5);

  // Decode: token t alone against a cache holding rows 0..t.
  std::vector<float> decode(tokens * heads * d);
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t pos = static_cast<int32_t>(t);
    cpu::MqaAttention(q.data() + t * heads * d, 1, heads, d, k.data(), v.data(), t + 1, &pos, scale,
                      decode.data() + t * heads * d);
  }
  CHECK(MaxAbsDiff(decode, expected) < 1e-5);
  CHECK(MaxAbsDiff(decode, prefill) < 1e-6);
}

TEST_CASE("mqa attention: a query that sees no row gets zeros", "[kernels]") {
  const int64_t heads = 2, d = 8;
  const auto q = RandomNormal(3 * heads * d, 22);
  const auto k = RandomNormal(4 * d, 23);
  const auto v = RandomNormal(4 * d, 24);
  const std::vector<int32_t> positions = {-1, 2, -5};
  std::vector<float> out(3 * heads * d, NAN);
  cpu::MqaAttention(q.data(), 3, heads, d, k.data(), v.data(), 4, positions.data(), 0.5f,
                    out.data());
  for (int64_t i = 0; i < heads * d; ++i) {
    CHECK(out[i] == 0.0f);
    CHECK(out[2 * heads * d + i] == 0.0f);
    CHECK(std::isfinite(out[heads * d + i]));
  }
  // An empty cache: zeros too.
  const int32_t zero = 0;
  std::vector<float> empty(heads * d, NAN);
  cpu::MqaAttention(q.data(), 1, heads, d, k.data(), v.data(), 0, &zero, 0.5f, empty.data());
  for (float x : empty) CHECK(x == 0.0f);
}

TEST_CASE("router: softmax top-3, ties to the lower id, no renorm", "[kernels]") {
  // Experts 2, 5, 9 and 11 tie at the top: the three lowest ids win.
  std::vector<float> logits(2 * 12, 0.0f);
  logits[2] = logits[5] = logits[9] = 3.0f;
  logits[11] = 3.0f;
  // Second token: distinct values with a tie between 4 and 6 at rank 3.
  for (int e = 0; e < 12; ++e) logits[12 + e] = -static_cast<float>(e);
  logits[12 + 3] = 5.0f;
  logits[12 + 4] = 2.0f;
  logits[12 + 6] = 2.0f;
  std::vector<int32_t> ids(6);
  std::vector<float> weights(6);
  cpu::RouterSoftmaxTopK(logits.data(), 2, 12, 3, ids.data(), weights.data());
  CHECK(ids[0] == 2);
  CHECK(ids[1] == 5);
  CHECK(ids[2] == 9);
  CHECK(ids[3] == 3);
  CHECK(ids[4] == 4);
  CHECK(ids[5] == 6);
  double denominator = 0.0;
  for (int e = 0; e < 12; ++e) denominator += std::exp(double{logits[e]} - 3.0);
  CHECK(weights[0] == Approx(1.0 / denominator).epsilon(1e-6));
  CHECK(weights[0] + weights[1] + weights[2] < 1.0f);  // not renormalised
}

// ---- Independent double-precision references (no cpu:: kernel inside) ----

// y[r, o] = sum_i x[r, i] * w[o, i]: the [out, in] (Hugging Face) layout.
std::vector<double> NaiveLinear(const std::vector<float>& x, int64_t rows, int64_t in,
                                const float* w, int64_t out) {
  std::vector<double> y(rows * out, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0.0;
      for (int64_t i = 0; i < in; ++i) acc += double{x[r * in + i]} * w[o * in + i];
      y[r * out + o] = acc;
    }
  }
  return y;
}

double NaiveSilu(double g) { return g / (1.0 + std::exp(-g)); }

// down(silu(x gate^T) * (x up^T)) for rows x, in double.
std::vector<double> NaiveSwiGlu(const std::vector<float>& x, int64_t rows, int64_t hidden,
                                const float* gate, const float* up, const float* down,
                                int64_t inter) {
  const std::vector<double> g = NaiveLinear(x, rows, hidden, gate, inter);
  const std::vector<double> u = NaiveLinear(x, rows, hidden, up, inter);
  std::vector<double> y(rows * hidden, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < hidden; ++o) {
      double acc = 0.0;
      for (int64_t i = 0; i < inter; ++i) {
        acc += NaiveSilu(g[r * inter + i]) * u[r * inter + i] * down[o * inter + i];
      }
      y[r * hidden + o] = acc;
    }
  }
  return y;
}

// Largest |got - want| relative to the largest |want| (a scale-free bound).
double MaxRelDiff(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return diff / scale;
}

// Small integers times 2^-7 (the weight scheme's values), so that every
// product and every partial sum of a short dot product is exact in fp32.
std::vector<float> DyadicVector(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> k(-128, 127);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(k(rng)) / 128.0f;
  return v;
}

TEST_CASE("linear: [out, in] weights against a double reference", "[kernels]") {
  // Odd sizes: no vector width divides them, so every tail path runs.
  const int64_t rows = 5, in = 37, out = 13;
  SECTION("exact values give bitwise results") {
    // |x|, |w| <= 1 with 7 fractional bits: products have 14, sums of 37 stay
    // below 2^6, so 21 significant bits suffice and any order is exact.
    const auto x = DyadicVector(rows * in, 11);
    const auto w = DyadicVector(out * in, 12);
    std::vector<float> y(rows * out);
    cpu::Linear(x.data(), rows, in, w.data(), out, y.data());
    const std::vector<double> want = NaiveLinear(x, rows, in, w.data(), out);
    for (int64_t i = 0; i < rows * out; ++i) REQUIRE(double{y[i]} == want[i]);
  }
  SECTION("random values within fp32 accumulation error") {
    const auto x = RandomNormal(rows * in, 13);
    const auto w = RandomNormal(out * in, 14, 0.2f);
    std::vector<float> y(rows * out);
    cpu::Linear(x.data(), rows, in, w.data(), out, y.data());
    CHECK(MaxRelDiff(y, NaiveLinear(x, rows, in, w.data(), out)) < 1e-6);
  }
  SECTION("a transposed weight would be caught") {
    // in == out, w not symmetric: x w^T differs from x w.
    const int64_t n = 8;
    const auto x = DyadicVector(n, 15);
    const auto w = DyadicVector(n * n, 16);
    std::vector<float> y(n);
    cpu::Linear(x.data(), 1, n, w.data(), n, y.data());
    const std::vector<double> want = NaiveLinear(x, 1, n, w.data(), n);
    for (int64_t i = 0; i < n; ++i) REQUIRE(double{y[i]} == want[i]);
  }
}

TEST_CASE("silu-mul against the formula, extremes included", "[kernels]") {
  std::vector<float> gate = {0.0f,   -0.0f, 1.0f,   -1.0f,  3.5f,    -3.5f, 20.0f,
                             -20.0f, 88.0f, -88.0f, 1e-20f, -1e-20f, 0.25f};
  std::vector<float> up = {1.0f, 2.0f, -1.5f, 0.5f, 2.0f, -2.0f, 1.0f,
                           1.0f, 1.0f, 1.0f,  3.0f, 3.0f, -4.0f};
  const int64_t n = static_cast<int64_t>(gate.size());
  std::vector<float> out(n);
  cpu::SiluMul(gate.data(), up.data(), n, out.data());
  for (int64_t i = 0; i < n; ++i) {
    const double want = NaiveSilu(gate[i]) * up[i];
    INFO("gate " << gate[i] << " up " << up[i] << " got " << out[i] << " want " << want);
    REQUIRE(std::isfinite(out[i]));
    CHECK(std::fabs(out[i] - want) <= 2e-7 * std::fabs(want) + 1e-37);
  }
  // In place on either operand.
  auto in_gate = gate;
  cpu::SiluMul(in_gate.data(), up.data(), n, in_gate.data());
  CHECK(in_gate == out);
  auto in_up = up;
  cpu::SiluMul(gate.data(), in_up.data(), n, in_up.data());
  CHECK(in_up == out);
}

TEST_CASE("swiglu against a double reference", "[kernels]") {
  const int64_t rows = 7, hidden = 40, inter = 27;
  const auto x = RandomNormal(rows * hidden, 17);
  const auto gate = RandomNormal(inter * hidden, 18, 0.2f);
  const auto up = RandomNormal(inter * hidden, 19, 0.2f);
  const auto down = RandomNormal(hidden * inter, 20, 0.2f);
  std::vector<float> scratch(cpu::SwiGluScratchFloats(rows, inter));
  std::vector<float> y(rows * hidden, 123.0f);  // overwritten, not accumulated
  cpu::SwiGlu(x.data(), rows, hidden, gate.data(), up.data(), down.data(), inter, scratch.data(),
              y.data());
  CHECK(MaxRelDiff(y, NaiveSwiGlu(x, rows, hidden, gate.data(), up.data(), down.data(), inter)) <
        2e-6);
  // Swapping gate and up changes the result (silu applies to the gate only).
  std::vector<float> swapped(rows * hidden);
  cpu::SwiGlu(x.data(), rows, hidden, up.data(), gate.data(), down.data(), inter, scratch.data(),
              swapped.data());
  CHECK(MaxAbsDiff(swapped, y) > 1e-3);
}

TEST_CASE("grouped experts against a double per-token reference", "[kernels]") {
  const int64_t tokens = 9, hidden = 32, inter = 24, experts = 6;
  const int k = 3;
  const auto x = RandomNormal(tokens * hidden, 7);
  const auto gate = RandomNormal(experts * inter * hidden, 8, 0.2f);
  const auto up = RandomNormal(experts * inter * hidden, 9, 0.2f);
  const auto down = RandomNormal(experts * hidden * inter, 10, 0.2f);
  // Distinct ids per token, in no particular order; expert 5 gets no token.
  std::vector<int32_t> ids(tokens * k);
  std::vector<float> weights(tokens * k);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int j = 0; j < k; ++j) {
      ids[t * k + j] = static_cast<int32_t>((t + 2 * j + (t % 2) * 3) % (experts - 1));
      weights[t * k + j] = 0.1f * (j + 1) + 0.01f * t;
    }
    std::sort(ids.begin() + t * k, ids.begin() + (t + 1) * k);
    REQUIRE(std::adjacent_find(ids.begin() + t * k, ids.begin() + (t + 1) * k) ==
            ids.begin() + (t + 1) * k);
  }
  // y starts non-zero: the kernel accumulates.
  const auto y0 = RandomNormal(tokens * hidden, 21);
  // Reference: for each token and each of its experts, w * SwiGLU_e(x[t]) in
  // double, only over the experts the partition owns.
  auto reference = [&](const std::vector<bool>& owned) {
    std::vector<double> want(y0.begin(), y0.end());
    for (int64_t t = 0; t < tokens; ++t) {
      const std::vector<float> row(x.begin() + t * hidden, x.begin() + (t + 1) * hidden);
      for (int j = 0; j < k; ++j) {
        const int64_t e = ids[t * k + j];
        if (!owned[e]) continue;
        const std::vector<double> f =
            NaiveSwiGlu(row, 1, hidden, gate.data() + e * inter * hidden,
                        up.data() + e * inter * hidden, down.data() + e * hidden * inter, inter);
        for (int64_t c = 0; c < hidden; ++c) want[t * hidden + c] += weights[t * k + j] * f[c];
      }
    }
    return want;
  };
  std::vector<float> scratch(cpu::GroupedExpertScratchFloats(tokens, hidden, inter));

  SECTION("one partition owning every expert") {
    std::vector<int32_t> all_slots(experts);
    std::iota(all_slots.begin(), all_slots.end(), 0);
    auto y = y0;
    cpu::GroupedExpertSwiGlu(x.data(), tokens, hidden, ids.data(), weights.data(), k,
                             all_slots.data(), experts, experts, gate.data(), up.data(),
                             down.data(), inter, scratch.data(), y.data());
    CHECK(MaxRelDiff(y, reference(std::vector<bool>(experts, true))) < 2e-6);
  }
  SECTION("partitions e % 2 == p with compacted slots, and one owning nothing used") {
    for (int part = 0; part < 3; ++part) {
      // part 2 owns only expert 5, which no token chose: y must not change.
      std::vector<bool> owned(experts, false);
      std::vector<int32_t> to_slot(experts, -1);
      std::vector<float> g, u, dn;
      int32_t slots = 0;
      for (int64_t e = 0; e < experts; ++e) {
        owned[e] = part == 2 ? e == 5 : (e % 2 == part && e != 5);
        if (!owned[e]) continue;
        to_slot[e] = slots++;
        g.insert(g.end(), gate.begin() + e * inter * hidden,
                 gate.begin() + (e + 1) * inter * hidden);
        u.insert(u.end(), up.begin() + e * inter * hidden, up.begin() + (e + 1) * inter * hidden);
        dn.insert(dn.end(), down.begin() + e * hidden * inter,
                  down.begin() + (e + 1) * hidden * inter);
      }
      auto y = y0;
      cpu::GroupedExpertSwiGlu(x.data(), tokens, hidden, ids.data(), weights.data(), k,
                               to_slot.data(), experts, slots, g.data(), u.data(), dn.data(), inter,
                               scratch.data(), y.data());
      INFO("partition " << part);
      if (part == 2) {
        CHECK(y == y0);
      } else {
        CHECK(MaxRelDiff(y, reference(owned)) < 2e-6);
      }
    }
  }
}

TEST_CASE("argmax ties go to the lower index", "[kernels]") {
  const std::vector<float> logits = {0.0f, 2.0f, 2.0f, -1.0f, 5.0f, 1.0f, 5.0f, 5.0f};
  std::vector<int32_t> ids(2);
  cpu::ArgmaxRows(logits.data(), 2, 4, ids.data());
  CHECK(ids[0] == 1);
  CHECK(ids[1] == 0);
}

TEST_CASE("bf16 partial reduction adds in partition order", "[kernels]") {
  const std::vector<uint16_t> p0 = {0x3F80, 0x4000};  // 1, 2
  const std::vector<uint16_t> p1 = {0x3F00, 0xC000};  // 0.5, -2
  const uint16_t* partials[] = {p0.data(), p1.data()};
  std::vector<float> sum(2);
  cpu::SumBf16Partials(partials, 2, 2, sum.data());
  CHECK(sum[0] == 1.5f);
  CHECK(sum[1] == 0.0f);
}

}  // namespace
}  // namespace afd
