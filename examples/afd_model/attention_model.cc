#include "examples/afd_model/attention_model.h"

#include <algorithm>
#include <cstring>

#include "examples/afd_model/kernels/cpu_kernels.h"

namespace afd {

bool AssignStepPositions(std::span<const SequenceChunk> chunks, std::span<const int32_t> tokens,
                         int64_t vocab_size, int64_t max_seq_len, std::vector<int64_t>* lengths,
                         StepState* state) {
  const int64_t sequences = static_cast<int64_t>(lengths->size());
  int64_t total = 0;
  for (const SequenceChunk& chunk : chunks) {
    if (chunk.sequence < 0 || chunk.sequence >= sequences || chunk.num_tokens < 0 ||
        (*lengths)[chunk.sequence] + chunk.num_tokens > max_seq_len) {
      return false;
    }
    total += chunk.num_tokens;
  }
  if (total != static_cast<int64_t>(tokens.size())) return false;
  for (const int32_t token : tokens) {
    if (token < 0 || token >= vocab_size) return false;
  }
  state->chunks.assign(chunks.begin(), chunks.end());
  state->positions.clear();
  for (const SequenceChunk& chunk : chunks) {
    int64_t& length = (*lengths)[chunk.sequence];
    for (int32_t i = 0; i < chunk.num_tokens; ++i) {
      state->positions.push_back(static_cast<int32_t>(length + i));
    }
    length += chunk.num_tokens;
  }
  return true;
}

void LastTokenLogitsOf(const StepState& state, const ModelConfig& config, const float* final_norm,
                       const float* lm_head, std::vector<float>* final_hidden,
                       std::vector<float>* logits) {
  const int64_t h = config.hidden_size;
  const int64_t rows = static_cast<int64_t>(state.chunks.size());
  std::vector<float> last(rows * h);
  std::vector<float> normed(rows * h);
  int64_t end = 0;
  for (int64_t c = 0; c < rows; ++c) {
    end += state.chunks[c].num_tokens;
    // A chunk without tokens has no last token; its row stays zero.
    if (state.chunks[c].num_tokens > 0) {
      std::memcpy(last.data() + c * h, state.hidden.data() + (end - 1) * h, sizeof(float) * h);
    }
  }
  cpu::RmsNorm(last.data(), final_norm, rows, h, config.rms_norm_eps, normed.data());
  if (logits != nullptr) {
    logits->resize(rows * config.vocab_size);
    cpu::Linear(normed.data(), rows, h, lm_head, config.vocab_size, logits->data());
  }
  if (final_hidden != nullptr) *final_hidden = std::move(normed);
}

void WriteA2FOf(const StepState& state, const ModelConfig& config, const A2FBuffers& out) {
  cpu::QuantizeFp8PerGroup(state.normed.data(), state.num_tokens(), config.hidden_size,
                           config.fp8_group, out.codes, out.scales);
  std::copy(state.topk_ids.begin(), state.topk_ids.end(), out.topk_ids);
  std::copy(state.topk_weights.begin(), state.topk_weights.end(), out.topk_weights);
}

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
  const A2FBuffers a2f = a2f_.Resize(sizes);
  attention.WriteA2F(*state, a2f);
  for (size_t p = 0; p < partitions_.size(); ++p) {
    partials_[p].resize(n * config_.hidden_size);
    partitions_[p].Forward(layer, AsView(a2f, n), partials_[p].data(), &workspace_);
    partial_ptrs_[p] = partials_[p].data();
  }
  attention.ReduceF2A(partial_ptrs_, state);
}

}  // namespace afd
