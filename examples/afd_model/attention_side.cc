#include "examples/afd_model/attention_side.h"

#include <algorithm>
#include <cstring>

#include "examples/afd_model/attention_model.h"
#include "examples/afd_model/kernels/cpu_kernels.h"

namespace afd {

AttentionSide::AttentionSide(const ModelConfig& config, int max_sequences,
                             int64_t max_seq_len)
    : config_(config),
      weights_(GenerateAttentionWeights(config)),
      max_sequences_(max_sequences),
      max_seq_len_(max_seq_len),
      sequence_lengths_(max_sequences, 0),
      kv_cache_(static_cast<size_t>(max_sequences) * config.num_layers * 2 *
                max_seq_len * config.head_dim) {}

void AttentionSide::ResetSequence(int sequence) {
  sequence_lengths_[sequence] = 0;
}

int64_t AttentionSide::SequenceLength(int sequence) const {
  return sequence_lengths_[sequence];
}

float* AttentionSide::CacheKeys(int sequence, int layer) {
  const int64_t block = 2 * max_seq_len_ * config_.head_dim;
  return kv_cache_.data() +
         (static_cast<int64_t>(sequence) * config_.num_layers + layer) * block;
}

float* AttentionSide::CacheValues(int sequence, int layer) {
  return CacheKeys(sequence, layer) + max_seq_len_ * config_.head_dim;
}

bool AttentionSide::BeginStep(std::span<const SequenceChunk> chunks,
                              std::span<const int32_t> tokens,
                              StepState* state) {
  if (!AssignStepPositions(chunks, tokens, config_.vocab_size, max_seq_len_,
                           &sequence_lengths_, state)) {
    return false;
  }
  const int64_t total = state->num_tokens();
  const int64_t h = config_.hidden_size;
  const int64_t k = config_.top_k;
  const int64_t width = config_.attention_width();
  state->hidden.resize(total * h);
  state->normed.resize(total * h);
  state->topk_ids.resize(total * k);
  state->topk_weights.resize(total * k);
  state->ffn_output.resize(total * h);
  state->attn_input.resize(total * h);
  state->qkv.resize(total * (config_.q_rank + 2 * config_.head_dim));
  state->q_low_rank.resize(total * config_.q_rank);
  state->keys.resize(total * config_.head_dim);
  state->queries.resize(total * width);
  state->attn_heads.resize(total * width);
  state->router_logits.resize(total * config_.num_experts);
  cpu::EmbeddingLookup(weights_.embedding.data(), tokens.data(), total, h,
                       state->hidden.data());
  return true;
}

void AttentionSide::Attention(int layer, StepState* state) {
  const AttentionLayerWeights& w = weights_.layers[layer];
  const int64_t n = state->num_tokens();
  const int64_t h = config_.hidden_size;
  const int64_t q_rank = config_.q_rank;
  const int64_t d = config_.head_dim;
  const int64_t heads = config_.num_heads;
  const int64_t qkv_width = q_rank + 2 * d;

  cpu::RmsNorm(state->hidden.data(), w.input_norm.data(), n, h,
               config_.rms_norm_eps, state->attn_input.data());
  cpu::Linear(state->attn_input.data(), n, h, w.qkv.data(), qkv_width,
              state->qkv.data());
  // Split the fused projection: the low-rank query goes through inter_norm,
  // the single K head gets RoPE, the single V head goes straight to the cache.
  for (int64_t t = 0; t < n; ++t) {
    const float* row = state->qkv.data() + t * qkv_width;
    std::memcpy(state->q_low_rank.data() + t * q_rank, row,
                sizeof(float) * q_rank);
    std::memcpy(state->keys.data() + t * d, row + q_rank, sizeof(float) * d);
  }
  cpu::RmsNorm(state->q_low_rank.data(), w.inter_norm.data(), n, q_rank,
               config_.rms_norm_eps, state->q_low_rank.data());
  cpu::Linear(state->q_low_rank.data(), n, q_rank, w.wq.data(), heads * d,
              state->queries.data());
  cpu::RopeNeoxInPlace(state->queries.data(), n, heads, d,
                       state->positions.data(), config_.rope_theta);
  cpu::RopeNeoxInPlace(state->keys.data(), n, 1, d, state->positions.data(),
                       config_.rope_theta);

  int64_t row = 0;
  for (const SequenceChunk& chunk : state->chunks) {
    float* cache_k = CacheKeys(chunk.sequence, layer);
    float* cache_v = CacheValues(chunk.sequence, layer);
    for (int32_t i = 0; i < chunk.num_tokens; ++i) {
      const int64_t t = row + i;
      const int64_t pos = state->positions[t];
      std::memcpy(cache_k + pos * d, state->keys.data() + t * d,
                  sizeof(float) * d);
      std::memcpy(cache_v + pos * d,
                  state->qkv.data() + t * qkv_width + q_rank + d,
                  sizeof(float) * d);
    }
    if (chunk.num_tokens > 0) {
      const int64_t kv_len = state->positions[row + chunk.num_tokens - 1] + 1;
      cpu::MqaAttention(state->queries.data() + row * heads * d,
                        chunk.num_tokens, heads, d, cache_k, cache_v, kv_len,
                        state->positions.data() + row,
                        config_.attention_scale(),
                        state->attn_heads.data() + row * heads * d);
    }
    row += chunk.num_tokens;
  }
  // attn_input is free again: reuse it for the output projection.
  cpu::Linear(state->attn_heads.data(), n, heads * d, w.o_proj.data(), h,
              state->attn_input.data());
  cpu::AddInPlace(state->attn_input.data(), n * h, state->hidden.data());
}

void AttentionSide::PrepareFfnInput(int layer, StepState* state) const {
  const AttentionLayerWeights& w = weights_.layers[layer];
  const int64_t n = state->num_tokens();
  const int64_t h = config_.hidden_size;
  cpu::RmsNorm(state->hidden.data(), w.post_norm.data(), n, h,
               config_.rms_norm_eps, state->normed.data());
  if (!config_.is_moe_layer[layer]) {
    std::fill(state->topk_ids.begin(), state->topk_ids.end(), -1);
    std::fill(state->topk_weights.begin(), state->topk_weights.end(), 0.0f);
    return;
  }
  cpu::Linear(state->normed.data(), n, h, w.router.data(), config_.num_experts,
              state->router_logits.data());
  cpu::RouterSoftmaxTopK(state->router_logits.data(), n, config_.num_experts,
                         config_.top_k, state->topk_ids.data(),
                         state->topk_weights.data());
}

void AttentionSide::WriteA2F(const StepState& state,
                             const A2FBuffers& out) const {
  WriteA2FOf(state, config_, out);
}

void AttentionSide::ReduceF2A(std::span<const uint16_t* const> partials,
                              StepState* state) const {
  cpu::SumBf16Partials(partials.data(), static_cast<int>(partials.size()),
                       state->num_tokens() * config_.hidden_size,
                       state->ffn_output.data());
}

void AttentionSide::AddFfnOutput(StepState* state) const {
  cpu::AddInPlace(state->ffn_output.data(),
                  state->num_tokens() * config_.hidden_size,
                  state->hidden.data());
}

void AttentionSide::ApplyF2A(std::span<const uint16_t* const> partials,
                             StepState* state) const {
  ReduceF2A(partials, state);
  AddFfnOutput(state);
}

void AttentionSide::LastTokenLogits(const StepState& state,
                                    std::vector<float>* final_hidden,
                                    std::vector<float>* logits) const {
  LastTokenLogitsOf(state, config_, weights_.final_norm.data(),
                    weights_.lm_head.data(), final_hidden, logits);
}

}  // namespace afd
