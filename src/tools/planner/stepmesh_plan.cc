// stepmesh_plan: picks the attention/FFN ratio of an AFD deployment
// (docs/planning.md).
//
//   stepmesh_plan PLAN.json [--calibrate-perf PERF.json]... [--calibrate-trace TRACE.json]...
//                 [--perf-stat p50_us|mean_us] [--batch B] [--mu-p P] [--mu-d D]
//                 [--micro-batches M] [--ffn-instances Y] [--layers L] [--max-attention X]
//                 [--simulate [--sim-steps N] [--sim-warmup N] [--seed S]]
//                 [--json OUT.json] [--write-plan OUT.json]
//   stepmesh_plan --validate-grid GRID.json
//
// PLAN.json holds the six coefficients and the workload (plan.h); the
// coefficients may instead come from measurements: stepmesh_perf --json
// (communication vs bytes) and afd_launch --chrome-trace (attention time vs
// KV tokens, FFN time vs rows), fitted by least squares (R^2 printed).
// Prints the seed's r_A, r_C, r_peak, r* and regime, the full model's
// optimum, the throughput per instance at integer ratios, and the
// communication bound; --json writes what src/tools/planner/plot_plan.py
// draws. --validate-grid runs the simulator over a grid of workloads and
// prints the "within 10 %" table.

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "src/tools/planner/calibrate.h"
#include "src/tools/planner/grid.h"
#include "src/tools/planner/json.h"
#include "src/tools/planner/plan.h"
#include "src/tools/planner/report.h"
#include "stepmesh/status.h"

namespace stepmesh::planner {
namespace {

constexpr char kUsage[] =
    "usage: stepmesh_plan PLAN.json [options]\n"
    "       stepmesh_plan --validate-grid GRID.json\n"
    "options:\n"
    "  --calibrate-perf FILE    stepmesh_perf --json output: fit the communication time "
    "(repeatable)\n"
    "  --calibrate-trace FILE   afd_launch --chrome-trace output: fit t_A and t_F (repeatable)\n"
    "  --perf-stat STAT         latency statistic of the perf fit: p50_us (default) or mean_us\n"
    "  --batch B --mu-p P --mu-d D --micro-batches M --ffn-instances Y --layers L\n"
    "                           override the plan's workload\n"
    "  --ffn-link-gbps G        override one FFN instance's link bandwidth (0: no link bound)\n"
    "  --max-attention X        integer ratios 1..X in the table (default max(8, 2*ceil(r*)))\n"
    "  --simulate               also simulate every integer ratio\n"
    "  --sim-steps N            measured decode steps per simulation (default 200)\n"
    "  --sim-warmup N           warm-up decode steps (default 20)\n"
    "  --seed S                 simulator seed (default 1)\n"
    "  --json FILE              machine-readable result (input of plot_plan.py)\n"
    "  --write-plan FILE        the plan with calibrated coefficients (for afd_launch "
    "--emulate-compute)\n";

struct Args {
  std::string plan, grid, json, write_plan, perf_stat = "p50_us";
  std::vector<std::string> perf, trace;
  std::optional<double> batch, mu_p, mu_d, micro_batches, ffn_instances, layers, link_gbps;
  int max_attention = 0;
  bool simulate = false;
  SimOptions sim;
};

absl::StatusOr<Args> ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (flag == "--simulate") {
      a.simulate = true;
      continue;
    }
    if (flag.rfind("--", 0) != 0) {
      if (!a.plan.empty())
        return absl::InvalidArgumentError(absl::StrCat("a second plan file: ", flag));
      a.plan = flag;
      continue;
    }
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(flag, " needs a value"));
    const std::string value = argv[++i];
    auto number = [&](std::optional<double>* out) -> absl::Status {
      double v;
      if (!absl::SimpleAtod(value, &v)) {
        return absl::InvalidArgumentError(absl::StrCat(flag, " ", value, ": not a number"));
      }
      *out = v;
      return absl::OkStatus();
    };
    auto integer = [&](int* out, int lo) -> absl::Status {
      if (!absl::SimpleAtoi(value, out) || *out < lo) {
        return absl::InvalidArgumentError(
            absl::StrCat(flag, " ", value, ": need an integer >= ", lo));
      }
      return absl::OkStatus();
    };
    if (flag == "--calibrate-perf") {
      a.perf.push_back(value);
    } else if (flag == "--calibrate-trace") {
      a.trace.push_back(value);
    } else if (flag == "--perf-stat") {
      a.perf_stat = value;
    } else if (flag == "--validate-grid") {
      a.grid = value;
    } else if (flag == "--json") {
      a.json = value;
    } else if (flag == "--write-plan") {
      a.write_plan = value;
    } else if (flag == "--batch") {
      STEPMESH_RETURN_IF_ERROR(number(&a.batch));
    } else if (flag == "--mu-p") {
      STEPMESH_RETURN_IF_ERROR(number(&a.mu_p));
    } else if (flag == "--mu-d") {
      STEPMESH_RETURN_IF_ERROR(number(&a.mu_d));
    } else if (flag == "--micro-batches") {
      STEPMESH_RETURN_IF_ERROR(number(&a.micro_batches));
    } else if (flag == "--ffn-instances") {
      STEPMESH_RETURN_IF_ERROR(number(&a.ffn_instances));
    } else if (flag == "--layers") {
      STEPMESH_RETURN_IF_ERROR(number(&a.layers));
    } else if (flag == "--ffn-link-gbps") {
      STEPMESH_RETURN_IF_ERROR(number(&a.link_gbps));
    } else if (flag == "--max-attention") {
      STEPMESH_RETURN_IF_ERROR(integer(&a.max_attention, 1));
    } else if (flag == "--sim-steps") {
      STEPMESH_RETURN_IF_ERROR(integer(&a.sim.measure_steps, 2));
    } else if (flag == "--sim-warmup") {
      STEPMESH_RETURN_IF_ERROR(integer(&a.sim.warmup_steps, 0));
    } else if (flag == "--seed") {
      int seed = 0;
      STEPMESH_RETURN_IF_ERROR(integer(&seed, 0));
      a.sim.seed = seed;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", flag, " (see --help)"));
    }
  }
  if (a.perf_stat != "p50_us" && a.perf_stat != "mean_us") {
    return absl::InvalidArgumentError("--perf-stat must be p50_us or mean_us");
  }
  if (a.grid.empty() == a.plan.empty()) {
    return absl::InvalidArgumentError("give a plan file or --validate-grid GRID.json (see --help)");
  }
  return a;
}

// Command-line overrides go through the plan file's own checks: they are
// merged into its JSON, so a bad value is reported as the key it sets.
absl::StatusOr<Plan> LoadWithOverrides(const Args& a) {
  STEPMESH_ASSIGN_OR_RETURN(const std::string text, ReadTextFile(a.plan));
  absl::StatusOr<Json> doc = Json::Parse(text);
  if (!doc.ok())
    return absl::InvalidArgumentError(absl::StrCat(a.plan, ": ", doc.status().message()));
  std::string patch = "{\"workload\": {";
  bool first = true;
  for (const auto& [key, v] : {std::pair{"batch", a.batch},
                               {"mu_p", a.mu_p},
                               {"mu_d", a.mu_d},
                               {"micro_batches", a.micro_batches},
                               {"ffn_instances", a.ffn_instances},
                               {"layers", a.layers}}) {
    if (!v) continue;
    absl::StrAppend(&patch, first ? "" : ", ", "\"", key, "\": ", *v);
    first = false;
  }
  absl::StrAppend(&patch, "}");
  if (a.link_gbps) absl::StrAppend(&patch, ", \"wire\": {\"ffn_link_gbps\": ", *a.link_gbps, "}");
  absl::StatusOr<Json> over = Json::Parse(patch + "}");
  if (!over.ok()) return over.status();
  absl::StatusOr<Plan> plan = ParsePlan(Json::Merge(*doc, *over));
  if (!plan.ok())
    return absl::InvalidArgumentError(absl::StrCat(a.plan, ": ", plan.status().message()));
  return plan;
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::Status Run(const Args& a) {
  if (!a.grid.empty()) {
    STEPMESH_ASSIGN_OR_RETURN(const std::vector<GridRow> rows, RunGrid(a.grid));
    std::fputs(FormatGrid(rows).c_str(), stdout);
    return absl::OkStatus();
  }
  STEPMESH_ASSIGN_OR_RETURN(Plan plan, LoadWithOverrides(a));
  CalibrationSamples samples;
  for (const std::string& path : a.perf) {
    STEPMESH_ASSIGN_OR_RETURN(const std::string text, ReadTextFile(path));
    absl::StatusOr<Json> doc = Json::Parse(text);
    if (!doc.ok())
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", doc.status().message()));
    STEPMESH_RETURN_IF_ERROR(AddPerfSamples(*doc, path, a.perf_stat, &samples));
  }
  for (const std::string& path : a.trace) {
    STEPMESH_ASSIGN_OR_RETURN(const std::string text, ReadTextFile(path));
    absl::StatusOr<Json> doc = Json::Parse(text);
    if (!doc.ok())
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", doc.status().message()));
    STEPMESH_RETURN_IF_ERROR(AddTraceSamples(*doc, path, &samples));
  }
  STEPMESH_ASSIGN_OR_RETURN(const Calibration cal, Fit(samples));
  if (!a.perf.empty() || !a.trace.empty() || !plan.has_coefficients) {
    STEPMESH_RETURN_IF_ERROR(ApplyCalibration(cal, &plan));
  }
  std::optional<SimOptions> sim;
  if (a.simulate) sim = a.sim;
  STEPMESH_ASSIGN_OR_RETURN(PlanReport report, BuildReport(plan, a.max_attention, sim));
  if (cal.round_trip) report.fits.push_back({"round trip vs bytes (all servers)", *cal.round_trip});
  if (cal.attention) report.fits.push_back({"attention vs KV tokens", *cal.attention});
  if (cal.ffn) report.fits.push_back({"FFN vs rows", *cal.ffn});
  std::fputs(FormatText(report).c_str(), stdout);
  if (!a.json.empty()) STEPMESH_RETURN_IF_ERROR(WriteFile(a.json, FormatJson(report)));
  if (!a.write_plan.empty()) STEPMESH_RETURN_IF_ERROR(WriteFile(a.write_plan, PlanToJson(plan)));
  return absl::OkStatus();
}

}  // namespace
}  // namespace stepmesh::planner

int main(int argc, char** argv) {
  absl::StatusOr<stepmesh::planner::Args> args = stepmesh::planner::ParseArgs(argc, argv);
  if (!args.ok()) {
    std::fprintf(stderr, "stepmesh_plan: %s\n", std::string(args.status().message()).c_str());
    return 2;
  }
  if (absl::Status s = stepmesh::planner::Run(*args); !s.ok()) {
    std::fprintf(stderr, "stepmesh_plan: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
