#include "examples/afd_model/attention_model.h"

namespace afd {

AfdWireEmulation::AfdWireEmulation(const ModelConfig& config, int partitions)
    : config_(config), partials_(partitions), partial_ptrs_(partitions) {
  partitions_.reserve(partitions);
  for (int p = 0; p < partitions; ++p)
    partitions_.emplace_back(config, FfnPartition{p, partitions});
}

void AfdWireEmulation::ComputeFfnOutput(int layer, const AttentionModel& attention,
                                        StepState* state) {
  attention.PrepareFfnInput(layer, state);
  const int64_t n = state->num_tokens();
  const A2FSizes sizes{n, config_.hidden_size, config_.top_k, config_.fp8_group};
  codes_.resize(sizes.codes_bytes());
  scales_.resize(sizes.scales_bytes() / sizeof(float));
  topk_ids_.resize(sizes.topk_ids_bytes() / sizeof(int32_t));
  topk_weights_.resize(sizes.topk_weights_bytes() / sizeof(float));
  const A2FBuffers a2f{codes_.data(), scales_.data(), topk_ids_.data(), topk_weights_.data()};
  attention.WriteA2F(*state, a2f);
  for (size_t p = 0; p < partitions_.size(); ++p) {
    partials_[p].resize(n * config_.hidden_size);
    partitions_[p].Forward(layer, AsView(a2f, n), partials_[p].data(), &workspace_);
    partial_ptrs_[p] = partials_[p].data();
  }
  attention.ReduceF2A(partial_ptrs_, state);
}

}  // namespace afd
