#pragma once

// afd_launch --emulate-compute PLAN.json: the attention and FFN processes
// keep their whole stepmesh pipeline (registered tensors, PushPull,
// GetBatch, Respond, the real bytes over TCP) but replace the model's
// kernels by sleeps from the planner's latency model (src/tools/planner,
// docs/planning.md), so ratios such as 6A1F run on a 2-core machine without
// the CPU being the bottleneck.
//
// What is emulated, per layer and micro-batch:
//   attention  t_A = alpha_A * T + beta_A, where T is the KV tokens of B
//              virtual decode slots under the seed's workload (prefill P with
//              mean mu_P, geometric decode with mean mu_D, continuous
//              batching: planner::SlotBatch), redrawn every step;
//   FFN        t_F = (alpha_F * rows + beta_F) / y for a batch holding the
//              micro-batch of `workers` attention instances, rows = workers*B.
// Both are multiplied by the plan's emulation.time_scale. Each instance's
// compute is one device: jobs run one after another in submission order
// (the example gives every micro-batch its own stream; on a GPU those
// streams share one device, and so they do here). The communication is not
// emulated: it is the library's, over loopback, with the example's wire
// shapes (B is virtual; the wire carries the example's rows).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "examples/afd_model/afd_common.h"
#include "src/tools/planner/plan.h"
#include "src/tools/planner/workload.h"

namespace afd::example {

// A plan usable for emulation: it must carry coefficients. An autoscale
// file (src/tools/planner/autoscale.h) gives its "plan".
absl::StatusOr<stepmesh::planner::Plan> LoadEmulationPlan(const std::string& path);

// One compute device: Run blocks until the job, queued behind every job
// submitted before it, has had its duration.
class EmulatedDevice {
 public:
  struct Span {
    uint64_t begin_ns = 0;  // when the device started the job
    uint64_t end_ns = 0;    // when the caller woke up
  };
  Span Run(double duration_us);

 private:
  absl::Mutex mu_;
  uint64_t free_at_ns_ ABSL_GUARDED_BY(mu_) = 0;
};

class EmulatedAttention {
 public:
  EmulatedAttention(const stepmesh::planner::Plan& plan, int instance, int micro_batches);

  // Stage (step, layer) of micro-batch `mb`: at layer 0 of a later step the
  // previous step's token is counted for every slot and requests end and
  // are replaced; then t_A of the slots' KV tokens on the device. Fills
  // begin/end, rows (B) and kv_tokens.
  void RunStage(int step, int layer, int mb, StageTiming* timing);
  // --context-growth: a stage of `batch` slots whose requests attend over
  // `context` tokens on average: t_A of the planner's mean KV load
  // (planner::MeanKvTokens with mu_P = context - mu_D, mu_D capped at the
  // context, as planner::Predict sets it).
  void RunMeanStage(double context, int batch, StageTiming* timing);

 private:
  const stepmesh::planner::Plan plan_;
  std::vector<std::unique_ptr<stepmesh::planner::SlotBatch>> slots_;  // per micro-batch
  EmulatedDevice device_;
};

class EmulatedFfn {
 public:
  explicit EmulatedFfn(const stepmesh::planner::Plan& plan);

  // One batch holding the micro-batch of `workers` attention instances;
  // `ffn_instances`: the y it is computed under (this instance holds 1/y of
  // the FFN).
  // `slots`: the virtual rows of each instance (the plan's batch unless
  // --emulated-batch global).
  void RunBatch(int workers, int ffn_instances, int slots);

 private:
  const stepmesh::planner::Plan plan_;
  EmulatedDevice device_;
};

// The launcher's line for an emulated run: decode throughput in virtual
// tokens (B per micro-batch per step), in total and per instance, measured
// and in model time (times the time scale).
std::string FormatEmulationSummary(const RunShape& shape, const stepmesh::planner::Plan& plan,
                                   const std::vector<AttentionResults>& results);

}  // namespace afd::example
