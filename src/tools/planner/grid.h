#pragma once
// The seed's "within 10 %" claim, checked: for every workload of a grid the
// simulator's best integer ratio is compared with the closed form's r* (and
// with the full model's), and the throughput lost by deploying the model's
// integer pick instead of the simulator's best is reported.
//
// A grid file:
//   {"base": "step3_h800.json",            (relative to the grid file)
//    "simulation": {"warmup_steps": 30, "measure_steps": 300, "seed": 1},
//    "max_attention": 24,                  (x = 1..this; 0: the report's default)
//    "cases": [{"name": "chat", "set": {"workload": {"batch": 32}}}, ...]}
// "set" is laid over the base plan (objects merge key by key).

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/tools/planner/ratio.h"

namespace stepmesh::planner {

struct GridRow {
  std::string name;
  int batch = 0, micro_batches = 0;
  double mu_p = 0, mu_d = 0;
  Regime seed_regime = Regime::kFfn, full_regime = Regime::kFfn;
  double r_seed = 0, r_full = 0;
  int pick_seed = 0, pick_full = 0, pick_barrier = 0;     // best integer ratio by each model
  int best_sim = 0;                                       // the simulator's best integer ratio
  double err_seed = 0, err_full = 0;                      // |r* - best_sim| / best_sim
  double loss_seed = 0, loss_full = 0, loss_barrier = 0;  // 1 - sim(pick) / sim(best_sim)
  double barrier_excess = 0;  // slowest instance's t_A / mean t_A - 1, at best_sim
  bool within = false;        // err_seed <= 10 %
  std::string why;            // for a miss: the likely cause
};

absl::StatusOr<std::vector<GridRow>> RunGrid(const std::string& grid_path);

// A Markdown table (docs/planning.md carries one) and a summary line.
std::string FormatGrid(const std::vector<GridRow>& rows);

}  // namespace stepmesh::planner
