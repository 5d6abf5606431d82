#pragma once

// Scalar FP8 E4M3 ("fn" flavour: max 448, no infinities) and BF16 codecs.
// The A2F and F2A wire formats are defined by these functions, so the CPU
// reference and the CUDA kernels must produce identical bits: everything is
// plain integer/bit manipulation plus IEEE fp32 arithmetic, usable from device
// code.

#include <cstdint>
#include <cstring>

#include "examples/afd_model/kernels/host_device.h"

namespace afd {

inline constexpr float kFp8E4m3Max = 448.0f;
inline constexpr uint8_t kFp8E4m3MaxCode = 0x7E;  // 1.75 * 2^8

AFD_HOST_DEVICE inline uint32_t FloatBits(float value) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

AFD_HOST_DEVICE inline float BitsToFloat(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

// Round-to-nearest-even to E4M3. Saturates to +-448 (infinities included) and
// maps NaN to +0 so the wire never carries a NaN code.
AFD_HOST_DEVICE inline uint8_t EncodeFp8E4m3(float value) {
  const uint32_t bits = FloatBits(value);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude_bits = bits & 0x7FFFFFFFu;
  if (magnitude_bits > 0x7F800000u) return 0;  // NaN
  const float magnitude = BitsToFloat(magnitude_bits);
  if (magnitude >= kFp8E4m3Max) return sign | kFp8E4m3MaxCode;
  const int exponent = static_cast<int>(magnitude_bits >> 23) - 127;
  if (exponent < -6) {
    // Subnormal range, step 2^-9. The multiply by 512 is exact, and the
    // result 8 is the code of the smallest normal, so the carry is free.
    const float steps = magnitude * 512.0f;
    uint32_t whole = static_cast<uint32_t>(steps);
    const float remainder = steps - static_cast<float>(whole);
    if (remainder > 0.5f || (remainder == 0.5f && (whole & 1u))) ++whole;
    return sign | static_cast<uint8_t>(whole);
  }
  // Keep 3 of the 23 mantissa bits, rounding the other 20 to nearest even.
  // A mantissa carry ripples into the exponent field, which is what we want.
  const uint32_t mantissa = magnitude_bits & 0x7FFFFFu;
  uint32_t kept = mantissa >> 20;
  const uint32_t dropped = mantissa & 0xFFFFFu;
  constexpr uint32_t kHalf = 0x80000u;
  if (dropped > kHalf || (dropped == kHalf && (kept & 1u))) ++kept;
  const uint32_t code = (static_cast<uint32_t>(exponent + 7) << 3) + kept;
  return sign | static_cast<uint8_t>(code);
}

// Codes 0x7F and 0xFF are NaN in E4M3; EncodeFp8E4m3 never produces them.
AFD_HOST_DEVICE inline float DecodeFp8E4m3(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xFu;
  const uint32_t mantissa = code & 0x7u;
  if (exponent == 0xFu && mantissa == 0x7u) return BitsToFloat(0x7FC00000u);
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 512.0f);
    return sign ? -magnitude : magnitude;
  }
  return BitsToFloat(sign | ((exponent - 7 + 127) << 23) | (mantissa << 20));
}

// One fp32 scale per group: amax / 448, or 1 for an all-zero group (so the
// decoder never divides by zero and zeros stay zeros).
AFD_HOST_DEVICE inline float Fp8GroupScale(float group_amax) {
  return group_amax > 0.0f ? group_amax / kFp8E4m3Max : 1.0f;
}

// Round-to-nearest-even fp32 -> bf16; NaN stays a (quiet) NaN.
AFD_HOST_DEVICE inline uint16_t EncodeBf16(float value) {
  const uint32_t bits = FloatBits(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  const uint32_t rounding_bias = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

AFD_HOST_DEVICE inline float DecodeBf16(uint16_t bf16) {
  return BitsToFloat(static_cast<uint32_t>(bf16) << 16);
}

AFD_HOST_DEVICE inline float RoundToBf16(float value) { return DecodeBf16(EncodeBf16(value)); }

}  // namespace afd
