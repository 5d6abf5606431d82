#pragma once

// Wire layouts of one micro-batch of n tokens between the attention side and
// the FFN side (docs/model.md, "Wire"). All tensors are row-major, tightly
// packed, little-endian.
//
// A2F (attention -> every FFN partition), per layer:
//   codes          uint8  [n, H]          FP8 E4M3 of y = RMS(h; post norm)
//   scales         fp32   [n, H / 128]    one per token per 128 channels
//   topk_ids       int32  [n, k]          MoE layers; -1 on dense layers
//   topk_weights   fp32   [n, k]          softmax probs; 0 on dense layers
// F2A (each FFN partition -> attention), per layer:
//   partial        bf16   [n, H]          (uint16 bit patterns)
//
// Dense layers still carry the (ignored) routing tensors so that the
// pre-registered buffers of a micro-batch have one size for every layer.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace afd {

inline constexpr int64_t kFp8GroupSize = 128;

struct A2FSizes {
  int64_t tokens = 0;
  int64_t hidden = 0;
  int64_t top_k = 3;
  int64_t group = kFp8GroupSize;

  size_t codes_bytes() const { return sizeof(uint8_t) * tokens * hidden; }
  size_t scales_bytes() const { return sizeof(float) * tokens * (hidden / group); }
  size_t topk_ids_bytes() const { return sizeof(int32_t) * tokens * top_k; }
  size_t topk_weights_bytes() const { return sizeof(float) * tokens * top_k; }
  size_t total_bytes() const {
    return codes_bytes() + scales_bytes() + topk_ids_bytes() + topk_weights_bytes();
  }
};

inline size_t F2APartialBytes(int64_t tokens, int64_t hidden) {
  return sizeof(uint16_t) * tokens * hidden;
}

// Mutable views of the four A2F tensors (written by the attention side).
struct A2FBuffers {
  uint8_t* codes = nullptr;
  float* scales = nullptr;
  int32_t* topk_ids = nullptr;
  float* topk_weights = nullptr;
};

// Read-only views of the four A2F tensors (read by the FFN side).
struct A2FView {
  int64_t tokens = 0;
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
  const int32_t* topk_ids = nullptr;
  const float* topk_weights = nullptr;
};

inline A2FView AsView(const A2FBuffers& buffers, int64_t tokens) {
  return {tokens, buffers.codes, buffers.scales, buffers.topk_ids, buffers.topk_weights};
}

// Host storage of the four A2F tensors, for the AFD wire emulated in one
// process (the references).
struct A2FStorage {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<int32_t> topk_ids;
  std::vector<float> topk_weights;

  // Sized for `sizes`; views of the four tensors.
  A2FBuffers Resize(const A2FSizes& sizes) {
    codes.resize(sizes.codes_bytes());
    scales.resize(sizes.scales_bytes() / sizeof(float));
    topk_ids.resize(sizes.topk_ids_bytes() / sizeof(int32_t));
    topk_weights.resize(sizes.topk_weights_bytes() / sizeof(float));
    return {codes.data(), scales.data(), topk_ids.data(), topk_weights.data()};
  }
};

}  // namespace afd
