#pragma once
// A discrete-event simulator of xA-yF decoding under the seed's workload
// (workload.h), driven by the same coefficients as the closed form.
//
// Each attention instance runs m micro-batches of B slots; one layer of one
// micro-batch goes
//   attention (the instance's compute, one micro-batch at a time, FIFO)
//   -> A2F on the instance's outgoing channel (a2f_fraction * t_C)
//   -> [FFN link in, when modelled] -> barrier: the FFN instance starts that
//      micro-batch's batch once every attention instance's rows arrived
//   -> FFN (each of the y instances, (alpha_F*x*B + beta_F)/y, FIFO)
//   -> [FFN link out] -> F2A on the instance's incoming channel (t_C, once
//      every FFN instance's partial is there)
//   -> the next layer; after L layers every slot has produced a token and
//      requests end and are replaced (continuous batching).
// Times are those of the latency model evaluated at the current KV tokens
// of each micro-batch (not their average): the barrier waits for the slowest
// attention instance, which the closed form does not see.

#include <cstdint>

#include "absl/status/statusor.h"
#include "src/tools/planner/plan.h"

namespace stepmesh::planner {

struct SimOptions {
  int attention = 1;  // x
  int ffn = 1;        // y (overrides workload.ffn_instances)
  uint64_t seed = 1;
  int warmup_steps = 20;         // decode steps per micro-batch before measuring
  int measure_steps = 200;       // decode steps measured
  bool stationary_start = true;  // slots start in the stationary state (see SlotBatch)
};

struct SimResult {
  double tokens_per_s = 0;               // all instances, in the measured window
  double tokens_per_s_per_instance = 0;  // / (x + y)
  double window_us = 0;
  int64_t tokens = 0;
  double mean_cycle_us = 0;  // window / (measured steps * layers): one layer of one micro-batch
  // Workload checks.
  double mean_kv_tokens = 0;       // per micro-batch, over the attention stages in the window
  double mean_t_a_us = 0;          // mean attention stage
  double mean_barrier_t_a_us = 0;  // mean over batches of the slowest instance's stage
  double attention_busy = 0;       // fraction of the window the attention instances computed
  double ffn_busy = 0;             // fraction of the window the FFN instances computed
  // Little's law: slots (always occupied) = completion rate * mean time in system.
  double slots = 0;
  double completion_rate_per_us = 0;
  double mean_residence_us = 0;
  int64_t completed = 0;
  double mean_tokens_per_request = 0;
};

absl::StatusOr<SimResult> Simulate(const Plan& plan, const SimOptions& options);

}  // namespace stepmesh::planner
