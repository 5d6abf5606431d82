#include "examples/afd_model/emulated_compute.h"

#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/tools/planner/autoscale.h"
#include "stepmesh/trace.h"

namespace afd::example {

namespace planner = stepmesh::planner;

absl::StatusOr<planner::Plan> LoadEmulationPlan(const std::string& path) {
  // An autoscale file (afd_launch --autoscale) carries its plan.
  if (absl::StatusOr<planner::AutoscalePlan> as = planner::ReadAutoscalePlan(path); as.ok()) {
    return as->plan;
  }
  absl::StatusOr<planner::Plan> plan = planner::LoadPlan(path);
  if (!plan.ok()) {
    return absl::Status(plan.status().code(),
                        absl::StrCat("--emulate-compute: ", plan.status().message()));
  }
  if (!plan->has_coefficients) {
    return absl::InvalidArgumentError(
        absl::StrCat("--emulate-compute ", path,
                     ": the plan has no \"coefficients\" (calibrate it with "
                     "stepmesh_plan --write-plan first)"));
  }
  return plan;
}

EmulatedDevice::Span EmulatedDevice::Run(double duration_us) {
  const uint64_t now = stepmesh::MonotonicNowNs();
  Span span;
  {
    absl::MutexLock lock(&mu_);
    span.begin_ns = std::max(now, free_at_ns_);
    free_at_ns_ = span.begin_ns + static_cast<uint64_t>(std::max(0.0, duration_us) * 1e3);
    span.end_ns = free_at_ns_;
  }
  // An absolute deadline: the time spent queueing and the wake-up delay of
  // the previous job are not added on top of this one's duration.
  const timespec deadline{static_cast<time_t>(span.end_ns / 1000000000),
                          static_cast<long>(span.end_ns % 1000000000)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &deadline, nullptr) == EINTR) {
  }
  span.end_ns = std::max(span.end_ns, stepmesh::MonotonicNowNs());
  return span;
}

EmulatedAttention::EmulatedAttention(const planner::Plan& plan, int instance, int micro_batches)
    : plan_(plan) {
  for (int m = 0; m < micro_batches; ++m) {
    // The simulator's streams for (instance, micro-batch): the emulated
    // cluster draws the same workload as `stepmesh_plan --simulate`.
    slots_.push_back(std::make_unique<planner::SlotBatch>(
        plan.workload, plan.workload.batch, planner::Rng::Derive(plan.emulation.seed, instance, m),
        /*stationary=*/true));
  }
}

void EmulatedAttention::RunStage(int step, int layer, int mb, StageTiming* timing) {
  planner::SlotBatch& slots = *slots_[mb];
  if (layer == 0 && step > 0) slots.FinishStep(0, nullptr);
  const double us = plan_.coefficients.attention.At(slots.KvTokens()) * plan_.emulation.time_scale;
  const EmulatedDevice::Span span = device_.Run(us);
  timing->begin_ns = span.begin_ns;
  timing->end_ns = span.end_ns;
  timing->rows = slots.slots();
  timing->kv_tokens = static_cast<int64_t>(slots.KvTokens());
}

void EmulatedAttention::RunMeanStage(double context, int batch, StageTiming* timing) {
  planner::Workload w = plan_.workload;
  w.mu_d = std::min(w.mu_d, context);
  w.mu_p = context - w.mu_d;
  w.batch = batch;
  const double kv = planner::MeanKvTokens(w);
  const double us = plan_.coefficients.attention.At(kv) * plan_.emulation.time_scale;
  const EmulatedDevice::Span span = device_.Run(us);
  timing->begin_ns = span.begin_ns;
  timing->end_ns = span.end_ns;
  timing->rows = batch;
  timing->kv_tokens = static_cast<int64_t>(std::llround(kv));
}

EmulatedFfn::EmulatedFfn(const planner::Plan& plan) : plan_(plan) {}

void EmulatedFfn::RunBatch(int workers, int ffn_instances, int slots) {
  const double rows = double(workers) * slots;
  device_.Run(plan_.coefficients.ffn.At(rows) / ffn_instances * plan_.emulation.time_scale);
}

std::string FormatEmulationSummary(const RunShape& shape, const planner::Plan& plan,
                                   const std::vector<AttentionResults>& results) {
  if (shape.decode_steps <= 0 || results.empty()) return "emulated compute: no decode steps\n";
  // The same decode window as the report's TPOT: the slowest instance's.
  double decode_s = 0;
  for (const AttentionResults& r : results) {
    uint64_t first = 0, last = 0;
    for (int m = 0; m < r.micro_batches; ++m) {
      first = std::max(first, r.step_end_ns[m]);
      last = std::max(last, r.step_end_ns[size_t(shape.decode_steps) * r.micro_batches + m]);
    }
    decode_s = std::max(decode_s, (last - first) * 1e-9);
  }
  const double tokens =
      double(shape.attention) * shape.micro_batches * plan.workload.batch * shape.decode_steps;
  const double per_s = tokens / decode_s;
  const int instances = shape.attention + shape.ffn;
  return absl::StrFormat(
      "emulated compute: %dA%dF, B %d virtual slots x %d micro-batches, time scale %g: decode "
      "%.6g virtual tokens/s, %.6g per instance (model time, x%g: %.6g per instance)\n",
      shape.attention, shape.ffn, plan.workload.batch, shape.micro_batches,
      plan.emulation.time_scale, per_s, per_s / instances, plan.emulation.time_scale,
      per_s / instances * plan.emulation.time_scale);
}

}  // namespace afd::example
