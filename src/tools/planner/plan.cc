#include "src/tools/planner/plan.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "src/tools/planner/object_reader.h"
#include "stepmesh/status.h"

namespace stepmesh::planner {

namespace {

// Each distribution's name in a plan file (workload.prefill) and in the report.
constexpr std::pair<PrefillDistribution, const char*> kPrefillNames[] = {
    {PrefillDistribution::kFixed, "fixed"},
    {PrefillDistribution::kUniform, "uniform"},
    {PrefillDistribution::kExponential, "exponential"}};

}  // namespace

const char* PrefillDistributionName(PrefillDistribution d) {
  for (const auto& [distribution, name] : kPrefillNames) {
    if (distribution == d) return name;
  }
  return "?";
}

double ContextModel::EffectiveTokens(double c) const {
  if (!sparse) return c;
  return global_fraction * (std::min(c, budget) + c * index_ratio) +
         (1.0 - global_fraction) * std::min(c, window);
}

double CommTime(const Coefficients& c, const Workload& w) {
  return c.comm.At(double(w.batch) * w.ffn_instances);
}

namespace {

constexpr double kBig = 1e15;

absl::Status ParseLinear(ObjectReader& parent, absl::string_view key, absl::string_view alpha_key,
                         Linear* out) {
  ObjectReader r(parent.Get(key), parent.Path(key));
  STEPMESH_RETURN_IF_ERROR(r.CheckIsObject());
  if (!r.present())
    return absl::InvalidArgumentError(absl::StrCat(parent.Path(key), " is missing"));
  STEPMESH_RETURN_IF_ERROR(r.Number(alpha_key, 0, kBig, &out->alpha, /*required=*/true));
  STEPMESH_RETURN_IF_ERROR(r.Number("beta_us", 0, kBig, &out->beta, /*required=*/true));
  return r.CheckAllRead();
}

}  // namespace

absl::StatusOr<Plan> ParsePlan(const Json& doc) {
  if (!doc.is_object()) return absl::InvalidArgumentError("a plan must be a JSON object");
  Plan plan;
  ObjectReader top(&doc, "");
  STEPMESH_RETURN_IF_ERROR(top.String("name", &plan.name));
  std::string notes;
  STEPMESH_RETURN_IF_ERROR(top.String("notes", &notes));

  ObjectReader coeffs(top.Get("coefficients"), "coefficients");
  STEPMESH_RETURN_IF_ERROR(coeffs.CheckIsObject());
  if (coeffs.present()) {
    plan.has_coefficients = true;
    Coefficients& c = plan.coefficients;
    STEPMESH_RETURN_IF_ERROR(ParseLinear(coeffs, "attention", "alpha_us_per_token", &c.attention));
    STEPMESH_RETURN_IF_ERROR(ParseLinear(coeffs, "ffn", "alpha_us_per_row", &c.ffn));
    ObjectReader comm(coeffs.Get("comm"), "coefficients.comm");
    STEPMESH_RETURN_IF_ERROR(comm.CheckIsObject());
    if (!comm.present()) return absl::InvalidArgumentError("coefficients.comm is missing");
    STEPMESH_RETURN_IF_ERROR(comm.Number("alpha_us_per_row", 0, kBig, &c.comm.alpha, true));
    STEPMESH_RETURN_IF_ERROR(comm.Number("beta_us", 0, kBig, &c.comm.beta, true));
    STEPMESH_RETURN_IF_ERROR(comm.Number("a2f_fraction", 0, 1, &c.a2f_fraction));
    STEPMESH_RETURN_IF_ERROR(comm.CheckAllRead());
    STEPMESH_RETURN_IF_ERROR(coeffs.CheckAllRead());
  }

  ObjectReader wl(top.Get("workload"), "workload");
  STEPMESH_RETURN_IF_ERROR(wl.CheckIsObject());
  if (!wl.present()) return absl::InvalidArgumentError("workload is missing");
  Workload& w = plan.workload;
  STEPMESH_RETURN_IF_ERROR(wl.Number("mu_p", 0, kBig, &w.mu_p, true));
  STEPMESH_RETURN_IF_ERROR(wl.Number("mu_d", 0, kBig, &w.mu_d, true));
  STEPMESH_RETURN_IF_ERROR(wl.Int("batch", 1, 1 << 24, &w.batch, true));
  STEPMESH_RETURN_IF_ERROR(wl.Int("micro_batches", 0, 1024, &w.micro_batches));
  STEPMESH_RETURN_IF_ERROR(wl.Int("layers", 1, 100000, &w.layers));
  STEPMESH_RETURN_IF_ERROR(wl.Int("ffn_instances", 1, 4096, &w.ffn_instances));
  STEPMESH_RETURN_IF_ERROR(wl.Number("tpot_ms", 0, kBig, &w.tpot_ms));
  if (w.tpot_ms > 0 && w.micro_batches == 0) {
    return absl::InvalidArgumentError(
        "workload.tpot_ms needs workload.micro_batches (a step is m cycles of every layer)");
  }
  std::string prefill = PrefillDistributionName(w.prefill);
  STEPMESH_RETURN_IF_ERROR(wl.String("prefill", &prefill));
  const auto named = std::find_if(std::begin(kPrefillNames), std::end(kPrefillNames),
                                  [&](const auto& row) { return prefill == row.second; });
  if (named == std::end(kPrefillNames)) {
    return absl::InvalidArgumentError(absl::StrCat("workload.prefill = \"", prefill,
                                                   "\": must be fixed, uniform or exponential"));
  }
  w.prefill = named->first;
  STEPMESH_RETURN_IF_ERROR(wl.CheckAllRead());

  ObjectReader ctx(top.Get("attention_context"), "attention_context");
  STEPMESH_RETURN_IF_ERROR(ctx.CheckIsObject());
  if (ctx.present()) {
    std::string kind = "dense";
    STEPMESH_RETURN_IF_ERROR(ctx.String("kind", &kind));
    ContextModel& m = w.context;
    if (kind == "sparse") {
      m.sparse = true;
      STEPMESH_RETURN_IF_ERROR(ctx.Number("window", 0, kBig, &m.window));
      STEPMESH_RETURN_IF_ERROR(ctx.Number("budget", 0, kBig, &m.budget));
      STEPMESH_RETURN_IF_ERROR(ctx.Number("global_fraction", 0, 1, &m.global_fraction));
      STEPMESH_RETURN_IF_ERROR(ctx.Number("index_ratio", 0, 1, &m.index_ratio));
    } else if (kind != "dense") {
      return absl::InvalidArgumentError(
          absl::StrCat("attention_context.kind = \"", kind, "\": must be dense or sparse"));
    }
    STEPMESH_RETURN_IF_ERROR(ctx.CheckAllRead());
  }

  ObjectReader model(top.Get("model"), "model");
  STEPMESH_RETURN_IF_ERROR(model.CheckIsObject());
  STEPMESH_RETURN_IF_ERROR(model.Int("hidden", 1, 1 << 20, &plan.hidden));
  STEPMESH_RETURN_IF_ERROR(model.Int("top_k", 0, 1024, &plan.top_k));
  STEPMESH_RETURN_IF_ERROR(model.Int("fp8_group", 1, 1 << 20, &plan.fp8_group));
  STEPMESH_RETURN_IF_ERROR(model.CheckAllRead());
  if (plan.hidden > 0) {
    // The example's wire (docs/example.md): FP8 codes, one fp32 scale per
    // group, int32 ids and fp32 weights of the top-k out; a BF16 partial back.
    plan.wire.a2f_bytes_per_row =
        plan.hidden + 4.0 * std::ceil(double(plan.hidden) / plan.fp8_group) + 8.0 * plan.top_k;
    plan.wire.f2a_bytes_per_row = 2.0 * plan.hidden;
  }

  ObjectReader wire(top.Get("wire"), "wire");
  STEPMESH_RETURN_IF_ERROR(wire.CheckIsObject());
  STEPMESH_RETURN_IF_ERROR(wire.Number("a2f_bytes_per_row", 0, kBig, &plan.wire.a2f_bytes_per_row));
  STEPMESH_RETURN_IF_ERROR(wire.Number("f2a_bytes_per_row", 0, kBig, &plan.wire.f2a_bytes_per_row));
  STEPMESH_RETURN_IF_ERROR(wire.Number("ffn_link_gbps", 0, kBig, &plan.wire.ffn_link_gbps));
  STEPMESH_RETURN_IF_ERROR(wire.CheckAllRead());

  ObjectReader hw(top.Get("hardware"), "hardware");
  STEPMESH_RETURN_IF_ERROR(hw.CheckIsObject());
  STEPMESH_RETURN_IF_ERROR(hw.Int("gpus_per_attention_instance", 1, 1 << 20,
                                  &plan.hardware.gpus_per_attention_instance));
  STEPMESH_RETURN_IF_ERROR(
      hw.Int("gpus_per_ffn_instance", 1, 1 << 20, &plan.hardware.gpus_per_ffn_instance));
  STEPMESH_RETURN_IF_ERROR(hw.CheckAllRead());

  ObjectReader emu(top.Get("emulation"), "emulation");
  STEPMESH_RETURN_IF_ERROR(emu.CheckIsObject());
  STEPMESH_RETURN_IF_ERROR(emu.Number("time_scale", 1e-3, 1e6, &plan.emulation.time_scale));
  double seed = static_cast<double>(plan.emulation.seed);
  STEPMESH_RETURN_IF_ERROR(emu.Number("seed", 0, 9007199254740992.0, &seed));
  plan.emulation.seed = static_cast<uint64_t>(seed);
  STEPMESH_RETURN_IF_ERROR(emu.CheckAllRead());

  STEPMESH_RETURN_IF_ERROR(top.CheckAllRead());
  if (plan.has_coefficients) STEPMESH_RETURN_IF_ERROR(ValidatePlan(plan));
  return plan;
}

absl::Status ValidatePlan(const Plan& plan) {
  const Coefficients& c = plan.coefficients;
  if (!(c.ffn.alpha > 0)) {
    // With a flat t_F more attention per FFN is always better: no optimum.
    return absl::InvalidArgumentError(
        "coefficients.ffn.alpha_us_per_row must be > 0 (an FFN time that does not grow with the "
        "batch has no optimal ratio)");
  }
  if (plan.wire.ffn_link_gbps > 0 && plan.wire.a2f_bytes_per_row <= 0 &&
      plan.wire.f2a_bytes_per_row <= 0) {
    return absl::InvalidArgumentError(
        "wire.ffn_link_gbps needs bytes per row: give model.hidden (and top_k) or "
        "wire.a2f_bytes_per_row / wire.f2a_bytes_per_row");
  }
  return absl::OkStatus();
}

std::string PlanToJson(const Plan& p) {
  auto num = [](double v) { return absl::StrFormat("%.10g", v); };
  const Coefficients& c = p.coefficients;
  const Workload& w = p.workload;
  std::string name;
  for (char ch : p.name) {
    if (ch == '"' || ch == '\\') name.push_back('\\');
    if (static_cast<unsigned char>(ch) >= 0x20) name.push_back(ch);
  }
  std::string out = absl::StrCat("{\n  \"name\": \"", name, "\",\n");
  if (p.has_coefficients) {
    absl::StrAppend(&out, "  \"coefficients\": {\n    \"attention\": {\"alpha_us_per_token\": ",
                    num(c.attention.alpha), ", \"beta_us\": ", num(c.attention.beta),
                    "},\n    \"comm\": {\"alpha_us_per_row\": ", num(c.comm.alpha),
                    ", \"beta_us\": ", num(c.comm.beta),
                    ", \"a2f_fraction\": ", num(c.a2f_fraction),
                    "},\n    \"ffn\": {\"alpha_us_per_row\": ", num(c.ffn.alpha),
                    ", \"beta_us\": ", num(c.ffn.beta), "}\n  },\n");
  }
  absl::StrAppend(&out, "  \"workload\": {\"mu_p\": ", num(w.mu_p), ", \"mu_d\": ", num(w.mu_d),
                  ", \"prefill\": \"", PrefillDistributionName(w.prefill),
                  "\", \"batch\": ", w.batch, ", \"micro_batches\": ", w.micro_batches,
                  ", \"layers\": ", w.layers, ", \"ffn_instances\": ", w.ffn_instances,
                  ", \"tpot_ms\": ", num(w.tpot_ms), "},\n");
  const ContextModel& m = w.context;
  if (m.sparse) {
    absl::StrAppend(
        &out, "  \"attention_context\": {\"kind\": \"sparse\", \"window\": ", num(m.window),
        ", \"budget\": ", num(m.budget), ", \"global_fraction\": ", num(m.global_fraction),
        ", \"index_ratio\": ", num(m.index_ratio), "},\n");
  }
  absl::StrAppend(&out, "  \"wire\": {\"a2f_bytes_per_row\": ", num(p.wire.a2f_bytes_per_row),
                  ", \"f2a_bytes_per_row\": ", num(p.wire.f2a_bytes_per_row),
                  ", \"ffn_link_gbps\": ", num(p.wire.ffn_link_gbps), "},\n");
  absl::StrAppend(&out, "  \"hardware\": {\"gpus_per_attention_instance\": ",
                  p.hardware.gpus_per_attention_instance,
                  ", \"gpus_per_ffn_instance\": ", p.hardware.gpus_per_ffn_instance, "},\n");
  absl::StrAppend(&out, "  \"emulation\": {\"time_scale\": ", num(p.emulation.time_scale),
                  ", \"seed\": ", p.emulation.seed, "}\n}\n");
  return out;
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<Plan> LoadPlan(const std::string& path) {
  STEPMESH_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  absl::StatusOr<Json> doc = Json::Parse(text);
  if (!doc.ok())
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", doc.status().message()));
  absl::StatusOr<Plan> plan = ParsePlan(*doc);
  if (!plan.ok())
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", plan.status().message()));
  return plan;
}

}  // namespace stepmesh::planner
