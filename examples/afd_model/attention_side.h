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
#include <vector>

#include "examples/afd_model/config.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/wire.h"

namespace afd {

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

  int64_t num_tokens() const { return static_cast<int64_t>(positions.size()); }
};

class AttentionSide {
 public:
  // Generates the attention-side weights; KV caches hold max_seq_len tokens
  // for each of max_sequences sequences.
  AttentionSide(const ModelConfig& config, int max_sequences, int64_t max_seq_len);

  const ModelConfig& config() const { return config_; }
  int max_sequences() const { return max_sequences_; }
  int64_t max_seq_len() const { return max_seq_len_; }

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
  float* CacheKeys(int sequence, int layer);
  float* CacheValues(int sequence, int layer);

  ModelConfig config_;
  AttentionWeights weights_;
  int max_sequences_;
  int64_t max_seq_len_;
  std::vector<int64_t> sequence_lengths_;
  // [sequence][layer] blocks of max_seq_len * d keys followed by as many
  // values.
  std::vector<float> kv_cache_;
};

}  // namespace afd
