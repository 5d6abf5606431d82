#include "examples/afd_model/step5/step5_reference.h"

#include <chrono>

#include "examples/afd_model/kernels/cpu_kernels.h"

namespace afd::step5 {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

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

GenerationResult Step5ReferenceModel::Generate(const std::vector<std::vector<int32_t>>& prompts,
                                               int decode_steps, Step5StepState* state_out) {
  const int batch = static_cast<int>(prompts.size());
  GenerationResult result;
  result.tokens.resize(batch);
  Step5StepState local;
  Step5StepState& state = state_out != nullptr ? *state_out : local;
  std::vector<SequenceChunk> chunks;
  std::vector<int32_t> inputs;
  for (int s = 0; s < batch; ++s) {
    attention_.ResetSequence(s);
    chunks.push_back({s, static_cast<int32_t>(prompts[s].size())});
    inputs.insert(inputs.end(), prompts[s].begin(), prompts[s].end());
  }
  std::vector<int32_t> next(batch);
  auto finish_step = [&] {
    std::vector<float> hidden;
    std::vector<float> logits;
    attention_.LastTokenLogits(state, &hidden, &logits);
    afd::cpu::ArgmaxRows(logits.data(), batch, config_.model.vocab_size, next.data());
    for (int s = 0; s < batch; ++s) result.tokens[s].push_back(next[s]);
    result.step_final_hidden.push_back(std::move(hidden));
    result.step_logits.push_back(std::move(logits));
  };

  auto start = std::chrono::steady_clock::now();
  if (!RunStep(chunks, inputs, &state)) return result;
  finish_step();
  result.prefill_seconds = SecondsSince(start);

  start = std::chrono::steady_clock::now();
  for (int step = 0; step < decode_steps; ++step) {
    inputs.resize(batch);
    for (int s = 0; s < batch; ++s) {
      chunks[s].num_tokens = 1;
      inputs[s] = next[s];
    }
    if (!RunStep(chunks, inputs, &state)) break;
    finish_step();
  }
  result.decode_seconds = SecondsSince(start);
  return result;
}

}  // namespace afd::step5
