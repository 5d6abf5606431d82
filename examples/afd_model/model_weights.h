#pragma once

// Materialises the deterministic weights (weights.h) of the parts of the
// model one process owns: the attention side's tensors, or one FFN
// partition's share of every FFN layer.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "examples/afd_model/config.h"
#include "examples/afd_model/weights.h"

namespace afd {

// "model.layers.{layer}.{suffix}", the Hugging Face checkpoint name.
std::string LayerTensorName(int layer, std::string_view suffix);

// Describes one tensor of the generated model.
struct TensorSpec {
  std::string name;
  WeightKind kind = WeightKind::kLinear;
  int64_t fan_in = 1;  // last dimension of a linear weight; unused otherwise
};

// Elements [first, first + count) in HF row-major order.
void FillTensor(const TensorSpec& spec, uint64_t seed, int64_t first, int64_t count, float* out);

// A column block of a row-major matrix stored inside a tensor at element
// offset `base`: rows [0, rows), columns [col_begin, col_end) of a matrix
// with `row_length` columns, written densely as [rows, col_end - col_begin].
void FillTensorColumns(const TensorSpec& spec, uint64_t seed, int64_t base, int64_t rows,
                       int64_t row_length, int64_t col_begin, int64_t col_end, float* out);

// Specs of the two kinds of generated tensor, and a whole tensor's values.
TensorSpec LinearSpec(std::string name, int64_t fan_in);
TensorSpec GammaSpec(std::string name);
std::vector<float> GenerateTensor(const TensorSpec& spec, uint64_t seed, int64_t count);

struct AttentionLayerWeights {
  std::vector<float> input_norm;  // [H]
  std::vector<float> qkv;         // [Q + 2d, H]: q_proj, k_proj, v_proj rows
  std::vector<float> inter_norm;  // [Q]
  std::vector<float> wq;          // [heads * d, Q]
  std::vector<float> o_proj;      // [H, heads * d]
  std::vector<float> post_norm;   // [H]
  std::vector<float> router;      // [E, H]; empty on dense layers
};

struct AttentionWeights {
  std::vector<float> embedding;  // [V, H]
  std::vector<AttentionLayerWeights> layers;
  std::vector<float> final_norm;  // [H]
  std::vector<float> lm_head;     // [V, H]
};

AttentionWeights GenerateAttentionWeights(const ModelConfig& config);

// The tensors around the layers that every model's attention side has (the
// same names, so the same values): the embedding [V, H], the final norm [H]
// and the LM head [V, H].
void GenerateOuterWeights(const ModelConfig& config, std::vector<float>* embedding,
                          std::vector<float>* final_norm, std::vector<float>* lm_head);

// GenerateOuterWeights into `weights`, its layers sized, and each layer's
// input norm [H] (also the same in every model).
template <typename Weights>
void GenerateSharedAttentionWeights(const ModelConfig& config, Weights* weights) {
  GenerateOuterWeights(config, &weights->embedding, &weights->final_norm, &weights->lm_head);
  weights->layers.resize(config.num_layers);
  for (int l = 0; l < config.num_layers; ++l) {
    weights->layers[l].input_norm =
        GenerateTensor(GammaSpec(LayerTensorName(l, "input_layernorm.weight")), config.weight_seed,
                       config.hidden_size);
  }
}

// How the FFN of every layer is spread over F partitions (docs/model.md):
//  - routed expert e lives on partition e % F;
//  - the dense FFN and the shared expert are split by columns of their
//    intermediate width: partition p owns [I*p/F, I*(p+1)/F).
struct FfnPartition {
  int index = 0;
  int count = 1;

  bool OwnsExpert(int expert) const { return expert % count == index; }
  int64_t ColumnBegin(int64_t inter) const { return inter * index / count; }
  int64_t ColumnEnd(int64_t inter) const { return inter * (index + 1) / count; }
};

// A (column slice of a) SwiGLU MLP; inter may be 0 when the slice is empty.
struct SwiGluWeights {
  int64_t inter = 0;
  std::vector<float> gate;  // [inter, H]
  std::vector<float> up;    // [inter, H]
  std::vector<float> down;  // [H, inter]
};

struct FfnLayerWeights {
  bool is_moe = false;
  // Dense layers: this partition's slice of the dense FFN.
  // MoE layers: this partition's slice of the shared expert.
  SwiGluWeights mlp;
  // MoE layers: the routed experts this partition owns, in increasing id.
  std::vector<int32_t> expert_to_slot;  // [E], -1 where not owned
  int64_t num_slots = 0;
  std::vector<float> expert_gate;  // [slots, I_e, H]
  std::vector<float> expert_up;    // [slots, I_e, H]
  std::vector<float> expert_down;  // [slots, H, I_e]
};

FfnLayerWeights GenerateFfnLayerWeights(const ModelConfig& config, int layer,
                                        FfnPartition partition);

// Prompt tokens from the "input_ids" stream: request-major, so request r's
// token t is element r * prompt_len + t.
std::vector<int32_t> GeneratePromptTokens(const ModelConfig& config, int requests, int prompt_len);

}  // namespace afd
