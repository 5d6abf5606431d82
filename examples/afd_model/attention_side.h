#pragma once

// The attention instance's half of the model (paper §7.1): embedding, MFA
// attention with its KV cache, post-attention norm, router, FP8 quantisation
// of the FFN input, the reduction of the FFN partials into the residual
// stream, final norm and LM head.
//
// One AttentionSide serves many sequences. A step processes a chunk of new
// tokens for some of them (a prompt during prefill, one token during decode);
// everything a step mutates besides its own sequences' KV caches lives in a
// caller-owned StepState, so the micro-batches of a pipeline (disjoint
// sequence sets, one StepState each) may run concurrently.

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "examples/afd_model/config.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/wire.h"

namespace afd {

// How the KV cache stores K and V rows (Step-3 deploys an FP8 KV cache:
// 512 B per token and layer). Attention always computes in fp32 on rows
// decoded from the cache, the current step's rows included.
enum class KvCacheFormat : uint8_t {
  kFp32,  // exact
  kBf16,  // round to nearest even
  kFp8,   // E4M3 with one fp32 scale per row (token) of K and of V: amax / 448
};
const char* KvCacheFormatName(KvCacheFormat format);
// "fp32", "bf16" or "fp8"; false for anything else.
bool ParseKvCacheFormat(std::string_view name, KvCacheFormat* format);
// Bytes one cached token takes in one layer (K and V, scales included).
int64_t KvCacheBytesPerToken(KvCacheFormat format, int64_t head_dim);

struct SequenceChunk {
  int32_t sequence = 0;    // slot in the AttentionSide, < max_sequences
  int32_t num_tokens = 0;  // new tokens of this sequence in the step
};

// Everything one step of one micro-batch owns. Token rows are the chunks'
// tokens concatenated in chunk order.
struct StepState {
  std::vector<SequenceChunk> chunks;
  std::vector<int32_t> positions;   // [n] absolute positions
  std::vector<float> hidden;        // [n, H] residual stream
  std::vector<float> normed;        // [n, H] y = RMS(h; post norm), FFN input
  std::vector<int32_t> topk_ids;    // [n, k] (-1 on dense layers)
  std::vector<float> topk_weights;  // [n, k] (0 on dense layers)
  std::vector<float> ffn_output;    // [n, H] FFN output before the residual add

  // Attention scratch, kept here so concurrent steps never share it.
  std::vector<float> attn_input;     // [n, H]
  std::vector<float> qkv;            // [n, Q + 2d]
  std::vector<float> q_low_rank;     // [n, Q]
  std::vector<float> keys;           // [n, d]
  std::vector<float> queries;        // [n, heads * d]
  std::vector<float> attn_heads;     // [n, heads * d]
  std::vector<float> router_logits;  // [n, E]
  std::vector<float> kv_decoded;     // [2, kv_len, d]: a sequence's cache as fp32

  int64_t num_tokens() const { return static_cast<int64_t>(positions.size()); }
};

class AttentionSide {
 public:
  // Generates the attention-side weights; KV caches hold max_seq_len tokens
  // for each of max_sequences sequences.
  AttentionSide(const ModelConfig& config, int max_sequences, int64_t max_seq_len,
                KvCacheFormat kv_format = KvCacheFormat::kFp32);

  const ModelConfig& config() const { return config_; }
  int max_sequences() const { return max_sequences_; }
  int64_t max_seq_len() const { return max_seq_len_; }
  KvCacheFormat kv_format() const { return kv_format_; }

  // Forgets the cached tokens of a sequence so its slot can be reused.
  void ResetSequence(int sequence);
  int64_t SequenceLength(int sequence) const;

  // Starts a step: assigns positions after each sequence's cached tokens,
  // reserves their cache rows and embeds `tokens` (chunks concatenated) into
  // state->hidden. Returns false (and changes nothing) if a chunk would
  // overflow its cache or names a bad slot.
  bool BeginStep(std::span<const SequenceChunk> chunks, std::span<const int32_t> tokens,
                 StepState* state);

  // h += o_proj(MFA(RMS(h; input norm))), writing this step's K/V rows into
  // the caches.
  void Attention(int layer, StepState* state);

  // y = RMS(h; post norm) into state->normed and, on MoE layers, router
  // softmax + top-k into state->topk_*; dense layers get ids -1, weights 0.
  void PrepareFfnInput(int layer, StepState* state) const;

  // FP8-quantises state->normed and copies the routing into the A2F buffers
  // (sized by A2FSizes{n, H, k}).
  void WriteA2F(const StepState& state, const A2FBuffers& out) const;

  // The reduction module: state->ffn_output = p_0 + p_1 + ... + p_{F-1}
  // (bf16 partials widened to fp32, added in this order).
  void ReduceF2A(std::span<const uint16_t* const> partials, StepState* state) const;

  // h += state->ffn_output.
  void AddFfnOutput(StepState* state) const;

  // ReduceF2A then AddFfnOutput: what the disaggregated attention instance
  // does with the F2A buffers of a layer.
  void ApplyF2A(std::span<const uint16_t* const> partials, StepState* state) const;

  // Final norm and LM head of the last token of every chunk:
  // final_hidden [chunks, H] (normed), logits [chunks, V]. Either may be
  // null.
  void LastTokenLogits(const StepState& state, std::vector<float>* final_hidden,
                       std::vector<float>* logits) const;

 private:
  // Cache rows: [sequence][layer][K, V][max_seq_len] rows of d values.
  int64_t CacheRow(int sequence, int layer, int kv, int64_t position) const;
  void StoreCacheRow(int64_t row, const float* values);
  // Rows [0, count) of (sequence, layer) as fp32, K then V, into `out`.
  // In fp32 format returns pointers into the cache instead (no copy).
  void LoadCache(int sequence, int layer, int64_t count, std::vector<float>* out,
                 const float** keys, const float** values) const;

  ModelConfig config_;
  AttentionWeights weights_;
  int max_sequences_;
  int64_t max_seq_len_;
  KvCacheFormat kv_format_;
  std::vector<int64_t> sequence_lengths_;
  // One of these holds the cache, by kv_format_ (row-major rows of d).
  std::vector<float> kv_fp32_;
  std::vector<uint16_t> kv_bf16_;
  std::vector<uint8_t> kv_fp8_;
  std::vector<float> kv_fp8_scales_;  // one per row
};

}  // namespace afd
