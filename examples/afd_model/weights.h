#pragma once

// Deterministic synthetic weights (docs/model.md, "Weights"): a counter-based
// SplitMix64 stream per tensor, so any element can be generated on its own,
// in any order, on the CPU or on a GPU, with identical bits. Every value is a
// small integer times a power of two, exact in fp32 and bf16.
//
// The per-element functions are constexpr/inline integer math usable from
// CUDA device code; the tensor key (a hash of the Hugging Face tensor name)
// is computed on the host and passed to kernels.

#include <cstdint>
#include <string_view>

#include "examples/afd_model/kernels/host_device.h"

namespace afd {

inline constexpr uint64_t kSplitMixGamma = 0x9E3779B97F4A7C15ull;

AFD_HOST_DEVICE constexpr uint64_t SplitMix64(uint64_t z) {
  z += kSplitMixGamma;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr uint64_t Fnv1a64(std::string_view text) {
  uint64_t hash = 0xCBF29CE484222325ull;
  for (const char c : text) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 0x100000001B3ull;
  }
  return hash;
}

// Key of a tensor: fnv1a64(utf8 name) XOR seed.
constexpr uint64_t TensorKey(std::string_view name, uint64_t seed) { return Fnv1a64(name) ^ seed; }

// Raw draw of element `index` (row-major in the HF shape) of a tensor.
AFD_HOST_DEVICE constexpr uint64_t TensorDraw(uint64_t key, uint64_t index) {
  return SplitMix64(key + index * kSplitMixGamma);
}

// The signed byte k in [-128, 127] every weight value is built from.
AFD_HOST_DEVICE constexpr int32_t WeightInt(uint64_t key, uint64_t index) {
  return static_cast<int32_t>((TensorDraw(key, index) >> 56) & 0xFF) - 128;
}

// s = round(log2(sqrt(fan_in))), ties up; equal to (floor(log2 fan_in)+1)/2
// in integers, so no floating point is involved.
AFD_HOST_DEVICE constexpr int LinearShift(int64_t fan_in) {
  int floor_log2 = -1;
  for (uint64_t v = static_cast<uint64_t>(fan_in); v != 0; v >>= 1) ++floor_log2;
  return (floor_log2 + 1) / 2;
}

enum class WeightKind : uint8_t {
  kLinear,     // k * 2^-(7+s), s = LinearShift(fan_in): std ~ 0.58/sqrt(fan_in)
  kRouter,     // k * 2^-(7+s-2): 4x a linear, so routing is decisive
  kEmbedding,  // k * 2^-7
  kNormGamma,  // 1 + (k >> 3) * 2^-7, in [0.875, 1.117]
};

// Exponent e with value = integer * 2^-e for a weight tensor of this kind.
AFD_HOST_DEVICE constexpr int WeightExponent(WeightKind kind, int64_t fan_in) {
  switch (kind) {
    case WeightKind::kLinear:
      return 7 + LinearShift(fan_in);
    case WeightKind::kRouter:
      return 7 + LinearShift(fan_in) - 2;
    case WeightKind::kEmbedding:
    case WeightKind::kNormGamma:
      return 7;
  }
  return 7;
}

// 2^-exponent for 0 <= exponent < 64, exact.
AFD_HOST_DEVICE constexpr float PowerOfTwoInverse(int exponent) {
  float value = 1.0f;
  for (int i = 0; i < exponent; ++i) value *= 0.5f;
  return value;
}

// Value of element `index` of a tensor. `step` is
// PowerOfTwoInverse(WeightExponent(kind, fan_in)), hoisted out of loops.
AFD_HOST_DEVICE constexpr float WeightValue(WeightKind kind, uint64_t key, uint64_t index,
                                            float step) {
  const int32_t k = WeightInt(key, index);
  if (kind == WeightKind::kNormGamma) {
    // Arithmetic shift of a negative value rounds toward -inf, as specified.
    return 1.0f + static_cast<float>(k >> 3) * step;
  }
  return static_cast<float>(k) * step;
}

// Prompt token `index` (request-major: request * prompt_len + position).
AFD_HOST_DEVICE constexpr int32_t InputTokenId(uint64_t input_key, uint64_t index,
                                               int64_t vocab_size) {
  return static_cast<int32_t>(TensorDraw(input_key, index) % static_cast<uint64_t>(vocab_size));
}

inline constexpr std::string_view kInputIdsTensorName = "input_ids";

}  // namespace afd
