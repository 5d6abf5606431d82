#pragma once
// What stepmesh_plan prints: the closed form, the full model's optimum, the
// integer ratios around it (optionally simulated), the communication bound,
// as text for the operator and as JSON for plot_plan.py.

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "src/tools/planner/fit.h"
#include "src/tools/planner/plan.h"
#include "src/tools/planner/ratio.h"
#include "src/tools/planner/simulator.h"

namespace stepmesh::planner {

// One deployment xAyF.
struct RatioRow {
  int x = 1, y = 1;
  double r = 1;  // x / y
  double tau_seed = 0, tau_full = 0;
  Regime seed_binding = Regime::kFfn, full_binding = Regime::kFfn;
  double seed = 0, full = 0;  // tokens/s per instance
  double full_per_gpu = 0;    // the full model's tokens/s per GPU
  // The full model with the barrier priced in: every FFN batch waits for the
  // slowest of x attention stages, t_A + alpha_A * sd(T) * E[max of x
  // standard normals] (a Gaussian approximation of the token load).
  double barrier = 0;
  double barrier_t_a = 0;
  std::optional<double> simulated;
  double ffn_utilisation = 0;  // t_F / tau (full model): the FFN's busy share
  // One FFN instance, one layer, one micro-batch: bytes in (A2F) and out
  // (F2A), and the time they take on its link (0 when no bandwidth given).
  double a2f_bytes = 0, f2a_bytes = 0, link_us = 0;
  double tpot_ms = 0;  // L * m * tau (full model); 0 without micro_batches
};

struct PlanReport {
  Plan plan;
  std::vector<std::pair<std::string, LinearFit>> fits;  // label, fit
  SeedSolution seed;
  Optimum full;
  double link_bound_from = 0;       // r beyond which the FFN is link-bound (0: never)
  std::vector<RatioRow> ratios;     // x = 1..max at the workload's y
  std::vector<RatioRow> ffn_sweep;  // y = 1..4 at the best x of `ratios`
  int best_x = 1;                   // best integer x by the full model
  int best_x_seed = 1;              // by the seed's model
  int best_x_barrier = 1;           // by the barrier-aware full model
  int best_x_per_gpu = 1;           // by the full model per GPU
  std::optional<int> best_x_simulated;
  std::optional<int> best_x_within_tpot;  // with workload.tpot_ms: the best that meets it
  std::optional<SimOptions> simulation;
};

RatioRow EvaluateRatio(const Plan& plan, int x, int y);

// max_x = 0 picks max(8, 2*ceil(r*)) ratios; `simulation` (optional) runs
// the simulator at every integer ratio.
absl::StatusOr<PlanReport> BuildReport(const Plan& plan, int max_x,
                                       const std::optional<SimOptions>& simulation);

std::string FormatText(const PlanReport& report);
std::string FormatJson(const PlanReport& report);

}  // namespace stepmesh::planner
