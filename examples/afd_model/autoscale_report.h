#pragma once

// afd_launch's comparison of an elastic emulated run (--resize or
// --autoscale with --emulate-compute) with the planner (docs/elastic.md,
// "Autoscale"): for each span of steps between two changes, the measured
// decode throughput per instance against planner::Predict's for that shape
// at the contexts the engines ran.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/resize_plan.h"
#include "src/tools/planner/autoscale.h"

namespace afd::example {

struct SegmentComparison {
  MeshShape shape;
  int first_step = 0;                          // the window's steps (first_step, last_step]: the
  int last_step = 0;                           // change's own step and the one after are left out
  double context_first = 0, context_last = 0;  // mean context at both ends
  double measured = 0;                         // virtual tokens/s per instance, model time
  double predicted = 0;                        // planner::Predict, the same steps and contexts
};

// `results`: attention 0 first (a member for the whole run); the step ends
// and stage loads come from it. Fails naming the step when a result is
// missing. A span too short for a window (under 3 steps) is left out.
absl::StatusOr<std::vector<SegmentComparison>> CompareWithPlanner(
    const RunShape& run, const ResizeSchedule& schedule,
    const stepmesh::planner::AutoscalePlan& plan, const AttentionResults& attention0);

// "throughput at 2A2F, steps 2-11 (context 1024 -> 2416): measured 812.3
// tokens/s per instance, predicted 830.1 (planner), -2.1 %" per span.
std::string FormatComparison(const std::vector<SegmentComparison>& rows);

// Per decode step: "step,shape,context,measured,predicted", the throughput
// per instance in model time, measured from the step's end to the next and
// planner::Predict's at the step's context (plot_autoscale.py draws it).
std::string ThroughputCsv(const RunShape& run, const ResizeSchedule& schedule,
                          const stepmesh::planner::AutoscalePlan& plan,
                          const AttentionResults& attention0);

}  // namespace afd::example
