#include "examples/afd_model/attention_side.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "examples/afd_model/attention_model.h"
#include "examples/afd_model/kernels/cpu_kernels.h"

namespace afd {

namespace {

// Every KV-cache format and its flag name (--kv-cache).
constexpr std::pair<KvCacheFormat, const char*> kKvCacheFormats[] = {
    {KvCacheFormat::kFp32, "fp32"}, {KvCacheFormat::kBf16, "bf16"}, {KvCacheFormat::kFp8, "fp8"}};

}  // namespace

const char* KvCacheFormatName(KvCacheFormat format) {
  for (const auto& [f, name] : kKvCacheFormats) {
    if (f == format) return name;
  }
  return "?";
}

bool ParseKvCacheFormat(std::string_view name, KvCacheFormat* format) {
  for (const auto& [f, flag] : kKvCacheFormats) {
    if (name == flag) {
      *format = f;
      return true;
    }
  }
  return false;
}

int64_t KvCacheBytesPerToken(KvCacheFormat format, int64_t head_dim) {
  switch (format) {
    case KvCacheFormat::kFp32:
      return 2 * head_dim * 4;
    case KvCacheFormat::kBf16:
      return 2 * head_dim * 2;
    case KvCacheFormat::kFp8:
      return 2 * (head_dim + 4);  // codes and one fp32 scale each for K and V
  }
  return 0;
}

AttentionSide::AttentionSide(const ModelConfig& config, int max_sequences, int64_t max_seq_len,
                             KvCacheFormat kv_format)
    : config_(config),
      weights_(GenerateAttentionWeights(config)),
      max_sequences_(max_sequences),
      max_seq_len_(max_seq_len),
      kv_format_(kv_format),
      sequence_lengths_(max_sequences, 0) {
  const size_t rows = static_cast<size_t>(max_sequences) * config.num_layers * 2 * max_seq_len;
  const size_t values = rows * config.head_dim;
  switch (kv_format_) {
    case KvCacheFormat::kFp32:
      kv_fp32_.resize(values);
      break;
    case KvCacheFormat::kBf16:
      kv_bf16_.resize(values);
      break;
    case KvCacheFormat::kFp8:
      kv_fp8_.resize(values);
      kv_fp8_scales_.resize(rows);
      break;
  }
}

void AttentionSide::ResetSequence(int sequence) { sequence_lengths_[sequence] = 0; }

int64_t AttentionSide::SequenceLength(int sequence) const { return sequence_lengths_[sequence]; }

int64_t AttentionSide::CacheRow(int sequence, int layer, int kv, int64_t position) const {
  return ((static_cast<int64_t>(sequence) * config_.num_layers + layer) * 2 + kv) * max_seq_len_ +
         position;
}

void AttentionSide::StoreCacheRow(int64_t row, const float* values) {
  const int64_t d = config_.head_dim;
  switch (kv_format_) {
    case KvCacheFormat::kFp32:
      std::memcpy(kv_fp32_.data() + row * d, values, sizeof(float) * d);
      break;
    case KvCacheFormat::kBf16:
      cpu::EncodeBf16Array(values, d, kv_bf16_.data() + row * d);
      break;
    case KvCacheFormat::kFp8:
      // One scale per row: the A2F codec with a single group of d channels.
      cpu::QuantizeFp8PerGroup(values, 1, d, d, kv_fp8_.data() + row * d,
                               kv_fp8_scales_.data() + row);
      break;
  }
}

void AttentionSide::LoadCache(int sequence, int layer, int64_t count, std::vector<float>* out,
                              const float** keys, const float** values) const {
  const int64_t d = config_.head_dim;
  if (kv_format_ == KvCacheFormat::kFp32) {
    *keys = kv_fp32_.data() + CacheRow(sequence, layer, 0, 0) * d;
    *values = kv_fp32_.data() + CacheRow(sequence, layer, 1, 0) * d;
    return;
  }
  out->resize(2 * count * d);
  for (int kv = 0; kv < 2; ++kv) {
    const int64_t row = CacheRow(sequence, layer, kv, 0);
    float* dst = out->data() + kv * count * d;
    if (kv_format_ == KvCacheFormat::kBf16) {
      cpu::DecodeBf16Array(kv_bf16_.data() + row * d, count * d, dst);
    } else {
      cpu::DequantizeFp8PerGroup(kv_fp8_.data() + row * d, kv_fp8_scales_.data() + row, count, d, d,
                                 dst);
    }
  }
  *keys = out->data();
  *values = out->data() + count * d;
}

bool AttentionSide::BeginStep(std::span<const SequenceChunk> chunks,
                              std::span<const int32_t> tokens, StepState* state) {
  if (!AssignStepPositions(chunks, tokens, config_.vocab_size, max_seq_len_, &sequence_lengths_,
                           state)) {
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
  cpu::EmbeddingLookup(weights_.embedding.data(), tokens.data(), total, h, state->hidden.data());
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

  cpu::RmsNorm(state->hidden.data(), w.input_norm.data(), n, h, config_.rms_norm_eps,
               state->attn_input.data());
  cpu::Linear(state->attn_input.data(), n, h, w.qkv.data(), qkv_width, state->qkv.data());
  // Split the fused projection: the low-rank query goes through inter_norm,
  // the single K head gets RoPE, the single V head goes straight to the cache.
  for (int64_t t = 0; t < n; ++t) {
    const float* row = state->qkv.data() + t * qkv_width;
    std::memcpy(state->q_low_rank.data() + t * q_rank, row, sizeof(float) * q_rank);
    std::memcpy(state->keys.data() + t * d, row + q_rank, sizeof(float) * d);
  }
  cpu::RmsNorm(state->q_low_rank.data(), w.inter_norm.data(), n, q_rank, config_.rms_norm_eps,
               state->q_low_rank.data());
  cpu::Linear(state->q_low_rank.data(), n, q_rank, w.wq.data(), heads * d, state->queries.data());
  cpu::RopeNeoxInPlace(state->queries.data(), n, heads, d, state->positions.data(),
                       config_.rope_theta);
  cpu::RopeNeoxInPlace(state->keys.data(), n, 1, d, state->positions.data(), config_.rope_theta);

  int64_t row = 0;
  for (const SequenceChunk& chunk : state->chunks) {
    for (int32_t i = 0; i < chunk.num_tokens; ++i) {
      const int64_t t = row + i;
      const int64_t pos = state->positions[t];
      StoreCacheRow(CacheRow(chunk.sequence, layer, 0, pos), state->keys.data() + t * d);
      StoreCacheRow(CacheRow(chunk.sequence, layer, 1, pos),
                    state->qkv.data() + t * qkv_width + q_rank + d);
    }
    if (chunk.num_tokens > 0) {
      // The whole visible cache, this chunk's rows included, as the cache
      // format stores it.
      const int64_t kv_len = state->positions[row + chunk.num_tokens - 1] + 1;
      const float* cache_k = nullptr;
      const float* cache_v = nullptr;
      LoadCache(chunk.sequence, layer, kv_len, &state->kv_decoded, &cache_k, &cache_v);
      cpu::MqaAttention(state->queries.data() + row * heads * d, chunk.num_tokens, heads, d,
                        cache_k, cache_v, kv_len, state->positions.data() + row,
                        config_.attention_scale(), state->attn_heads.data() + row * heads * d);
    }
    row += chunk.num_tokens;
  }
  // attn_input is free again: reuse it for the output projection.
  cpu::Linear(state->attn_heads.data(), n, heads * d, w.o_proj.data(), h, state->attn_input.data());
  cpu::AddInPlace(state->attn_input.data(), n * h, state->hidden.data());
}

void AttentionSide::PrepareFfnInput(int layer, StepState* state) const {
  const AttentionLayerWeights& w = weights_.layers[layer];
  const int64_t n = state->num_tokens();
  const int64_t h = config_.hidden_size;
  cpu::RmsNorm(state->hidden.data(), w.post_norm.data(), n, h, config_.rms_norm_eps,
               state->normed.data());
  if (!config_.is_moe_layer[layer]) {
    std::fill(state->topk_ids.begin(), state->topk_ids.end(), -1);
    std::fill(state->topk_weights.begin(), state->topk_weights.end(), 0.0f);
    return;
  }
  cpu::Linear(state->normed.data(), n, h, w.router.data(), config_.num_experts,
              state->router_logits.data());
  cpu::RouterSoftmaxTopK(state->router_logits.data(), n, config_.num_experts, config_.top_k,
                         state->topk_ids.data(), state->topk_weights.data());
}

void AttentionSide::WriteA2F(const StepState& state, const A2FBuffers& out) const {
  WriteA2FOf(state, config_, out);
}

void AttentionSide::ReduceF2A(std::span<const uint16_t* const> partials, StepState* state) const {
  cpu::SumBf16Partials(partials.data(), static_cast<int>(partials.size()),
                       state->num_tokens() * config_.hidden_size, state->ffn_output.data());
}

void AttentionSide::AddFfnOutput(StepState* state) const {
  cpu::AddInPlace(state->ffn_output.data(), state->num_tokens() * config_.hidden_size,
                  state->hidden.data());
}

void AttentionSide::ApplyF2A(std::span<const uint16_t* const> partials, StepState* state) const {
  ReduceF2A(partials, state);
  AddFfnOutput(state);
}

void AttentionSide::LastTokenLogits(const StepState& state, std::vector<float>* final_hidden,
                                    std::vector<float>* logits) const {
  LastTokenLogitsOf(state, config_, weights_.final_norm.data(), weights_.lm_head.data(),
                    final_hidden, logits);
}

}  // namespace afd
