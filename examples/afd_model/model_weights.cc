#include "examples/afd_model/model_weights.h"

#include <utility>

namespace afd {
namespace {

// Rows [row_begin, row_end) of a [rows, fan_in] tensor.
void FillRows(const TensorSpec& spec, uint64_t seed, int64_t row_begin, int64_t row_end,
              float* out) {
  FillTensor(spec, seed, row_begin * spec.fan_in, (row_end - row_begin) * spec.fan_in, out);
}

// Column slice [c0, c1) of the SwiGLU whose tensors start at element `base`
// of gate/up ([.., inter, H]) and down ([.., H, inter]).
SwiGluWeights GenerateSwiGluSlice(const ModelConfig& config, const std::string& prefix,
                                  int64_t inter, int64_t base_gate_up, int64_t base_down,
                                  int64_t c0, int64_t c1) {
  const int64_t h = config.hidden_size;
  const uint64_t seed = config.weight_seed;
  SwiGluWeights weights;
  weights.inter = c1 - c0;
  weights.gate.resize(weights.inter * h);
  weights.up.resize(weights.inter * h);
  weights.down.resize(h * weights.inter);
  const TensorSpec gate = LinearSpec(prefix + "gate_proj.weight", h);
  const TensorSpec up = LinearSpec(prefix + "up_proj.weight", h);
  const TensorSpec down = LinearSpec(prefix + "down_proj.weight", inter);
  FillTensor(gate, seed, base_gate_up + c0 * h, weights.inter * h, weights.gate.data());
  FillTensor(up, seed, base_gate_up + c0 * h, weights.inter * h, weights.up.data());
  FillTensorColumns(down, seed, base_down, h, inter, c0, c1, weights.down.data());
  return weights;
}

}  // namespace

TensorSpec LinearSpec(std::string name, int64_t fan_in) {
  return {std::move(name), WeightKind::kLinear, fan_in};
}

TensorSpec GammaSpec(std::string name) { return {std::move(name), WeightKind::kNormGamma, 1}; }

std::vector<float> GenerateTensor(const TensorSpec& spec, uint64_t seed, int64_t count) {
  std::vector<float> values(count);
  FillTensor(spec, seed, 0, count, values.data());
  return values;
}

std::string LayerTensorName(int layer, std::string_view suffix) {
  return "model.layers." + std::to_string(layer) + "." + std::string(suffix);
}

void FillTensor(const TensorSpec& spec, uint64_t seed, int64_t first, int64_t count, float* out) {
  const uint64_t key = TensorKey(spec.name, seed);
  const float step = PowerOfTwoInverse(WeightExponent(spec.kind, spec.fan_in));
  for (int64_t i = 0; i < count; ++i) {
    out[i] = WeightValue(spec.kind, key, static_cast<uint64_t>(first + i), step);
  }
}

void FillTensorColumns(const TensorSpec& spec, uint64_t seed, int64_t base, int64_t rows,
                       int64_t row_length, int64_t col_begin, int64_t col_end, float* out) {
  const int64_t width = col_end - col_begin;
  for (int64_t r = 0; r < rows; ++r) {
    FillTensor(spec, seed, base + r * row_length + col_begin, width, out + r * width);
  }
}

void GenerateOuterWeights(const ModelConfig& config, std::vector<float>* embedding,
                          std::vector<float>* final_norm, std::vector<float>* lm_head) {
  const int64_t h = config.hidden_size;
  *embedding = GenerateTensor({"model.embed_tokens.weight", WeightKind::kEmbedding, h},
                              config.weight_seed, config.vocab_size * h);
  *final_norm = GenerateTensor(GammaSpec("model.norm.weight"), config.weight_seed, h);
  *lm_head =
      GenerateTensor(LinearSpec("lm_head.weight", h), config.weight_seed, config.vocab_size * h);
}

AttentionWeights GenerateAttentionWeights(const ModelConfig& config) {
  const int64_t h = config.hidden_size;
  const int64_t q = config.q_rank;
  const int64_t d = config.head_dim;
  const int64_t width = config.attention_width();
  const uint64_t seed = config.weight_seed;
  AttentionWeights weights;
  GenerateSharedAttentionWeights(config, &weights);
  for (int l = 0; l < config.num_layers; ++l) {
    AttentionLayerWeights& layer = weights.layers[l];
    auto name = [l](std::string_view suffix) { return LayerTensorName(l, suffix); };
    layer.qkv.resize((q + 2 * d) * h);
    FillRows(LinearSpec(name("self_attn.q_proj.weight"), h), seed, 0, q, layer.qkv.data());
    FillRows(LinearSpec(name("self_attn.k_proj.weight"), h), seed, 0, d, layer.qkv.data() + q * h);
    FillRows(LinearSpec(name("self_attn.v_proj.weight"), h), seed, 0, d,
             layer.qkv.data() + (q + d) * h);
    layer.inter_norm = GenerateTensor(GammaSpec(name("self_attn.inter_norm.weight")), seed, q);
    layer.wq = GenerateTensor(LinearSpec(name("self_attn.wq.weight"), q), seed, width * q);
    layer.o_proj =
        GenerateTensor(LinearSpec(name("self_attn.o_proj.weight"), width), seed, h * width);
    layer.post_norm = GenerateTensor(GammaSpec(name("post_attention_layernorm.weight")), seed, h);
    if (config.is_moe_layer[l]) {
      layer.router = GenerateTensor({name("moe.gate.weight"), WeightKind::kRouter, h}, seed,
                                    int64_t{config.num_experts} * h);
    }
  }
  return weights;
}

FfnLayerWeights GenerateFfnLayerWeights(const ModelConfig& config, int layer,
                                        FfnPartition partition) {
  const int64_t h = config.hidden_size;
  FfnLayerWeights weights;
  weights.is_moe = config.is_moe_layer[layer];
  if (!weights.is_moe) {
    const int64_t inter = config.dense_intermediate;
    weights.mlp = GenerateSwiGluSlice(config, LayerTensorName(layer, "mlp."), inter, 0, 0,
                                      partition.ColumnBegin(inter), partition.ColumnEnd(inter));
    return weights;
  }
  const int64_t shared = config.shared_intermediate;
  weights.mlp = GenerateSwiGluSlice(config, LayerTensorName(layer, "share_expert."), shared, 0, 0,
                                    partition.ColumnBegin(shared), partition.ColumnEnd(shared));

  weights.expert_to_slot.assign(config.num_experts, -1);
  for (int e = 0; e < config.num_experts; ++e) {
    if (partition.OwnsExpert(e)) {
      weights.expert_to_slot[e] = static_cast<int32_t>(weights.num_slots++);
    }
  }
  const int64_t inter = config.expert_intermediate;
  const int64_t matrix = inter * h;
  weights.expert_gate.resize(weights.num_slots * matrix);
  weights.expert_up.resize(weights.num_slots * matrix);
  weights.expert_down.resize(weights.num_slots * matrix);
  const TensorSpec gate = LinearSpec(LayerTensorName(layer, "moe.gate_proj.weight"), h);
  const TensorSpec up = LinearSpec(LayerTensorName(layer, "moe.up_proj.weight"), h);
  const TensorSpec down = LinearSpec(LayerTensorName(layer, "moe.down_proj.weight"), inter);
  for (int e = 0; e < config.num_experts; ++e) {
    const int32_t slot = weights.expert_to_slot[e];
    if (slot < 0) continue;
    // Experts are stacked [E, ...] in the checkpoint, so expert e's elements
    // start at e * matrix in every one of the three tensors.
    FillTensor(gate, config.weight_seed, e * matrix, matrix,
               weights.expert_gate.data() + slot * matrix);
    FillTensor(up, config.weight_seed, e * matrix, matrix,
               weights.expert_up.data() + slot * matrix);
    FillTensor(down, config.weight_seed, e * matrix, matrix,
               weights.expert_down.data() + slot * matrix);
  }
  return weights;
}

std::vector<int32_t> GeneratePromptTokens(const ModelConfig& config, int requests, int prompt_len) {
  const uint64_t key = TensorKey(kInputIdsTensorName, config.weight_seed);
  std::vector<int32_t> tokens(static_cast<size_t>(requests) * prompt_len);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = InputTokenId(key, i, config.vocab_size);
  }
  return tokens;
}

}  // namespace afd
