#include "examples/afd_model/autoscale_report.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace afd::example {
namespace {

namespace planner = stepmesh::planner;

// The end of global step `s` at attention 0: its last micro-batch's.
uint64_t StepEnd(const AttentionResults& r, int s) {
  uint64_t end = 0;
  for (int m = 0; m < r.micro_batches; ++m) {
    end = std::max(end, r.step_end_ns[size_t(s) * r.micro_batches + m]);
  }
  return end;
}

// The mean context the engine ran at step `s` (layer 0, micro-batch 0).
double ContextOf(const AttentionResults& r, int s) {
  const StageTiming& t = r.attention[r.StageIndex(s, 0, 0)];
  return t.rows > 0 ? double(t.kv_tokens) / double(t.rows) : 0;
}

// Virtual decode tokens of step `s` over the whole mesh.
double TokensAt(const RunShape& run, MeshShape shape, int plan_batch) {
  return double(shape.attention) * run.micro_batches *
         run.VirtualBatch(plan_batch, shape.attention);
}

}  // namespace

absl::StatusOr<std::vector<SegmentComparison>> CompareWithPlanner(
    const RunShape& run, const ResizeSchedule& schedule, const planner::AutoscalePlan& plan,
    const AttentionResults& a0) {
  if (a0.instance != 0 || a0.steps != run.steps()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the comparison needs attention 0's results over all ", run.steps(),
                     " steps (got instance ", a0.instance, ", ", a0.steps, " steps)"));
  }
  std::vector<int> bounds = {0};
  for (const ShapeChange& c : schedule.changes()) bounds.push_back(c.step);
  bounds.push_back(run.steps());
  const int plan_batch = plan.plan.workload.batch;
  const double scale = plan.plan.emulation.time_scale;
  std::vector<SegmentComparison> rows;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    SegmentComparison row;
    row.shape = schedule.At(bounds[i]);
    // The prefill (step 0), a change's step and the step after it are not
    // steady decode: the window is the step ends (first, last].
    row.first_step = bounds[i] + 1;
    row.last_step = bounds[i + 1] - 1;
    if (row.last_step - row.first_step < 1) continue;
    const int instances = row.shape.attention + row.shape.ffn;
    double tokens = 0, predicted_s = 0;
    for (int s = row.first_step + 1; s <= row.last_step; ++s) {
      const double step_tokens = TokensAt(run, row.shape, plan_batch);
      const int b = run.VirtualBatch(plan_batch, row.shape.attention);
      absl::StatusOr<planner::RatioPrediction> p =
          planner::Predict(plan, {ContextOf(a0, s), double(b), 0}, row.shape.attention,
                           row.shape.attention, row.shape.ffn);
      if (!p.ok()) {
        return absl::Status(p.status().code(),
                            absl::StrCat("step ", s, ": ", p.status().message()));
      }
      tokens += step_tokens;
      predicted_s += step_tokens / (instances * p->throughput_per_instance);
    }
    const uint64_t from = StepEnd(a0, row.first_step), to = StepEnd(a0, row.last_step);
    if (from == 0 || to <= from) {
      return absl::InvalidArgumentError(absl::StrCat("attention 0 recorded no step end for steps ",
                                                     row.first_step, "-", row.last_step));
    }
    row.measured = tokens / (double(to - from) * 1e-9) * scale / instances;
    row.predicted = tokens / (instances * predicted_s);
    row.context_first = ContextOf(a0, row.first_step + 1);
    row.context_last = ContextOf(a0, row.last_step);
    rows.push_back(row);
  }
  return rows;
}

std::string FormatComparison(const std::vector<SegmentComparison>& rows) {
  std::string out;
  for (const SegmentComparison& r : rows) {
    absl::StrAppendFormat(&out,
                          "throughput at %s, steps %d-%d (context %.0f -> %.0f): measured %.6g "
                          "tokens/s per instance, predicted %.6g (planner), %+.1f %%\n",
                          r.shape.Name(), r.first_step + 1, r.last_step, r.context_first,
                          r.context_last, r.measured, r.predicted,
                          (r.measured / r.predicted - 1) * 100);
  }
  return out;
}

std::string ThroughputCsv(const RunShape& run, const ResizeSchedule& schedule,
                          const planner::AutoscalePlan& plan, const AttentionResults& a0) {
  std::string out = "step,shape,context,measured,predicted\n";
  const int plan_batch = plan.plan.workload.batch;
  for (int s = 2; s < std::min<int>(a0.steps, run.steps()); ++s) {
    const MeshShape shape = schedule.At(s);
    const uint64_t from = StepEnd(a0, s - 1), to = StepEnd(a0, s);
    if (from == 0 || to <= from) continue;
    const double per_s = TokensAt(run, shape, plan_batch) / (double(to - from) * 1e-9) *
                         plan.plan.emulation.time_scale / (shape.attention + shape.ffn);
    const int b = run.VirtualBatch(plan_batch, shape.attention);
    absl::StatusOr<planner::RatioPrediction> p = planner::Predict(
        plan, {ContextOf(a0, s), double(b), 0}, shape.attention, shape.attention, shape.ffn);
    absl::StrAppendFormat(&out, "%d,%s,%.0f,%.6g,%.6g\n", s, shape.Name(), ContextOf(a0, s), per_s,
                          p.ok() ? p->throughput_per_instance : 0.0);
  }
  return out;
}

}  // namespace afd::example
