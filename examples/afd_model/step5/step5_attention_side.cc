#include "examples/afd_model/step5/step5_attention_side.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "examples/afd_model/kernels/cpu_kernels.h"
#include "examples/afd_model/step5/step5_kernels.h"

namespace afd::step5 {

KvFootprint KvBytes(const Step5Config& config, int64_t tokens, int64_t element_bytes) {
  const int64_t row = 2 * config.kv_width() * element_bytes;  // K and V of one position
  const int64_t global = config.num_global_layers();
  const int64_t sliding = config.num_sliding_layers();
  KvFootprint f;
  f.original = global * tokens * row + sliding * std::min(tokens, config.sliding_window) * row;
  f.summaries = global * (tokens / config.block_size) * config.index_dim;
  f.proxy = global * (tokens % config.block_size) * 2 * config.index_dim *
            static_cast<int64_t>(sizeof(float));
  return f;
}

Step5AttentionSide::Step5AttentionSide(const Step5Config& config, int max_sequences,
                                       int64_t max_seq_len)
    : config_(config),
      weights_(GenerateStep5AttentionWeights(config)),
      max_sequences_(max_sequences),
      max_seq_len_(max_seq_len),
      max_blocks_((max_seq_len + config.block_size - 1) / config.block_size),
      sequence_lengths_(max_sequences, 0) {
  int global = 0;
  int sliding = 0;
  for (int l = 0; l < config.model.num_layers; ++l) {
    type_index_.push_back(config.is_global_layer[l] ? global++ : sliding++);
  }
  const size_t seqs = static_cast<size_t>(max_sequences);
  const int64_t kv = config.kv_width();
  global_kv_.resize(seqs * global * 2 * max_seq_len * kv);
  summaries_.resize(seqs * global * max_blocks_ * config.index_dim);
  pending_.resize(seqs * global * 2 * config.block_size * config.index_dim);
  rings_.resize(seqs * sliding * 2 * config.sliding_window * kv);
}

void Step5AttentionSide::ResetSequence(int sequence) { sequence_lengths_[sequence] = 0; }

int64_t Step5AttentionSide::SequenceLength(int sequence) const {
  return sequence_lengths_[sequence];
}

float* Step5AttentionSide::GlobalKeys(int sequence, int layer) {
  const int64_t region = 2 * max_seq_len_ * config_.kv_width();
  const int64_t globals = config_.num_global_layers();
  return global_kv_.data() + (sequence * globals + type_index_[layer]) * region;
}

float* Step5AttentionSide::GlobalValues(int sequence, int layer) {
  return GlobalKeys(sequence, layer) + max_seq_len_ * config_.kv_width();
}

uint8_t* Step5AttentionSide::Summaries(int sequence, int layer) {
  const int64_t globals = config_.num_global_layers();
  return summaries_.data() +
         (sequence * globals + type_index_[layer]) * max_blocks_ * config_.index_dim;
}

float* Step5AttentionSide::PendingKeys(int sequence, int layer) {
  const int64_t region = 2 * config_.block_size * config_.index_dim;
  const int64_t globals = config_.num_global_layers();
  return pending_.data() + (sequence * globals + type_index_[layer]) * region;
}

float* Step5AttentionSide::PendingLogits(int sequence, int layer) {
  return PendingKeys(sequence, layer) + config_.block_size * config_.index_dim;
}

float* Step5AttentionSide::RingKeys(int sequence, int layer) {
  const int64_t region = 2 * config_.sliding_window * config_.kv_width();
  const int64_t slidings = config_.num_sliding_layers();
  return rings_.data() + (sequence * slidings + type_index_[layer]) * region;
}

float* Step5AttentionSide::RingValues(int sequence, int layer) {
  return RingKeys(sequence, layer) + config_.sliding_window * config_.kv_width();
}

StepStatePtr Step5AttentionSide::NewStepState() const {
  return StepStatePtr(new Step5StepState,
                      [](StepState* s) { delete static_cast<Step5StepState*>(s); });
}

SelectionStats Step5AttentionSide::TakeSelectionStats(StepState* base) const {
  auto* state = static_cast<Step5StepState*>(base);
  const SelectionStats stats{state->history_blocks, state->attended_blocks};
  state->history_blocks = state->attended_blocks = 0;
  return stats;
}

bool Step5AttentionSide::BeginStep(std::span<const SequenceChunk> chunks,
                                   std::span<const int32_t> tokens, StepState* base) {
  auto* state = static_cast<Step5StepState*>(base);
  const ModelConfig& m = config_.model;
  if (!AssignStepPositions(chunks, tokens, m.vocab_size, max_seq_len_, &sequence_lengths_, state)) {
    return false;
  }
  const int64_t total = state->num_tokens();
  const int64_t h = m.hidden_size;
  const int64_t groups = config_.num_kv_groups;
  const int64_t index_width = config_.index_heads * config_.index_dim;
  state->hidden.resize(total * h);
  state->normed.resize(total * h);
  state->topk_ids.resize(total * m.top_k);
  state->topk_weights.resize(total * m.top_k);
  state->ffn_output.resize(total * h);
  state->attn_input.resize(total * h);
  state->projections.resize(total * FusedQkvgRows(config_));
  state->queries.resize(total * config_.q_width());
  state->keys.resize(total * config_.kv_width());
  state->values.resize(total * config_.kv_width());
  state->gates.resize(total * m.num_heads);
  state->attn_heads.resize(total * config_.q_width());
  state->router_logits.resize(total * m.num_experts);
  if (config_.num_global_layers() > 0) {
    state->index_proj.resize(total * FusedIndexRows(config_));
    state->index_q.resize(total * index_width);
    state->index_q_codes.resize(total * index_width);
    state->index_k.resize(total * config_.index_dim);
    state->index_z.resize(total * config_.index_dim);
    state->index_w.resize(total * config_.index_heads);
    state->scores.resize(groups * max_blocks_);
    state->order.resize(max_blocks_);
    state->selected.resize(groups * config_.topk_blocks);
    state->selected_count.resize(groups);
  }
  state->kernel_scratch.resize(
      std::max({(config_.topk_blocks + 1) * config_.block_size, config_.sliding_window,
                (config_.index_heads + 1) * config_.index_dim}));
  afd::cpu::EmbeddingLookup(weights_.embedding.data(), tokens.data(), total, h,
                            state->hidden.data());
  return true;
}

void Step5AttentionSide::IndexerProjections(int layer, Step5StepState* state) const {
  const Step5LayerWeights& w = weights_.layers[layer];
  const int64_t n = state->num_tokens();
  const int64_t p = config_.index_dim;
  const int64_t heads = config_.index_heads;
  const int64_t width = FusedIndexRows(config_);
  afd::cpu::Linear(state->attn_input.data(), n, config_.model.hidden_size, w.index_proj.data(),
                   width, state->index_proj.data());
  for (int64_t t = 0; t < n; ++t) {
    const float* row = state->index_proj.data() + t * width;
    std::memcpy(state->index_q.data() + t * heads * p, row, sizeof(float) * heads * p);
    std::memcpy(state->index_k.data() + t * p, row + heads * p, sizeof(float) * p);
    std::memcpy(state->index_z.data() + t * p, row + heads * p + p, sizeof(float) * p);
    // w = (W_w x) * heads_per_group^-1/2.
    const float scale =
        static_cast<float>(1.0 / std::sqrt(static_cast<double>(config_.index_heads_per_group())));
    for (int64_t i = 0; i < heads; ++i) {
      state->index_w[t * heads + i] = row[heads * p + 2 * p + i] * scale;
    }
  }
  // Queries: zero-centred RMSNorm per indexer head; the shared proxy key:
  // LayerNorm; both then rotated over the first index_rotary_dim coordinates
  // with the global layers' theta. The logits z get neither.
  afd::cpu::RmsNorm(state->index_q.data(), w.index_q_norm.data(), n * heads, p,
                    config_.index_norm_eps, state->index_q.data());
  step5::cpu::LayerNorm(state->index_k.data(), w.index_k_gamma.data(), w.index_k_beta.data(), n, p,
                        config_.index_norm_eps, state->index_k.data());
  afd::cpu::RopePartialNeoxInPlace(state->index_q.data(), n, heads, p, config_.index_rotary_dim,
                                   state->positions.data(), config_.full_rope_theta);
  afd::cpu::RopePartialNeoxInPlace(state->index_k.data(), n, 1, p, config_.index_rotary_dim,
                                   state->positions.data(), config_.full_rope_theta);
  step5::cpu::CastFp8E4m3(state->index_q.data(), n * heads * p, state->index_q_codes.data());
}

void Step5AttentionSide::GlobalToken(int layer, int sequence, int64_t row, Step5StepState* state) {
  const ModelConfig& m = config_.model;
  const int64_t d = m.head_dim;
  const int64_t kv = config_.kv_width();
  const int64_t p = config_.index_dim;
  const int64_t b = config_.block_size;
  const int64_t groups = config_.num_kv_groups;
  const int64_t pos = state->positions[row];
  float* keys = GlobalKeys(sequence, layer);
  float* values = GlobalValues(sequence, layer);
  std::memcpy(keys + pos * kv, state->keys.data() + row * kv, sizeof(float) * kv);
  std::memcpy(values + pos * kv, state->values.data() + row * kv, sizeof(float) * kv);

  // The proxy key and logits wait in the pending buffer until the block is
  // complete; only then does it get a summary.
  uint8_t* summaries = Summaries(sequence, layer);
  float* pending_keys = PendingKeys(sequence, layer);
  float* pending_logits = PendingLogits(sequence, layer);
  std::memcpy(pending_keys + (pos % b) * p, state->index_k.data() + row * p, sizeof(float) * p);
  std::memcpy(pending_logits + (pos % b) * p, state->index_z.data() + row * p, sizeof(float) * p);
  if (pos % b == b - 1) {
    step5::cpu::BlockSummary(pending_keys, pending_logits, b, p, summaries + (pos / b) * p);
  }

  // Only blocks r < floor(pos / B) compete; the current one is always added.
  const int64_t history = pos / b;
  const int64_t k = config_.topk_blocks;
  if (history > 0) {
    step5::cpu::IndexerScores(state->index_q_codes.data() + row * config_.index_heads * p,
                              state->index_w.data() + row * config_.index_heads, groups,
                              config_.index_heads_per_group(), p, summaries, history,
                              state->kernel_scratch.data(), state->scores.data());
    for (int64_t g = 0; g < groups; ++g) {
      state->selected_count[g] =
          step5::cpu::SelectTopKBlocks(state->scores.data() + g * history, history, k,
                                       state->order.data(), state->selected.data() + g * k);
      state->attended_blocks += state->selected_count[g];
    }
    state->history_blocks += history * groups;
  } else {
    std::fill(state->selected_count.begin(), state->selected_count.end(), 0);
  }
  if (state->record_selection) {
    for (int64_t g = 0; g < groups; ++g) {
      const int32_t* ids = state->selected.data() + g * k;
      for (int64_t i = 0; i < k; ++i) {
        state->selection_log.push_back(i < state->selected_count[g] ? ids[i] : -1);
      }
    }
  }
  step5::cpu::SparseBlockAttention(
      state->queries.data() + row * config_.q_width(), m.num_heads, groups, d, keys, values, pos, b,
      state->selected.data(), state->selected_count.data(), k, m.attention_scale(),
      state->kernel_scratch.data(), state->attn_heads.data() + row * config_.q_width());
}

void Step5AttentionSide::SlidingToken(int layer, int sequence, int64_t row, Step5StepState* state) {
  const ModelConfig& m = config_.model;
  const int64_t kv = config_.kv_width();
  const int64_t window = config_.sliding_window;
  const int64_t pos = state->positions[row];
  float* ring_keys = RingKeys(sequence, layer);
  float* ring_values = RingValues(sequence, layer);
  // Written before the query attends: the window counts the current token,
  // and the slot it overwrites (pos - window) just left the window.
  std::memcpy(ring_keys + (pos % window) * kv, state->keys.data() + row * kv, sizeof(float) * kv);
  std::memcpy(ring_values + (pos % window) * kv, state->values.data() + row * kv,
              sizeof(float) * kv);
  step5::cpu::SlidingWindowAttention(
      state->queries.data() + row * config_.q_width(), m.num_heads, config_.num_kv_groups,
      m.head_dim, ring_keys, ring_values, window, pos, window, m.attention_scale(),
      state->kernel_scratch.data(), state->attn_heads.data() + row * config_.q_width());
}

void Step5AttentionSide::Attention(int layer, StepState* base) {
  auto* state = static_cast<Step5StepState*>(base);
  const Step5LayerWeights& w = weights_.layers[layer];
  const ModelConfig& m = config_.model;
  const int64_t n = state->num_tokens();
  const int64_t h = m.hidden_size;
  const int64_t d = m.head_dim;
  const int64_t heads = m.num_heads;
  const int64_t groups = config_.num_kv_groups;
  const int64_t qw = config_.q_width();
  const int64_t kv = config_.kv_width();
  const int64_t width = FusedQkvgRows(config_);
  const bool global = config_.is_global_layer[layer];

  afd::cpu::RmsNorm(state->hidden.data(), w.input_norm.data(), n, h, m.rms_norm_eps,
                    state->attn_input.data());
  afd::cpu::Linear(state->attn_input.data(), n, h, w.qkvg.data(), width, state->projections.data());
  for (int64_t t = 0; t < n; ++t) {
    const float* row = state->projections.data() + t * width;
    std::memcpy(state->queries.data() + t * qw, row, sizeof(float) * qw);
    std::memcpy(state->keys.data() + t * kv, row + qw, sizeof(float) * kv);
    std::memcpy(state->values.data() + t * kv, row + qw + kv, sizeof(float) * kv);
    std::memcpy(state->gates.data() + t * heads, row + qw + 2 * kv, sizeof(float) * heads);
  }
  // Per-head q/k norms (zero-centred: the stored factor is 1 + w), then
  // partial RoPE: 1/3 of the head on global layers, all of it on sliding ones.
  afd::cpu::RmsNorm(state->queries.data(), w.q_norm.data(), n * heads, d, m.rms_norm_eps,
                    state->queries.data());
  afd::cpu::RmsNorm(state->keys.data(), w.k_norm.data(), n * groups, d, m.rms_norm_eps,
                    state->keys.data());
  const int64_t rotary = global ? config_.full_rotary_dim : config_.sliding_rotary_dim;
  const float theta = global ? config_.full_rope_theta : config_.sliding_rope_theta;
  afd::cpu::RopePartialNeoxInPlace(state->queries.data(), n, heads, d, rotary,
                                   state->positions.data(), theta);
  afd::cpu::RopePartialNeoxInPlace(state->keys.data(), n, groups, d, rotary,
                                   state->positions.data(), theta);
  if (global) IndexerProjections(layer, state);

  int64_t row = 0;
  for (const SequenceChunk& chunk : state->chunks) {
    for (int32_t i = 0; i < chunk.num_tokens; ++i, ++row) {
      if (global) {
        GlobalToken(layer, chunk.sequence, row, state);
      } else {
        SlidingToken(layer, chunk.sequence, row, state);
      }
    }
  }
  step5::cpu::HeadSigmoidGate(state->gates.data(), n, heads, d, state->attn_heads.data());
  // attn_input is free again: reuse it for the output projection.
  afd::cpu::Linear(state->attn_heads.data(), n, qw, w.o_proj.data(), h, state->attn_input.data());
  afd::cpu::AddInPlace(state->attn_input.data(), n * h, state->hidden.data());
}

void Step5AttentionSide::PrepareFfnInput(int layer, StepState* state) const {
  const Step5LayerWeights& w = weights_.layers[layer];
  const ModelConfig& m = config_.model;
  const int64_t n = state->num_tokens();
  afd::cpu::RmsNorm(state->hidden.data(), w.post_norm.data(), n, m.hidden_size, m.rms_norm_eps,
                    state->normed.data());
  if (!m.is_moe_layer[layer]) {
    std::fill(state->topk_ids.begin(), state->topk_ids.end(), -1);
    std::fill(state->topk_weights.begin(), state->topk_weights.end(), 0.0f);
    return;
  }
  afd::cpu::Linear(state->normed.data(), n, m.hidden_size, w.router.data(), m.num_experts,
                   state->router_logits.data());
  step5::cpu::RouterSigmoidTopK(state->router_logits.data(), w.router_bias.data(), n, m.num_experts,
                                m.top_k, config_.norm_expert_weight, config_.router_scaling_factor,
                                state->topk_ids.data(), state->topk_weights.data());
}

void Step5AttentionSide::WriteA2F(const StepState& state, const A2FBuffers& out) const {
  WriteA2FOf(state, config_.model, out);
}

void Step5AttentionSide::ReduceF2A(std::span<const uint16_t* const> partials,
                                   StepState* state) const {
  afd::cpu::SumBf16Partials(partials.data(), static_cast<int>(partials.size()),
                            state->num_tokens() * config_.model.hidden_size,
                            state->ffn_output.data());
}

void Step5AttentionSide::AddFfnOutput(StepState* state) const {
  afd::cpu::AddInPlace(state->ffn_output.data(), state->num_tokens() * config_.model.hidden_size,
                       state->hidden.data());
}

void Step5AttentionSide::LastTokenLogits(const StepState& state, std::vector<float>* final_hidden,
                                         std::vector<float>* logits) const {
  LastTokenLogitsOf(state, config_.model, weights_.final_norm.data(), weights_.lm_head.data(),
                    final_hidden, logits);
}

}  // namespace afd::step5
