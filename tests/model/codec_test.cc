#include "examples/afd_model/kernels/codec.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "examples/afd_model/kernels/cpu_kernels.h"

namespace afd {
namespace {

bool IsNanCode(int code) { return (code & 0x7F) == 0x7F; }

// Nearest finite E4M3 value by exhaustive search; ties go to the code with
// an even mantissa (RNE). Saturates like the encoder.
uint8_t BruteForceE4m3(float x) {
  if (std::fabs(x) >= 448.0f) return x < 0 ? 0xFE : 0x7E;
  int best = -1;
  double best_distance = INFINITY;
  for (int code = 0; code < 256; ++code) {
    if (IsNanCode(code)) continue;
    const float value = DecodeFp8E4m3(static_cast<uint8_t>(code));
    if (std::signbit(value) != std::signbit(x)) continue;
    const double distance = std::fabs(static_cast<double>(value) - x);
    if (distance < best_distance || (distance == best_distance && (code & 1) == 0)) {
      best = code;
      best_distance = distance;
    }
  }
  return static_cast<uint8_t>(best);
}

TEST_CASE("fp8 e4m3: every finite code round-trips", "[codec]") {
  int finite_codes = 0;
  for (int code = 0; code < 256; ++code) {
    const float value = DecodeFp8E4m3(static_cast<uint8_t>(code));
    if (IsNanCode(code)) {
      CHECK(std::isnan(value));
      continue;
    }
    ++finite_codes;
    INFO("code " << code << " value " << value);
    CHECK(EncodeFp8E4m3(value) == code);
  }
  CHECK(finite_codes == 254);
  CHECK(DecodeFp8E4m3(0x7E) == 448.0f);
  CHECK(DecodeFp8E4m3(0x08) == std::ldexp(1.0f, -6));  // smallest normal
  CHECK(DecodeFp8E4m3(0x01) == std::ldexp(1.0f, -9));  // smallest subnormal
  CHECK(DecodeFp8E4m3(0x38) == 1.0f);
}

TEST_CASE("fp8 e4m3: ties round to even", "[codec]") {
  CHECK(EncodeFp8E4m3(1.0625f) == 0x38);  // 1 | 1.125 -> 1
  CHECK(EncodeFp8E4m3(1.1875f) == 0x3A);  // 1.125 | 1.25 -> 1.25
  CHECK(EncodeFp8E4m3(-1.0625f) == 0xB8);
  CHECK(EncodeFp8E4m3(std::nextafter(1.0625f, 2.0f)) == 0x39);
  CHECK(EncodeFp8E4m3(1.9375f) == 0x40);  // mantissa carry into exponent
  CHECK(EncodeFp8E4m3(232.0f) == 0x76);   // 224 (even) | 240 -> 224
  CHECK(EncodeFp8E4m3(248.0f) == 0x78);   // 240 (odd) | 256 -> 256
  CHECK(DecodeFp8E4m3(0x78) == 256.0f);
}

TEST_CASE("fp8 e4m3: subnormals", "[codec]") {
  const float step = std::ldexp(1.0f, -9);
  CHECK(EncodeFp8E4m3(0.5f * step) == 0x00);  // tie to even (0)
  CHECK(EncodeFp8E4m3(1.5f * step) == 0x02);
  CHECK(EncodeFp8E4m3(2.5f * step) == 0x02);
  CHECK(EncodeFp8E4m3(7.5f * step) == 0x08);  // rounds up into the normals
  CHECK(EncodeFp8E4m3(0.3f * step) == 0x00);
  CHECK(EncodeFp8E4m3(-3.0f * step) == 0x83);
  CHECK(EncodeFp8E4m3(1e-30f) == 0x00);
}

TEST_CASE("fp8 e4m3: saturation, never NaN", "[codec]") {
  CHECK(EncodeFp8E4m3(448.0f) == 0x7E);
  CHECK(EncodeFp8E4m3(449.0f) == 0x7E);
  CHECK(EncodeFp8E4m3(1e9f) == 0x7E);
  CHECK(EncodeFp8E4m3(-1e9f) == 0xFE);
  CHECK(EncodeFp8E4m3(std::numeric_limits<float>::infinity()) == 0x7E);
  CHECK(EncodeFp8E4m3(-std::numeric_limits<float>::infinity()) == 0xFE);
  CHECK(EncodeFp8E4m3(std::numeric_limits<float>::quiet_NaN()) == 0x00);
  CHECK(EncodeFp8E4m3(432.0f) == 0x7E);  // 416 | 448 tie -> even mantissa 6
}

TEST_CASE("fp8 e4m3: encoder equals exhaustive nearest-even search", "[codec]") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-12.0f, 9.5f);
  std::bernoulli_distribution negative(0.5);
  for (int i = 0; i < 20000; ++i) {
    float x = std::exp2(exponent(rng));
    if (negative(rng)) x = -x;
    INFO("x = " << x);
    REQUIRE(EncodeFp8E4m3(x) == BruteForceE4m3(x));
  }
  // Every exact midpoint between neighbouring positive codes.
  for (int code = 0; code < 0x7E; ++code) {
    const float lo = DecodeFp8E4m3(static_cast<uint8_t>(code));
    const float hi = DecodeFp8E4m3(static_cast<uint8_t>(code + 1));
    const float mid = 0.5f * (lo + hi);
    INFO("midpoint of code " << code);
    CHECK(EncodeFp8E4m3(mid) == ((code & 1) ? code + 1 : code));
  }
}

TEST_CASE("bf16: round to nearest even", "[codec]") {
  CHECK(EncodeBf16(1.0f) == 0x3F80);
  CHECK(EncodeBf16(1.0f + std::ldexp(1.0f, -8)) == 0x3F80);      // tie, even
  CHECK(EncodeBf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3F82);  // tie, up
  CHECK(EncodeBf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)) == 0x3F81);
  CHECK(EncodeBf16(-2.0f) == 0xC000);
  CHECK(EncodeBf16(std::numeric_limits<float>::max()) == 0x7F80);  // to inf
  CHECK(std::isnan(DecodeBf16(EncodeBf16(std::nanf("")))));
  CHECK(DecodeBf16(0x3F81) == 1.0078125f);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (int i = 0; i < 1000; ++i) {
    const float x = normal(rng);
    const float r = RoundToBf16(x);
    CHECK(std::fabs(r - x) <= std::ldexp(std::fabs(x), -8));
    CHECK(RoundToBf16(r) == r);
  }
}

TEST_CASE("fp8 per-group quantisation: scales and error", "[codec]") {
  const int64_t tokens = 3;
  const int64_t hidden = 256;
  std::vector<float> x(tokens * hidden);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  // Token 1, group 1 all zero; token 2 group 0 carries an outlier.
  std::fill(x.begin() + hidden + 128, x.begin() + 2 * hidden, 0.0f);
  x[2 * hidden + 5] = 40.0f;
  std::vector<uint8_t> codes(x.size());
  std::vector<float> scales(tokens * 2);
  std::vector<float> decoded(x.size());
  cpu::QuantizeFp8PerGroup(x.data(), tokens, hidden, 128, codes.data(), scales.data());
  cpu::DequantizeFp8PerGroup(codes.data(), scales.data(), tokens, hidden, 128, decoded.data());
  CHECK(scales[3] == 1.0f);
  CHECK(scales[4] == 40.0f / 448.0f);
  CHECK(decoded[2 * hidden + 5] == 40.0f);  // the amax maps to 448 exactly
  for (size_t i = 0; i < x.size(); ++i) {
    const float scale = scales[i / 128];
    // Half an E4M3 ulp relative (2^-4), or half a subnormal step.
    CHECK(std::fabs(decoded[i] - x[i]) <=
          std::max(std::fabs(x[i]) * 0.0625f, scale * std::ldexp(1.0f, -10)));
  }
}

}  // namespace
}  // namespace afd
