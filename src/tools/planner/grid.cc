#include "src/tools/planner/grid.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/tools/planner/json.h"
#include "src/tools/planner/plan.h"
#include "src/tools/planner/report.h"
#include "src/tools/planner/simulator.h"
#include "stepmesh/status.h"

namespace stepmesh::planner {
namespace {

absl::StatusOr<Json> LoadJson(const std::string& path) {
  STEPMESH_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  absl::StatusOr<Json> doc = Json::Parse(text);
  if (!doc.ok())
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", doc.status().message()));
  return doc;
}

absl::Status Int(const Json& obj, const char* key, const std::string& where, int* out) {
  const Json* v = obj.Find(key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_number() || v->number() < 0 || v->number() != std::floor(v->number())) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".", key, " must be an integer >= 0"));
  }
  *out = static_cast<int>(v->number());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<GridRow>> RunGrid(const std::string& grid_path) {
  STEPMESH_ASSIGN_OR_RETURN(const Json grid, LoadJson(grid_path));
  const Json* base_name = grid.Find("base");
  if (base_name == nullptr || !base_name->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(grid_path, ": \"base\" (a plan file) is missing"));
  }
  const size_t slash = grid_path.rfind('/');
  const std::string dir = slash == std::string::npos ? "" : grid_path.substr(0, slash + 1);
  STEPMESH_ASSIGN_OR_RETURN(const Json base, LoadJson(dir + base_name->string()));

  SimOptions sim;
  int max_attention = 0;
  if (const Json* s = grid.Find("simulation"); s != nullptr) {
    int seed = 1;
    STEPMESH_RETURN_IF_ERROR(Int(*s, "warmup_steps", "simulation", &sim.warmup_steps));
    STEPMESH_RETURN_IF_ERROR(Int(*s, "measure_steps", "simulation", &sim.measure_steps));
    STEPMESH_RETURN_IF_ERROR(Int(*s, "seed", "simulation", &seed));
    sim.seed = seed;
  }
  STEPMESH_RETURN_IF_ERROR(Int(grid, "max_attention", "grid", &max_attention));
  const Json* cases = grid.Find("cases");
  if (cases == nullptr || !cases->is_array() || cases->array().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(grid_path, ": \"cases\" must be a non-empty array"));
  }

  std::vector<GridRow> rows;
  for (size_t i = 0; i < cases->array().size(); ++i) {
    const Json& c = cases->array()[i];
    const Json* name = c.Find("name");
    const Json* set = c.Find("set");
    const std::string where = absl::StrCat(grid_path, ": cases[", i, "]");
    if (name == nullptr || !name->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": \"name\" is missing"));
    }
    absl::StatusOr<Plan> plan = ParsePlan(set != nullptr ? Json::Merge(base, *set) : base);
    if (!plan.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " (", name->string(), "): ", plan.status().message()));
    }
    if (plan->workload.ffn_instances != 1) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the grid compares xA1F ratios"));
    }
    STEPMESH_ASSIGN_OR_RETURN(const PlanReport rep, BuildReport(*plan, max_attention, sim));
    GridRow row;
    row.name = name->string();
    row.batch = plan->workload.batch;
    row.micro_batches = plan->workload.micro_batches;
    row.mu_p = plan->workload.mu_p;
    row.mu_d = plan->workload.mu_d;
    row.seed_regime = rep.seed.regime;
    row.full_regime = rep.full.regime;
    row.r_seed = rep.seed.r_star;
    row.r_full = rep.full.r;
    row.pick_seed = rep.best_x_seed;
    row.pick_full = rep.best_x;
    row.pick_barrier = rep.best_x_barrier;
    row.best_sim = *rep.best_x_simulated;
    const double best = *rep.ratios[row.best_sim - 1].simulated;
    row.err_seed = std::abs(row.r_seed - row.best_sim) / row.best_sim;
    row.err_full = std::abs(row.r_full - row.best_sim) / row.best_sim;
    row.loss_seed = 1 - *rep.ratios[row.pick_seed - 1].simulated / best;
    row.loss_full = 1 - *rep.ratios[row.pick_full - 1].simulated / best;
    row.loss_barrier = 1 - *rep.ratios[row.pick_barrier - 1].simulated / best;
    SimOptions at = sim;
    at.attention = row.best_sim;
    STEPMESH_ASSIGN_OR_RETURN(const SimResult r, Simulate(*plan, at));
    row.barrier_excess = r.mean_t_a_us > 0 ? r.mean_barrier_t_a_us / r.mean_t_a_us - 1 : 0;
    row.within = row.err_seed <= 0.10;
    if (!row.within) {
      if (row.best_sim == static_cast<int>(rep.ratios.size())) {
        row.why = "the simulator's best is the largest ratio tried";
      } else if (row.pick_seed == row.best_sim) {
        row.why = "integer rounding: the seed's own best integer is the simulator's";
      } else if (row.pick_full == row.best_sim && rep.full.regime != rep.seed.regime) {
        row.why = absl::StrCat("the seed misses the ", RegimeName(rep.full.regime),
                               " bound; the full model picks it");
      } else if (row.barrier_excess > 0.02) {
        row.why = absl::StrFormat(
            "the barrier waits for the slowest of %d instances (t_A +%.0f%%)%s", row.best_sim,
            100 * row.barrier_excess,
            row.pick_barrier == row.best_sim ? "; the barrier-aware pick is right" : "");
      } else {
        row.why = "unexplained";
      }
    }
    rows.push_back(row);
  }
  return rows;
}

std::string FormatGrid(const std::vector<GridRow>& rows) {
  std::string out =
      "| case | B | mu_P | mu_D | m | seed regime | r* seed | r* full | best x: seed / full / "
      "barrier / sim | err seed | loss at pick: seed / full / barrier | within 10 % |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  int within = 0, seed_ok = 0, full_ok = 0, barrier_ok = 0;
  for (const GridRow& r : rows) {
    within += r.within;
    seed_ok += r.loss_seed <= 0.10;
    full_ok += r.loss_full <= 0.10;
    barrier_ok += r.loss_barrier <= 0.10;
    absl::StrAppendFormat(
        &out,
        "| %s | %d | %g | %g | %d | %s | %.2f | %.2f | %d / %d / %d / %d | %.0f %% "
        "| %.1f / %.1f / %.1f %% | %s |\n",
        r.name, r.batch, r.mu_p, r.mu_d, r.micro_batches, RegimeName(r.seed_regime), r.r_seed,
        r.r_full, r.pick_seed, r.pick_full, r.pick_barrier, r.best_sim, 100 * r.err_seed,
        100 * r.loss_seed, 100 * r.loss_full, 100 * r.loss_barrier,
        r.within ? "yes" : absl::StrCat("**no**: ", r.why));
  }
  absl::StrAppendFormat(&out,
                        "\n%d of %d cases have the seed's r* within 10 %% of the simulator's best "
                        "integer ratio. Deploying a model's best integer ratio loses at most 10 %% "
                        "of the simulated best throughput in %d of %d cases for the seed's model, "
                        "%d for the full model, %d for the barrier-aware one.\n",
                        within, rows.size(), seed_ok, rows.size(), full_ok, barrier_ok);
  return out;
}

}  // namespace stepmesh::planner
