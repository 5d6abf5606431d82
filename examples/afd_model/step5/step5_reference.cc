#include "examples/afd_model/step5/step5_reference.h"

namespace afd::step5 {

Step5ReferenceModel::Step5ReferenceModel(const Step5Config& config, const ReferenceOptions& options)
    : config_(config),
      options_(options),
      attention_(config, options.max_sequences, options.max_seq_len) {
  if (options_.codec == Codec::kNone) {
    options_.partitions = 1;
    fp32_ffn_.emplace(config.model, FfnPartition{0, 1});
  } else {
    wire_.emplace(config.model, options_.partitions);
  }
}

void Step5ReferenceModel::ComputeFfnOutput(int layer, Step5StepState* state) {
  if (options_.codec == Codec::kAfd) {
    wire_->ComputeFfnOutput(layer, attention_, state);
    return;
  }
  attention_.PrepareFfnInput(layer, state);
  fp32_ffn_->ForwardFp32(layer, state->num_tokens(), state->normed.data(), state->topk_ids.data(),
                         state->topk_weights.data(), state->ffn_output.data(), &fp32_workspace_);
}

bool Step5ReferenceModel::RunStep(std::span<const SequenceChunk> chunks,
                                  std::span<const int32_t> tokens, Step5StepState* state,
                                  std::vector<float>* layer_hidden) {
  if (!attention_.BeginStep(chunks, tokens, state)) return false;
  for (int l = 0; l < config_.model.num_layers; ++l) {
    attention_.Attention(l, state);
    ComputeFfnOutput(l, state);
    attention_.AddFfnOutput(state);
    if (layer_hidden != nullptr) {
      layer_hidden->insert(layer_hidden->end(), state->hidden.begin(), state->hidden.end());
    }
  }
  return true;
}

}  // namespace afd::step5
