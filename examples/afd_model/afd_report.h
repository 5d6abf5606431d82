#pragma once

// The launcher's view of a finished run: the report of MODEL.md ("The report
// it prints"), the optional Chrome trace, and Gate A (the disaggregated run
// against the monolithic AFD-emulation reference).

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/example_model.h"

namespace afd::example {

// Tokens, TPOT, tokens/s; per layer and micro-batch the attention, A2F, FFN
// and F2A times (decode steps, from the stepmesh traces); the slowest FFN
// peer; the share of communication the pipeline hid behind attention compute.
// Step-5 models add their KV bytes per token (original K/V, proxy keys, block
// summaries) and the fraction of history blocks the global layers attended.
std::string FormatReport(const RunShape& shape, const ExampleModel& model,
                         const std::vector<AttentionResults>& results);

// The application's part of --chrome-trace, as a Chrome trace to merge with
// every process's stepmesh export (MergeChromeTraces; the transfers are
// there): attention compute per micro-batch in its attention instance's
// process, FFN compute per batch in its server's, each with the args
// stepmesh_plan --calibrate-trace fits (docs/planning.md). Stamps go onto the
// scheduler's clock with each process's offset from its export
// (`worker_offset_ns[a]`, `server_offset_ns[p]`).
std::string ApplicationTraceJson(const RunShape& shape,
                                 const std::vector<AttentionResults>& results,
                                 const std::vector<int64_t>& worker_offset_ns,
                                 const std::vector<int64_t>& server_offset_ns);

struct ReferenceCheck {
  bool pass = false;
  std::string summary;  // the text inside "reference check: PASS (...)"
};

enum class GateMode {
  // Gate A: the CPU kernels on both sides, so memcmp on tokens, logits and
  // per-layer residuals.
  kBitwise,
  // The CUDA engine against the CPU reference (bf16 GEMMs, TF32 attention):
  // gate C's bound x1.5 on every request's logits and every layer's
  // residual stream, the reference fed the run's tokens, and tokens equal
  // wherever the reference's top-1 margin exceeds kTokenMargin.
  kBounded,
};
inline constexpr double kGateCBound = 0.075;
inline constexpr double kTokenMargin = 0.1;

// Runs the model's monolithic reference (its own attention side with the
// run's KV cache format, the AFD wire emulated with shape.ffn partitions:
// AfdWireEmulation) on the same prompts and compares with the attention
// instances' results, per `mode`; the per-layer residual stream only when
// `layers_expected` (the instances were asked for --dump-layers: missing
// dumps fail). The CPU kernels are row-independent and every partial is
// reduced in partition order, so a CPU-kernel run is bitwise equal to the
// reference; rel-L2 figures are printed to size a failure. `results` must
// have passed ValidateResults. `progress(step)` is called after each step.
ReferenceCheck CheckAgainstReference(const RunShape& shape, const ExampleModel& model,
                                     const std::vector<AttentionResults>& results,
                                     bool layers_expected,
                                     const std::function<void(int step)>& progress = {},
                                     GateMode mode = GateMode::kBitwise);

}  // namespace afd::example
