#include "examples/afd_model/ffn_side.h"

#include <algorithm>

#include "examples/afd_model/kernels/cpu_kernels.h"

namespace afd {

FfnSide::FfnSide(const ModelConfig& config, FfnPartition partition)
    : config_(config), partition_(partition) {
  layers_.reserve(config.num_layers);
  for (int l = 0; l < config.num_layers; ++l) {
    layers_.push_back(GenerateFfnLayerWeights(config, l, partition));
  }
}

void FfnSide::Forward(int layer, const A2FView& in, uint16_t* partial_bf16,
                      FfnWorkspace* workspace) const {
  const int64_t count = in.tokens * config_.hidden_size;
  workspace->activations.resize(count);
  workspace->partial.resize(count);
  cpu::DequantizeFp8PerGroup(in.codes, in.scales, in.tokens, config_.hidden_size, config_.fp8_group,
                             workspace->activations.data());
  ForwardFp32(layer, in.tokens, workspace->activations.data(), in.topk_ids, in.topk_weights,
              workspace->partial.data(), workspace);
  cpu::EncodeBf16Array(workspace->partial.data(), count, partial_bf16);
}

void FfnSide::ForwardFp32(int layer, int64_t tokens, const float* y, const int32_t* topk_ids,
                          const float* topk_weights, float* partial,
                          FfnWorkspace* workspace) const {
  const FfnLayerWeights& w = layers_[layer];
  const int64_t h = config_.hidden_size;
  const int64_t expert_inter = w.is_moe ? config_.expert_intermediate : 0;
  workspace->scratch.resize(std::max(cpu::SwiGluScratchFloats(tokens, w.mlp.inter),
                                     cpu::GroupedExpertScratchFloats(tokens, h, expert_inter)));
  if (w.mlp.inter > 0) {
    cpu::SwiGlu(y, tokens, h, w.mlp.gate.data(), w.mlp.up.data(), w.mlp.down.data(), w.mlp.inter,
                workspace->scratch.data(), partial);
  } else {
    std::fill(partial, partial + tokens * h, 0.0f);
  }
  if (!w.is_moe || w.num_slots == 0) return;
  cpu::GroupedExpertSwiGlu(y, tokens, h, topk_ids, topk_weights, config_.top_k,
                           w.expert_to_slot.data(), config_.num_experts, w.num_slots,
                           w.expert_gate.data(), w.expert_up.data(), w.expert_down.data(),
                           expert_inter, workspace->scratch.data(), partial);
}

}  // namespace afd
