// stepmesh_plan: picks the attention/FFN ratio of an AFD deployment
// (docs/planning.md).
//
//   stepmesh_plan PLAN.json [--calibrate-perf PERF.json]... [--calibrate-trace TRACE.json]...
//                 [--perf-stat p50_us|mean_us] [--batch B] [--mu-p P] [--mu-d D]
//                 [--micro-batches M] [--ffn-instances Y] [--layers L] [--max-attention X]
//                 [--simulate [--sim-steps N] [--sim-warmup N] [--seed S]]
//                 [--json OUT.json] [--write-plan OUT.json]
//   stepmesh_plan --validate-grid GRID.json
//   stepmesh_plan PLAN.json|AUTOSCALE.json [autoscale options] --autoscale-out OUT.json
//   stepmesh_plan PLAN.json|AUTOSCALE.json [autoscale options] --watch URL[,URL...]
//                 [--watch-interval-ms N] (--watch-count N | --watch-seconds S)
//                 [--watch-until-gone] [--current xAyF]
//
// PLAN.json holds the six coefficients and the workload (plan.h); the
// coefficients may instead come from measurements: stepmesh_perf --json
// (communication vs bytes) and afd_launch --chrome-trace (attention time vs
// KV tokens, FFN time vs rows), fitted by least squares (R^2 printed).
// Prints the seed's r_A, r_C, r_peak, r* and regime, the full model's
// optimum, the throughput per instance at integer ratios, and the
// communication bound; --json writes what src/tools/planner/plot_plan.py
// draws. --validate-grid runs the simulator over a grid of workloads and
// prints the "within 10 %" table. --autoscale-out writes the plan with a
// grid and a hysteresis rule (autoscale.h) for afd_launch --autoscale;
// --watch reads a running mesh's metrics and recommends shapes (watch.h).

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "src/tools/planner/autoscale.h"
#include "src/tools/planner/calibrate.h"
#include "src/tools/planner/grid.h"
#include "src/tools/planner/json.h"
#include "src/tools/planner/plan.h"
#include "src/tools/planner/report.h"
#include "src/tools/planner/watch.h"
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
    "--emulate-compute)\n"
    "autoscale (docs/planning.md, \"--watch and autoscale\"); PLAN.json may be an autoscale "
    "file:\n"
    "  --autoscale-out FILE     write the (calibrated) plan with the grid and hysteresis below\n"
    "  --autoscale-attention LO:HI  attention instances considered (default 1:8)\n"
    "  --autoscale-ffn LO:HI    FFN instances considered (default: the plan's ffn_instances)\n"
    "  --autoscale-max-instances N  at most N instances in all (default 0: no budget)\n"
    "  --autoscale-batch-policy per_instance|global  slots per attention instance kept, or the "
    "global batch\n"
    "  --autoscale-tpot-ms T    only shapes within this TPOT compete (default: workload.tpot_ms)\n"
    "  --autoscale-gain PCT     change when the best beats the current by PCT % (default 5)\n"
    "  --autoscale-confirmations K  ... in K consecutive observations (default 3)\n"
    "  --watch URL[,URL...]     scrape these metrics endpoints (afd_launch --metrics-port) and\n"
    "                           print one line per observation, and a recommendation line when\n"
    "                           the best integer ratio changes\n"
    "  --watch-interval-ms N    between observations (default 1000)\n"
    "  --watch-count N          stop after N observations\n"
    "  --watch-seconds S        stop after S seconds (one of the two is needed)\n"
    "  --watch-timeout-ms N     deadline of each endpoint's scrape (default 2000)\n"
    "  --watch-until-gone       stop at the first failed scrape after a successful one\n"
    "  --current xAyF           the running shape, when the endpoints cannot tell it\n";

struct Args {
  std::string plan, grid, json, write_plan, perf_stat = "p50_us";
  std::vector<std::string> perf, trace;
  std::optional<double> batch, mu_p, mu_d, micro_batches, ffn_instances, layers, link_gbps;
  int max_attention = 0;
  bool simulate = false;
  SimOptions sim;
  // Autoscale and --watch.
  std::string autoscale_out, batch_policy, watch;
  std::optional<std::pair<int, int>> as_attention, as_ffn, current;
  std::optional<double> as_tpot, as_gain;
  std::optional<int> as_max_instances, as_confirmations;
  int watch_interval_ms = 1000, watch_count = 0, watch_timeout_ms = 2000;
  double watch_seconds = 0;
  bool watch_until_gone = false;
};

// "LO:HI" (both >= 1) into `out`.
absl::Status ParseRange(const std::string& flag, const std::string& value,
                        std::optional<std::pair<int, int>>* out) {
  std::vector<std::string> parts = absl::StrSplit(value, ':');
  int lo = 0, hi = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &lo) || !absl::SimpleAtoi(parts[1], &hi) ||
      lo < 1 || hi < lo) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", value, ": need LO:HI with 1 <= LO <= HI"));
  }
  *out = std::pair{lo, hi};
  return absl::OkStatus();
}

// "xAyF" into `out`.
absl::Status ParseShape(const std::string& flag, const std::string& value,
                        std::optional<std::pair<int, int>>* out) {
  int x = 0, y = 0;
  const size_t a = value.find('A');
  if (a == std::string::npos || value.empty() || value.back() != 'F' ||
      !absl::SimpleAtoi(value.substr(0, a), &x) ||
      !absl::SimpleAtoi(value.substr(a + 1, value.size() - a - 2), &y) || x < 1 || y < 1) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", value, ": need xAyF, e.g. 2A2F"));
  }
  *out = std::pair{x, y};
  return absl::OkStatus();
}

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
    if (flag == "--watch-until-gone") {
      a.watch_until_gone = true;
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
    } else if (flag == "--autoscale-out") {
      a.autoscale_out = value;
    } else if (flag == "--autoscale-attention") {
      STEPMESH_RETURN_IF_ERROR(ParseRange(flag, value, &a.as_attention));
    } else if (flag == "--autoscale-ffn") {
      STEPMESH_RETURN_IF_ERROR(ParseRange(flag, value, &a.as_ffn));
    } else if (flag == "--autoscale-max-instances") {
      int n = 0;
      STEPMESH_RETURN_IF_ERROR(integer(&n, 0));
      a.as_max_instances = n;
    } else if (flag == "--autoscale-batch-policy") {
      a.batch_policy = value;
    } else if (flag == "--autoscale-tpot-ms") {
      STEPMESH_RETURN_IF_ERROR(number(&a.as_tpot));
    } else if (flag == "--autoscale-gain") {
      STEPMESH_RETURN_IF_ERROR(number(&a.as_gain));
    } else if (flag == "--autoscale-confirmations") {
      int n = 0;
      STEPMESH_RETURN_IF_ERROR(integer(&n, 1));
      a.as_confirmations = n;
    } else if (flag == "--watch") {
      a.watch = value;
    } else if (flag == "--watch-interval-ms") {
      STEPMESH_RETURN_IF_ERROR(integer(&a.watch_interval_ms, 1));
    } else if (flag == "--watch-count") {
      STEPMESH_RETURN_IF_ERROR(integer(&a.watch_count, 1));
    } else if (flag == "--watch-timeout-ms") {
      STEPMESH_RETURN_IF_ERROR(integer(&a.watch_timeout_ms, 1));
    } else if (flag == "--watch-seconds") {
      std::optional<double> v;
      STEPMESH_RETURN_IF_ERROR(number(&v));
      if (!(*v > 0)) return absl::InvalidArgumentError("--watch-seconds must be > 0");
      a.watch_seconds = *v;
    } else if (flag == "--current") {
      STEPMESH_RETURN_IF_ERROR(ParseShape(flag, value, &a.current));
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
  const bool autoscale_flags = a.as_attention || a.as_ffn || a.as_max_instances ||
                               !a.batch_policy.empty() || a.as_tpot || a.as_gain ||
                               a.as_confirmations;
  if (autoscale_flags && a.autoscale_out.empty() && a.watch.empty()) {
    return absl::InvalidArgumentError("--autoscale-* options need --autoscale-out or --watch");
  }
  const bool watch_flags = a.watch_count > 0 || a.watch_seconds > 0 || a.watch_until_gone ||
                           a.current || a.watch_interval_ms != 1000 || a.watch_timeout_ms != 2000;
  if (watch_flags && a.watch.empty()) {
    return absl::InvalidArgumentError("--watch-* and --current options need --watch URL[,URL...]");
  }
  if (!a.watch.empty() && a.watch_count == 0 && a.watch_seconds == 0) {
    return absl::InvalidArgumentError("--watch needs --watch-count N or --watch-seconds S");
  }
  if (a.grid.empty() == a.plan.empty()) {
    return absl::InvalidArgumentError("give a plan file or --validate-grid GRID.json (see --help)");
  }
  return a;
}

// Command-line overrides go through the plan file's own checks: they are
// merged into its JSON, so a bad value is reported as the key it sets.
// An autoscale file (autoscale.h: {"autoscale", "plan"}) is read whole, the
// overrides laid over its "plan", and its settings returned in `autoscale`.
absl::StatusOr<Plan> LoadWithOverrides(const Args& a, std::optional<AutoscalePlan>* autoscale) {
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
  absl::StrAppend(&patch, "}");
  const bool is_autoscale = doc->is_object() && doc->Find("plan") != nullptr;
  if (is_autoscale) patch = absl::StrCat("{\"plan\": ", patch, "}");
  absl::StatusOr<Json> over = Json::Parse(patch);
  if (!over.ok()) return over.status();
  if (is_autoscale) {
    absl::StatusOr<AutoscalePlan> as = ParseAutoscalePlan(Json::Merge(*doc, *over));
    if (!as.ok())
      return absl::InvalidArgumentError(absl::StrCat(a.plan, ": ", as.status().message()));
    *autoscale = *as;
    return as->plan;
  }
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

// The autoscale settings: the file's (or defaults: attention 1..8, the
// plan's FFN count, its TPOT target), then the flags; `plan` is the
// (calibrated) model.
absl::StatusOr<AutoscalePlan> BuildAutoscale(const Args& a, const Plan& plan,
                                             const std::optional<AutoscalePlan>& from_file) {
  AutoscalePlan as;
  if (from_file) {
    as = *from_file;
  } else {
    as.min_ffn = as.max_ffn = plan.workload.ffn_instances;
    as.tpot_ms = plan.workload.tpot_ms;
  }
  as.plan = plan;
  if (a.as_attention) std::tie(as.min_attention, as.max_attention) = *a.as_attention;
  if (a.as_ffn) std::tie(as.min_ffn, as.max_ffn) = *a.as_ffn;
  if (a.as_max_instances) as.max_instances = *a.as_max_instances;
  if (a.batch_policy == "per_instance") {
    as.batch_policy = BatchPolicy::kPerInstance;
  } else if (a.batch_policy == "global") {
    as.batch_policy = BatchPolicy::kGlobal;
  } else if (!a.batch_policy.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--autoscale-batch-policy ", a.batch_policy,
                                                   ": must be per_instance or global"));
  }
  if (a.as_tpot) as.tpot_ms = *a.as_tpot;
  if (a.as_gain) as.min_gain_percent = *a.as_gain;
  if (a.as_confirmations) as.confirmations = *a.as_confirmations;
  STEPMESH_RETURN_IF_ERROR(ValidateAutoscalePlan(as));
  return as;
}

absl::Status Watch(const Args& a, const AutoscalePlan& as) {
  WatchOptions o;
  for (absl::string_view u : absl::StrSplit(a.watch, ',', absl::SkipEmpty())) {
    STEPMESH_ASSIGN_OR_RETURN(HttpUrl url, ParseHttpUrl(std::string(u)));
    o.urls.push_back(std::move(url));
  }
  o.interval = absl::Milliseconds(a.watch_interval_ms);
  o.count = a.watch_count;
  o.duration = absl::Seconds(a.watch_seconds);
  o.scrape_timeout = absl::Milliseconds(a.watch_timeout_ms);
  o.shape = a.current;
  o.until_gone = a.watch_until_gone;
  std::printf(
      "watch: %zu endpoint(s) every %d ms; grid %d..%dA x %d..%dF%s, batch %s, TPOT target %s, "
      "change at +%g %% for %d observation(s)\n",
      o.urls.size(), a.watch_interval_ms, as.min_attention, as.max_attention, as.min_ffn,
      as.max_ffn,
      as.max_instances > 0 ? absl::StrCat(", <= ", as.max_instances, " instances").c_str() : "",
      BatchPolicyName(as.batch_policy),
      as.tpot_ms > 0 ? absl::StrCat(as.tpot_ms, " ms").c_str() : "none", as.min_gain_percent,
      as.confirmations);
  STEPMESH_ASSIGN_OR_RETURN(const WatchSummary sum, RunWatch(as, o, stdout, stderr));
  std::printf("watch: %d observation(s), %d failed scrape(s), %d recommendation(s)\n",
              sum.observations, sum.failures, sum.changes);
  return absl::OkStatus();
}

absl::Status Run(const Args& a) {
  if (!a.grid.empty()) {
    STEPMESH_ASSIGN_OR_RETURN(const std::vector<GridRow> rows, RunGrid(a.grid));
    std::fputs(FormatGrid(rows).c_str(), stdout);
    return absl::OkStatus();
  }
  std::optional<AutoscalePlan> from_file;
  STEPMESH_ASSIGN_OR_RETURN(Plan plan, LoadWithOverrides(a, &from_file));
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
  if (!a.watch.empty() || !a.autoscale_out.empty()) {
    STEPMESH_ASSIGN_OR_RETURN(const AutoscalePlan as, BuildAutoscale(a, plan, from_file));
    if (!a.autoscale_out.empty()) {
      STEPMESH_RETURN_IF_ERROR(WriteAutoscalePlan(a.autoscale_out, as));
      std::printf("autoscale plan written to %s\n", a.autoscale_out.c_str());
    }
    if (!a.watch.empty()) return Watch(a, as);
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
