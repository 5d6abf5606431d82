#pragma once
// The planner in the loop (docs/planning.md, "--watch and autoscale"): the
// calibrated model of a plan file, a grid of deployable shapes xAyF, and a
// hysteresis rule, applied to the workload a running mesh observes.
//
// An observation gives the mean context of the requests in flight (KV tokens
// per request: prompt plus the tokens generated so far) and the decode slots
// per micro-batch per attention instance. The model's workload is set so that
// its mean KV load per slot is that context (mu_P = context - mu_D, the
// seed's T-bar = B*(mu_P + mu_D)), and every candidate xAyF is evaluated with
// the full model (ratio.h: the seed's three terms plus the pipeline-depth and
// FFN-link bounds). The best candidate maximises throughput per instance; with
// a TPOT target only the candidates that meet it compete (none meets it: the
// best throughput, flagged).
//
// Recommend is pure: one observation, one answer. AutoscaleController adds
// the hysteresis: it moves only when a better shape beats the current one by
// at least min_gain for `confirmations` consecutive observations.
//
// stepmesh_plan --autoscale-out writes the file and stepmesh_plan --watch
// reads it; it is also the input written for afd_launch --autoscale. No
// dependency on libstepmesh.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/tools/planner/json.h"
#include "src/tools/planner/plan.h"
#include "src/tools/planner/ratio.h"

namespace stepmesh::planner {

// How the decode slots follow the shape.
//   kPerInstance: every attention instance keeps its B slots per micro-batch
//                 (more attention instances serve more requests).
//   kGlobal:      the global batch (B times the attention instances) is held
//                 and split over the attention instances: the Step-3 paper's
//                 "4A2F with the same global batch" at 8K.
enum class BatchPolicy { kPerInstance, kGlobal };
const char* BatchPolicyName(BatchPolicy policy);

struct AutoscalePlan {
  // The calibrated model: coefficients, wire, hardware, and the workload's
  // fixed parts (mu_d, prefill, micro_batches, layers). mu_p and batch are
  // replaced by each observation; ffn_instances by each candidate.
  Plan plan;
  // The candidate grid: x in [min_attention, max_attention], y in [min_ffn,
  // max_ffn], and x + y <= max_instances when max_instances > 0.
  int min_attention = 1;
  int max_attention = 8;
  int min_ffn = 1;
  int max_ffn = 1;
  int max_instances = 0;
  BatchPolicy batch_policy = BatchPolicy::kPerInstance;
  // A TPOT target in ms (the full model's L*m*tau; needs
  // plan.workload.micro_batches); 0: throughput only.
  double tpot_ms = 0;
  // Hysteresis: change only when the best shape's predicted throughput per
  // instance beats the current shape's by at least min_gain_percent, in
  // `confirmations` consecutive observations. A current shape that misses the
  // TPOT target while another meets it counts as beaten.
  double min_gain_percent = 5.0;
  int confirmations = 3;
};

// Checks the grid and hysteresis ranges and the plan (ValidatePlan); errors
// name the key ("autoscale.max_attention").
absl::Status ValidateAutoscalePlan(const AutoscalePlan& plan);

// The file: {"autoscale": {...}, "plan": {a plan file (plan.h)}}. Keys of
// "autoscale": attention [lo, hi], ffn [lo, hi], max_instances, batch_policy
// ("per_instance" | "global"), tpot_ms, min_gain_percent, confirmations.
// Unknown keys, wrong types and out-of-range values are errors naming the key
// and (ReadAutoscalePlan) the file.
absl::StatusOr<AutoscalePlan> ParseAutoscalePlan(const Json& doc);
absl::StatusOr<AutoscalePlan> ReadAutoscalePlan(const std::string& path);
std::string AutoscalePlanToJson(const AutoscalePlan& plan);
absl::Status WriteAutoscalePlan(const std::string& path, const AutoscalePlan& plan);

// What a running mesh reports (stepmesh_plan --watch reads it from the
// attention instances' metrics; afd_launch --autoscale from its own run).
struct ObservedWorkload {
  double mean_context = 0;  // KV tokens per request in flight (>= 0)
  double batch = 0;         // decode slots per micro-batch per attention instance (> 0)
  double mean_decode = 0;   // mu_D when observed; 0: the plan's
};

// One shape under one observation, by the full model.
struct RatioPrediction {
  int attention = 0;                   // x
  int ffn = 0;                         // y
  int batch = 0;                       // B per attention instance at this shape (the batch policy)
  double cycle_us = 0;                 // tau per layer and micro-batch
  double throughput_per_instance = 0;  // decode tokens/s per instance (A and F alike)
  double tpot_ms = 0;                  // 0 without plan.workload.micro_batches
  bool meets_tpot = true;              // always true without a target
  Regime binding = Regime::kFfn;       // the term that sets tau
};

// Predicts shape xAyF for an observation made while the mesh had
// `observed_attention` attention instances (the global batch policy splits
// batch * observed_attention over x). Errors name the bad field.
absl::StatusOr<RatioPrediction> Predict(const AutoscalePlan& plan, const ObservedWorkload& observed,
                                        int observed_attention, int x, int y);

struct Recommendation {
  RatioPrediction current;      // the running shape
  RatioPrediction best;         // the best candidate of the grid
  RatioPrediction recommended;  // best when `changed`, else current
  // best's throughput per instance over current's, minus 1.
  double gain = 0;
  // This observation favours a change: best differs from current and beats
  // it by min_gain_percent (or meets the TPOT target that current misses).
  bool favours_change = false;
  // Consecutive observations, this one included, that favoured a change
  // (Recommend: 0 or 1; AutoscaleController: its streak).
  int streak = 0;
  // Move to `recommended` now: favours_change for `confirmations`
  // observations in a row (Recommend: only when confirmations is 1).
  bool changed = false;
};

// One observation, no memory: the best shape of the grid against the current
// one. `current_a` and `current_f` need not lie in the grid.
absl::StatusOr<Recommendation> Recommend(const AutoscalePlan& plan,
                                         const ObservedWorkload& observed, int current_a,
                                         int current_f);

// Recommend with the hysteresis: a change is announced after
// `confirmations` consecutive favouring observations (to the best shape of
// the last one); the controller then takes that shape as current and starts
// counting again. A bad observation changes nothing.
class AutoscaleController {
 public:
  AutoscaleController(AutoscalePlan plan, int current_a, int current_f);

  absl::StatusOr<Recommendation> Observe(const ObservedWorkload& observed);
  // The mesh was resized by other means (or the recommendation not applied):
  // the shape to compare against from now on; resets the streak.
  void SetCurrent(int a, int f);

  int current_attention() const { return a_; }
  int current_ffn() const { return f_; }
  int streak() const { return streak_; }
  const AutoscalePlan& plan() const { return plan_; }

 private:
  AutoscalePlan plan_;
  int a_, f_;
  int streak_ = 0;
};

// "xAyF".
std::string ShapeName(int attention, int ffn);
// One line for a recommendation that changed, e.g.
// "recommend 4A2F (was 2A2F): 812 -> 905 tokens/s per instance (+11.5 %), cycle 281 -> 247 us".
std::string FormatChange(const Recommendation& rec);

}  // namespace stepmesh::planner
