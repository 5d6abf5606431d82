#pragma once

// The attention side of any model of the example, as the disaggregated
// programs and the references drive it (docs/example.md, "Models"): Step-3's
// AttentionSide (MFA) and Step-5's Step5AttentionSide (sliding + global
// sparse) both fit behind it. What crosses the AFD wire is the same for
// every model (wire.h), so the FFN side needs no such interface: FfnSide on
// the model's ModelConfig serves all of them.
//
// Also here: AfdWireEmulation, the AFD wire emulated in one process (FP8
// A2F into F FfnSide partitions, BF16 partials reduced in partition order),
// which is what a monolithic reference does between Attention and the
// residual add.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "examples/afd_model/attention_side.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/ffn_side.h"
#include "examples/afd_model/wire.h"

namespace afd {

// A step's state as the model made it (a model may extend StepState with
// its own scratch); the deleter destroys it as that type.
using StepStatePtr = std::unique_ptr<StepState, void (*)(StepState*)>;

// History blocks a sparse model's global layers could have attended and did
// attend, summed over (token, KV group) pairs; zero for dense models.
struct SelectionStats {
  int64_t history_blocks = 0;
  int64_t attended_blocks = 0;
};

class AttentionModel {
 public:
  virtual ~AttentionModel() = default;

  // The only StepState the other methods accept.
  virtual StepStatePtr NewStepState() const = 0;

  virtual void ResetSequence(int sequence) = 0;
  virtual int64_t SequenceLength(int sequence) const = 0;

  // See AttentionSide for the contract of each step of a layer.
  virtual bool BeginStep(std::span<const SequenceChunk> chunks, std::span<const int32_t> tokens,
                         StepState* state) = 0;
  virtual void Attention(int layer, StepState* state) = 0;
  virtual void PrepareFfnInput(int layer, StepState* state) const = 0;
  virtual void WriteA2F(const StepState& state, const A2FBuffers& out) const = 0;
  virtual void ReduceF2A(std::span<const uint16_t* const> partials, StepState* state) const = 0;
  virtual void AddFfnOutput(StepState* state) const = 0;
  virtual void LastTokenLogits(const StepState& state, std::vector<float>* final_hidden,
                               std::vector<float>* logits) const = 0;

  // Selection statistics gathered in `state` since the last call; resets them.
  virtual SelectionStats TakeSelectionStats(StepState* /*state*/) const { return {}; }

  // ReduceF2A then AddFfnOutput.
  void ApplyF2A(std::span<const uint16_t* const> partials, StepState* state) const {
    ReduceF2A(partials, state);
    AddFfnOutput(state);
  }
};

// Pieces every attention side shares (Step-3's and Step-5's).

// Checks a step (slots in [0, max_sequences), lengths within max_seq_len,
// token ids below vocab_size, one token per chunk row) and, only when it is
// valid, sets state->chunks and state->positions (after each sequence's
// cached tokens) and advances `lengths`. False changes nothing.
bool AssignStepPositions(std::span<const SequenceChunk> chunks, std::span<const int32_t> tokens,
                         int64_t vocab_size, int64_t max_seq_len, std::vector<int64_t>* lengths,
                         StepState* state);

// RMS(last token of every chunk; final_norm) into final_hidden [chunks, H]
// and the LM head's logits [chunks, V]; a chunk without tokens gets a zero
// row. Either output may be null.
void LastTokenLogitsOf(const StepState& state, const ModelConfig& config, const float* final_norm,
                       const float* lm_head, std::vector<float>* final_hidden,
                       std::vector<float>* logits);

// FP8 quantisation of state.normed and the routing, into the A2F buffers.
void WriteA2FOf(const StepState& state, const ModelConfig& config, const A2FBuffers& out);

// The AFD wire in one process: ComputeFfnOutput runs PrepareFfnInput, writes
// the A2F tensors, runs every FfnSide partition on them and reduces the BF16
// partials into state->ffn_output, exactly as the disaggregated run does.
class AfdWireEmulation {
 public:
  AfdWireEmulation(const ModelConfig& config, int partitions);

  void ComputeFfnOutput(int layer, const AttentionModel& attention, StepState* state);

 private:
  ModelConfig config_;
  std::vector<FfnSide> partitions_;
  FfnWorkspace workspace_;
  A2FStorage a2f_;
  std::vector<std::vector<uint16_t>> partials_;
  std::vector<const uint16_t*> partial_ptrs_;
};

}  // namespace afd
