#pragma once

// Monolithic reference forward built from the same AttentionSide and FfnSide
// units the disaggregated run uses, so the two can agree bit for bit.
//
// Codecs:
//  - kNone: fp32 throughout; the FFN is one partition fed the fp32 y.
//  - kAfd:  the AFD wire emulated in process: y is FP8-quantised into A2F
//           buffers, F FfnSide partitions each return a BF16 partial, and the
//           partials are added in fp32 in partition order 0..F-1 before the
//           residual add (AttentionSide::ApplyF2A).

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "examples/afd_model/attention_side.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/ffn_side.h"

namespace afd {

enum class Codec { kNone, kAfd };

std::string CodecName(Codec codec);

struct ReferenceOptions {
  Codec codec = Codec::kNone;
  int partitions = 1;  // FFN partitions F (kAfd only)
  int max_sequences = 1;
  int64_t max_seq_len = 128;
  KvCacheFormat kv_format = KvCacheFormat::kFp32;
  // kAfd: F of each step Generate runs (prefill first), replacing
  // `partitions` there: an expert layout schedule (afd_launch --resize);
  // empty: `partitions` throughout.
  std::vector<int> partitions_per_step;
};

struct GenerationResult {
  // tokens[s]: the greedy tokens of sequence s: one from the prefill, then
  // one per decode step.
  std::vector<std::vector<int32_t>> tokens;
  // Per step (prefill first): normed final hidden [B, H] and logits [B, V]
  // of each sequence's last token.
  std::vector<std::vector<float>> step_final_hidden;
  std::vector<std::vector<float>> step_logits;
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
};

class ReferenceModel {
 public:
  ReferenceModel(const ModelConfig& config, const ReferenceOptions& options);

  const ModelConfig& config() const { return config_; }
  const ReferenceOptions& options() const { return options_; }
  AttentionSide& attention() { return attention_; }

  // The FFN of `layer` as this codec sees it: PrepareFfnInput (norm, router)
  // then state->ffn_output = FFN(y). Leaves the residual alone, so tests can
  // compare codecs on the same state (teacher forcing).
  void ComputeFfnOutput(int layer, StepState* state);

  // Called after every layer of every RunStep with the state whose hidden
  // rows are the residual stream after that layer (dumps, comparisons).
  using LayerObserver = std::function<void(int layer, const StepState& state)>;
  void set_layer_observer(LayerObserver observer) { observer_ = std::move(observer); }

  // One step through every layer: embed, then per layer attention,
  // ComputeFfnOutput and the residual add.
  bool RunStep(std::span<const SequenceChunk> chunks, std::span<const int32_t> tokens,
               StepState* state);

  // Prefills prompts[s] into sequence slot s, then runs decode_steps greedy
  // steps. If forced_tokens is given, decode step i of sequence s feeds
  // forced_tokens[s][i] instead of its own previous greedy token (teacher
  // forcing across codecs). Sequences must fit max_sequences/max_seq_len.
  GenerationResult Generate(const std::vector<std::vector<int32_t>>& prompts, int decode_steps,
                            const std::vector<std::vector<int32_t>>* forced_tokens = nullptr);

 private:
  ModelConfig config_;
  ReferenceOptions options_;
  AttentionSide attention_;
  // The partitions of F (F = options_.partitions, or each F of
  // partitions_per_step), by F.
  std::map<int, std::vector<FfnSide>> layouts_;
  int partitions_now_ = 1;  // the F the next ComputeFfnOutput runs
  FfnWorkspace ffn_workspace_;
  // The emulated wire of the single micro-batch.
  A2FStorage a2f_;
  std::vector<std::vector<uint16_t>> f2a_partials_;
  LayerObserver observer_;
};

// The effect of a KV cache format against the fp32 cache, same codec and
// prompts: teacher forced (the format's run fed the fp32 run's tokens, so
// every step compares the same inputs) and free running (each decodes its
// own greedy tokens).
struct KvCacheEffect {
  int steps = 0;                    // prefill + decode steps
  int64_t tokens = 0;               // sequences x steps
  double logits_rel_l2_mean = 0.0;  // teacher forced, over sequences and steps
  double logits_rel_l2_max = 0.0;
  int64_t top1_agree = 0;          // teacher forced: same argmax as fp32
  int64_t free_identical = 0;      // free running: same token as fp32
  int first_divergence_step = -1;  // free running, -1 if none
};
KvCacheEffect MeasureKvCacheEffect(const ModelConfig& config, ReferenceOptions options,
                                   KvCacheFormat format,
                                   const std::vector<std::vector<int32_t>>& prompts,
                                   int decode_steps);

// Relative L2 error ||a - b|| / ||b|| in double (0 when both are zero).
double RelativeL2(std::span<const float> a, std::span<const float> b);

}  // namespace afd
