#pragma once

// The launcher's view of a finished run: the report of MODEL.md ("The report
// it prints"), the optional Chrome trace, and Gate A (the disaggregated run
// against the monolithic AFD-emulation reference).

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

// Chrome trace-event JSON (chrome://tracing, Perfetto): attention compute per
// micro-batch, FFN compute per server, A2F / F2A transfers.
absl::Status WriteChromeTrace(const std::string& path, const RunShape& shape,
                              const std::vector<AttentionResults>& results);

struct ReferenceCheck {
  bool pass = false;
  std::string summary;  // the text inside "reference check: PASS (...)"
};

// Runs the model's monolithic reference (its attention side, the AFD wire
// emulated with shape.ffn partitions) on the same prompts and compares: token
// ids identical, logits rel-L2 <= 1e-4 per request and step, per-layer
// residual stream rel-L2 <= 1e-5 (when the instances dumped it).
ReferenceCheck CheckAgainstReference(const RunShape& shape, const ExampleModel& model,
                                     const std::vector<AttentionResults>& results);

}  // namespace afd::example
