#pragma once

// Monolithic reference of the Step-5 variant, built from the same
// Step5AttentionSide and afd::FfnSide units the disaggregated run uses (as
// afd::ReferenceModel is for Step-3): codec kNone runs fp32 throughout with
// one FFN partition; kAfd emulates the wire (FP8 A2F, F BF16 partials added
// in partition order), so a disaggregated run with the same F matches it bit
// for bit.

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "examples/afd_model/attention_model.h"
#include "examples/afd_model/ffn_side.h"
#include "examples/afd_model/reference.h"
#include "examples/afd_model/step5/step5_attention_side.h"
#include "examples/afd_model/step5/step5_config.h"

namespace afd::step5 {

class Step5ReferenceModel {
 public:
  Step5ReferenceModel(const Step5Config& config, const ReferenceOptions& options);

  const Step5Config& config() const { return config_; }
  const ReferenceOptions& options() const { return options_; }
  Step5AttentionSide& attention() { return attention_; }

  // PrepareFfnInput, then state->ffn_output = FFN(y) under this codec.
  void ComputeFfnOutput(int layer, Step5StepState* state);

  // One step through every layer (embed, then per layer attention,
  // ComputeFfnOutput and the residual add). If `layer_hidden` is non-null,
  // the residual stream after each layer is appended to it ([layer][rows][H]).
  bool RunStep(std::span<const SequenceChunk> chunks, std::span<const int32_t> tokens,
               Step5StepState* state, std::vector<float>* layer_hidden = nullptr);

 private:
  Step5Config config_;
  ReferenceOptions options_;
  Step5AttentionSide attention_;
  std::optional<FfnSide> fp32_ffn_;  // codec none: the whole FFN, one partition
  FfnWorkspace fp32_workspace_;
  std::optional<AfdWireEmulation> wire_;  // codec afd
};

}  // namespace afd::step5
