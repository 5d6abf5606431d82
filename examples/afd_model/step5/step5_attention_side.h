#pragma once

// The attention instance's half of the Step-5 variant: embedding, the
// attention layers (sliding-window GQA, or global sparse GQA behind the block
// indexer) with their caches, post-attention norm, the sigmoid router, FP8
// quantisation of the FFN input, the reduction of the FFN partials, final
// norm and LM head. The FFN half is afd::FfnSide on Step5Config::model: the
// wire contract (A2F FP8 + routing, F2A BF16 partials) is the Step-3
// example's, unchanged.
//
// Caches per sequence (docs/model.md, "Step-5-Preview", memory):
//  - global layer: the original K and V of every position [len, G, d]; the
//    FP8 summary of every complete block [len/B, P]; the proxy keys and
//    compression logits of the current incomplete block ("pending", B rows,
//    summarised when its last token arrives and never before);
//  - sliding layer: a ring of the last `window` positions' K and V.
// Every token is processed in position order (write its cache rows, summarise
// a block it completes, score, select, attend), so a prompt prefilled in one
// step and the same tokens streamed one per step give identical bits.

#include <cstdint>
#include <span>
#include <vector>

#include "examples/afd_model/attention_model.h"
#include "examples/afd_model/attention_side.h"
#include "examples/afd_model/step5/step5_config.h"
#include "examples/afd_model/step5/step5_weights.h"
#include "examples/afd_model/wire.h"

namespace afd::step5 {

// A step's state (the common fields of afd::StepState: chunks, positions,
// hidden, normed, topk_*, ffn_output, attn_input, attn_heads, queries,
// router_logits) plus the Step-5 scratch and selection statistics.
struct Step5StepState : StepState {
  std::vector<float> projections;       // [n, heads*d + 2*G*d + heads]
  std::vector<float> values;            // [n, G*d]  (StepState::keys holds K)
  std::vector<float> gates;             // [n, heads]
  std::vector<float> index_proj;        // [n, IH*P + 2P + IH]
  std::vector<float> index_q;           // [n, IH*P]
  std::vector<uint8_t> index_q_codes;   // [n, IH*P]
  std::vector<float> index_k;           // [n, P]
  std::vector<float> index_z;           // [n, P]
  std::vector<float> index_w;           // [n, IH]
  std::vector<float> scores;            // [G, max blocks]
  std::vector<int32_t> order;           // [max blocks]
  std::vector<int32_t> selected;        // [G, K]
  std::vector<int64_t> selected_count;  // [G]
  std::vector<float> kernel_scratch;

  // Added up over every (token, KV group) of every global layer a step ran,
  // until the caller resets them: history blocks that existed (floor(t/B))
  // and history blocks attended (the top-k; the current block not counted).
  int64_t history_blocks = 0;
  int64_t attended_blocks = 0;

  // When set, every (token, group) of every global layer appends its
  // selected history blocks to selection_log: topk_blocks ids, ascending,
  // padded with -1 (tokens in step row order, groups in order). For checks.
  bool record_selection = false;
  std::vector<int32_t> selection_log;
};

// KV bytes of one sequence of `tokens` tokens (element_bytes per K/V value:
// 4 for this CPU example's fp32 cache, 2 for the real model's BF16 cache).
struct KvFootprint {
  int64_t original = 0;   // global K/V (all positions) + sliding rings (min(T, W))
  int64_t summaries = 0;  // FP8 block summaries, floor(T/B) * P per global layer
  int64_t proxy = 0;      // pending proxy keys + logits (fp32) of the incomplete block
  int64_t total() const { return original + summaries + proxy; }
};
KvFootprint KvBytes(const Step5Config& config, int64_t tokens, int64_t element_bytes);

// An AttentionModel: every StepState* it takes must be a Step5StepState
// (NewStepState() makes one; tests may pass their own).
class Step5AttentionSide : public AttentionModel {
 public:
  Step5AttentionSide(const Step5Config& config, int max_sequences, int64_t max_seq_len);

  const Step5Config& config() const { return config_; }
  int max_sequences() const { return max_sequences_; }
  int64_t max_seq_len() const { return max_seq_len_; }

  StepStatePtr NewStepState() const override;
  void ResetSequence(int sequence) override;
  int64_t SequenceLength(int sequence) const override;

  // As afd::AttentionSide::BeginStep: positions after each sequence's cached
  // tokens, embedding into state->hidden; false (nothing changed) on a bad
  // slot, a cache overflow or a bad token id.
  bool BeginStep(std::span<const SequenceChunk> chunks, std::span<const int32_t> tokens,
                 StepState* state) override;

  // h += o_proj(gate * attention(RMS(h; input norm))), filling this step's
  // cache rows; sliding or global sparse by the layer's type.
  void Attention(int layer, StepState* state) override;

  // y = RMS(h; post norm); MoE layers: sigmoid router + bias, top-k,
  // normalised and scaled weights; dense layers: ids -1, weights 0.
  void PrepareFfnInput(int layer, StepState* state) const override;

  // The rest is the Step-3 example's contract, see afd::AttentionSide.
  void WriteA2F(const StepState& state, const A2FBuffers& out) const override;
  void ReduceF2A(std::span<const uint16_t* const> partials, StepState* state) const override;
  void AddFfnOutput(StepState* state) const override;
  void LastTokenLogits(const StepState& state, std::vector<float>* final_hidden,
                       std::vector<float>* logits) const override;

  // Step5StepState::history_blocks / attended_blocks, then zeroes them.
  SelectionStats TakeSelectionStats(StepState* state) const override;

 private:
  void GlobalToken(int layer, int sequence, int64_t row, Step5StepState* state);
  void SlidingToken(int layer, int sequence, int64_t row, Step5StepState* state);
  void IndexerProjections(int layer, Step5StepState* state) const;

  // Cache regions of (sequence, layer).
  float* GlobalKeys(int sequence, int layer);
  float* GlobalValues(int sequence, int layer);
  uint8_t* Summaries(int sequence, int layer);
  float* PendingKeys(int sequence, int layer);    // [B, P]
  float* PendingLogits(int sequence, int layer);  // [B, P]
  float* RingKeys(int sequence, int layer);
  float* RingValues(int sequence, int layer);

  Step5Config config_;
  Step5AttentionWeights weights_;
  int max_sequences_;
  int64_t max_seq_len_;
  int64_t max_blocks_;
  std::vector<int> type_index_;  // layer -> index among global or sliding layers
  std::vector<int64_t> sequence_lengths_;
  std::vector<float> global_kv_;    // [seq][global layer][K | V][max_len, G, d]
  std::vector<uint8_t> summaries_;  // [seq][global layer][max_blocks, P]
  std::vector<float> pending_;      // [seq][global layer][keys | logits][B, P]
  std::vector<float> rings_;        // [seq][sliding layer][K | V][window, G, d]
};

}  // namespace afd::step5
