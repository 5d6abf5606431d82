#include "examples/afd_model/step5/step5_weights.h"

#include <string>
#include <utility>

#include "examples/afd_model/model_weights.h"

namespace afd::step5 {
namespace {

// A bias centred on zero: (k >> 3) * 2^-7, i.e. the norm generator minus 1
// (exact), in [-0.125, 0.117].
std::vector<float> CentredBias(const std::string& name, uint64_t seed, int64_t count) {
  std::vector<float> values = GenerateTensor(GammaSpec(name), seed, count);
  for (float& v : values) v -= 1.0f;
  return values;
}

// Appends the whole [rows, fan_in] tensor to `fused`.
void AppendRows(const TensorSpec& spec, uint64_t seed, int64_t rows, std::vector<float>* fused) {
  const size_t offset = fused->size();
  fused->resize(offset + rows * spec.fan_in);
  FillTensor(spec, seed, 0, rows * spec.fan_in, fused->data() + offset);
}

}  // namespace

Step5AttentionWeights GenerateStep5AttentionWeights(const Step5Config& config) {
  const ModelConfig& m = config.model;
  const int64_t h = m.hidden_size;
  const int64_t d = m.head_dim;
  const int64_t p = config.index_dim;
  const uint64_t seed = m.weight_seed;
  Step5AttentionWeights weights;
  GenerateSharedAttentionWeights(m, &weights);
  for (int l = 0; l < m.num_layers; ++l) {
    Step5LayerWeights& layer = weights.layers[l];
    auto name = [l](const char* suffix) { return LayerTensorName(l, suffix); };
    layer.qkvg.reserve(FusedQkvgRows(config) * h);
    AppendRows(LinearSpec(name("self_attn.q_proj.weight"), h), seed, config.q_width(), &layer.qkvg);
    AppendRows(LinearSpec(name("self_attn.k_proj.weight"), h), seed, config.kv_width(),
               &layer.qkvg);
    AppendRows(LinearSpec(name("self_attn.v_proj.weight"), h), seed, config.kv_width(),
               &layer.qkvg);
    AppendRows(LinearSpec(name("self_attn.g_proj.weight"), h), seed, m.num_heads, &layer.qkvg);
    layer.q_norm = GenerateTensor(GammaSpec(name("self_attn.q_norm.weight")), seed, d);
    layer.k_norm = GenerateTensor(GammaSpec(name("self_attn.k_norm.weight")), seed, d);
    layer.o_proj = GenerateTensor(LinearSpec(name("self_attn.o_proj.weight"), config.q_width()),
                                  seed, h * config.q_width());
    layer.post_norm = GenerateTensor(GammaSpec(name("post_attention_layernorm.weight")), seed, h);
    if (config.is_global_layer[l]) {
      layer.index_proj.reserve(FusedIndexRows(config) * h);
      AppendRows(LinearSpec(name("self_attn.indexer.q_proj.weight"), h), seed,
                 config.index_heads * p, &layer.index_proj);
      AppendRows(LinearSpec(name("self_attn.indexer.k_proj.weight"), h), seed, p,
                 &layer.index_proj);
      AppendRows(LinearSpec(name("self_attn.indexer.compress_proj.weight"), h), seed, p,
                 &layer.index_proj);
      AppendRows(LinearSpec(name("self_attn.indexer.weights_proj.weight"), h), seed,
                 config.index_heads, &layer.index_proj);
      layer.index_q_norm =
          GenerateTensor(GammaSpec(name("self_attn.indexer.q_norm.weight")), seed, p);
      layer.index_k_gamma =
          GenerateTensor(GammaSpec(name("self_attn.indexer.k_norm.weight")), seed, p);
      layer.index_k_beta = CentredBias(name("self_attn.indexer.k_norm.bias"), seed, p);
    }
    if (m.is_moe_layer[l]) {
      layer.router = GenerateTensor({name("moe.gate.weight"), WeightKind::kRouter, h}, seed,
                                    int64_t{m.num_experts} * h);
      layer.router_bias = CentredBias(name("moe.e_score_correction_bias"), seed, m.num_experts);
    }
  }
  return weights;
}

}  // namespace afd::step5
