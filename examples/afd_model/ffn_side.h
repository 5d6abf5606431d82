#pragma once

// The FFN instance's half of the model (paper §7.1): one partition of every
// layer's FFN. Given a micro-batch's A2F wire tensors it computes this
// partition's partial FFN output and writes it as the BF16 F2A tensor.
//
// Ownership (FfnPartition): routed expert e on partition e % F; the dense
// FFN and the shared expert split by columns of their intermediate width, so
// every partition does the same share of the always-on work.

#include <cstdint>
#include <vector>

#include "examples/afd_model/config.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/wire.h"

namespace afd {

// Scratch of one Forward call; reuse it across calls to avoid allocations.
// Concurrent calls need distinct workspaces.
struct FfnWorkspace {
  std::vector<float> activations;  // [n, H] dequantised A2F input
  std::vector<float> partial;      // [n, H] fp32 partial before bf16
  std::vector<float> scratch;
};

class FfnSide {
 public:
  // Generates only the weights this partition owns.
  FfnSide(const ModelConfig& config, FfnPartition partition);

  const ModelConfig& config() const { return config_; }
  FfnPartition partition() const { return partition_; }

  // Wire in, wire out: dequantises in.codes/in.scales, computes this
  // partition's partial and rounds it (RNE) into partial_bf16 [n, H].
  void Forward(int layer, const A2FView& in, uint16_t* partial_bf16, FfnWorkspace* workspace) const;

  // The unquantised core, shared by Forward and the fp32 reference:
  // partial [n, H] (overwritten) = MLP slice(y) (+ owned routed experts,
  // each weighted by its router probability, on MoE layers). topk_ids and
  // topk_weights [n, k] are ignored on dense layers.
  void ForwardFp32(int layer, int64_t tokens, const float* y, const int32_t* topk_ids,
                   const float* topk_weights, float* partial, FfnWorkspace* workspace) const;

 private:
  ModelConfig config_;
  FfnPartition partition_;
  std::vector<FfnLayerWeights> layers_;
};

}  // namespace afd
