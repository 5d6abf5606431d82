#pragma once

// The attention side's deterministic weights of the Step-5 variant (same
// generator and rules as the Step-3 example, docs/model.md "Weights"; the
// FFN side's tensors come from afd::GenerateFfnLayerWeights on
// Step5Config::model unchanged).
//
// Tensor names (no public checkpoint; these follow the third-party ports'
// module names): model.layers.{l}.self_attn.{q,k,v,g,o}_proj.weight,
// self_attn.{q,k}_norm.weight, self_attn.indexer.{q_proj,k_proj,
// compress_proj,weights_proj}.weight, self_attn.indexer.q_norm.weight,
// self_attn.indexer.k_norm.{weight,bias}, moe.gate.weight,
// moe.e_score_correction_bias.
//
// Zero-centred (Gemma) norms compute x * (1 + w); the generator's norm value
// 1 + (k >> 3) * 2^-7 is stored here as the factor (1 + w) itself, so the
// plain RMSNorm kernel applies it unchanged (w = (k >> 3) * 2^-7 exactly).

#include <cstdint>
#include <vector>

#include "examples/afd_model/step5/step5_config.h"

namespace afd::step5 {

struct Step5LayerWeights {
  std::vector<float> input_norm;  // [H]
  // Fused rows of q_proj [heads*d], k_proj [G*d], v_proj [G*d], g_proj [heads].
  std::vector<float> qkvg;       // [heads*d + 2*G*d + heads, H]
  std::vector<float> q_norm;     // [d], the factor 1 + w
  std::vector<float> k_norm;     // [d], the factor 1 + w
  std::vector<float> o_proj;     // [H, heads*d]
  std::vector<float> post_norm;  // [H]
  // Global layers: fused rows of indexer.q_proj [IH*P], k_proj [P],
  // compress_proj [P] (the per-coordinate logits z), weights_proj [IH].
  std::vector<float> index_proj;     // [IH*P + 2P + IH, H]; empty on sliding layers
  std::vector<float> index_q_norm;   // [P], the factor 1 + w
  std::vector<float> index_k_gamma;  // [P] LayerNorm weight
  std::vector<float> index_k_beta;   // [P] LayerNorm bias
  // MoE layers.
  std::vector<float> router;       // [E, H]
  std::vector<float> router_bias;  // [E] selection bias
};

struct Step5AttentionWeights {
  std::vector<float> embedding;  // [V, H]
  std::vector<Step5LayerWeights> layers;
  std::vector<float> final_norm;  // [H]
  std::vector<float> lm_head;     // [V, H]
};

// Widths of the fused projections.
inline int64_t FusedQkvgRows(const Step5Config& c) {
  return c.q_width() + 2 * c.kv_width() + c.model.num_heads;
}
inline int64_t FusedIndexRows(const Step5Config& c) {
  return c.index_heads * c.index_dim + 2 * c.index_dim + c.index_heads;
}

Step5AttentionWeights GenerateStep5AttentionWeights(const Step5Config& config);

}  // namespace afd::step5
