#include "src/tools/planner/autoscale.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/tools/planner/object_reader.h"
#include "src/tools/planner/report.h"
#include "stepmesh/status.h"

namespace stepmesh::planner {

const char* BatchPolicyName(BatchPolicy policy) {
  switch (policy) {
    case BatchPolicy::kPerInstance:
      return "per_instance";
    case BatchPolicy::kGlobal:
      return "global";
  }
  return "?";
}

namespace {

constexpr int kMaxInstancesOfAKind = 4096;

// "key": [lo, hi] with integers lo <= hi in [1, kMaxInstancesOfAKind].
absl::Status IntRange(ObjectReader& r, absl::string_view key, int* lo, int* hi) {
  const Json* v = r.Get(key);
  if (v == nullptr) return absl::OkStatus();
  const std::string path = r.Path(key);
  if (!v->is_array() || v->array().size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " must be an array [lo, hi], not ",
                     v->is_array() ? "an array of another size" : JsonTypeName(v->type())));
  }
  int out[2];
  for (int i = 0; i < 2; ++i) {
    const Json& e = v->array()[i];
    if (!e.is_number() || e.number() != std::floor(e.number()) || e.number() < 1 ||
        e.number() > kMaxInstancesOfAKind) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, "[", i, "] must be an integer in [1, ", kMaxInstancesOfAKind, "]"));
    }
    out[i] = static_cast<int>(e.number());
  }
  if (out[0] > out[1]) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " = [", out[0], ", ", out[1], "]: lo must not exceed hi"));
  }
  *lo = out[0];
  *hi = out[1];
  return absl::OkStatus();
}

bool SameShape(const RatioPrediction& a, const RatioPrediction& b) {
  return a.attention == b.attention && a.ffn == b.ffn;
}

}  // namespace

absl::Status ValidateAutoscalePlan(const AutoscalePlan& p) {
  if (!p.plan.has_coefficients) {
    return absl::InvalidArgumentError(
        "plan.coefficients is missing (an autoscale plan carries calibrated coefficients: "
        "stepmesh_plan PLAN.json [--calibrate-...] --autoscale-out FILE)");
  }
  STEPMESH_RETURN_IF_ERROR(ValidatePlan(p.plan));
  auto range = [](absl::string_view key, int lo, int hi) -> absl::Status {
    if (lo >= 1 && hi >= lo && hi <= kMaxInstancesOfAKind) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("autoscale.", key, " = [", lo, ", ", hi,
                     "] must satisfy 1 <= lo <= hi <= ", kMaxInstancesOfAKind));
  };
  STEPMESH_RETURN_IF_ERROR(range("attention", p.min_attention, p.max_attention));
  STEPMESH_RETURN_IF_ERROR(range("ffn", p.min_ffn, p.max_ffn));
  if (p.max_instances < 0 ||
      (p.max_instances > 0 && p.max_instances < p.min_attention + p.min_ffn)) {
    return absl::InvalidArgumentError(
        absl::StrCat("autoscale.max_instances = ", p.max_instances,
                     ": must be 0 (no budget) or at least the smallest shape (",
                     p.min_attention + p.min_ffn, " instances)"));
  }
  if (!(p.min_gain_percent >= 0 && p.min_gain_percent <= 1000)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "autoscale.min_gain_percent = %g is outside [0, 1000]", p.min_gain_percent));
  }
  if (p.confirmations < 1 || p.confirmations > 1000) {
    return absl::InvalidArgumentError(
        absl::StrCat("autoscale.confirmations = ", p.confirmations, " is outside [1, 1000]"));
  }
  if (!(p.tpot_ms >= 0 && p.tpot_ms <= 1e9)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("autoscale.tpot_ms = %g is outside [0, 1e9]", p.tpot_ms));
  }
  if (p.tpot_ms > 0 && p.plan.workload.micro_batches == 0) {
    return absl::InvalidArgumentError(
        "autoscale.tpot_ms needs plan.workload.micro_batches (a step is m cycles of every layer)");
  }
  return absl::OkStatus();
}

absl::StatusOr<AutoscalePlan> ParseAutoscalePlan(const Json& doc) {
  if (!doc.is_object())
    return absl::InvalidArgumentError("an autoscale plan must be a JSON object");
  ObjectReader top(&doc, "");
  AutoscalePlan out;
  const Json* plan = top.Get("plan");
  if (plan == nullptr) return absl::InvalidArgumentError("plan is missing");
  absl::StatusOr<Plan> parsed = ParsePlan(*plan);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("plan: ", parsed.status().message()));
  }
  out.plan = *std::move(parsed);

  ObjectReader as(top.Get("autoscale"), "autoscale");
  STEPMESH_RETURN_IF_ERROR(as.CheckIsObject());
  STEPMESH_RETURN_IF_ERROR(IntRange(as, "attention", &out.min_attention, &out.max_attention));
  STEPMESH_RETURN_IF_ERROR(IntRange(as, "ffn", &out.min_ffn, &out.max_ffn));
  STEPMESH_RETURN_IF_ERROR(
      as.Int("max_instances", 0, 2 * kMaxInstancesOfAKind, &out.max_instances));
  std::string policy = BatchPolicyName(out.batch_policy);
  STEPMESH_RETURN_IF_ERROR(as.String("batch_policy", &policy));
  if (policy == "per_instance") {
    out.batch_policy = BatchPolicy::kPerInstance;
  } else if (policy == "global") {
    out.batch_policy = BatchPolicy::kGlobal;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("autoscale.batch_policy = \"", policy, "\": must be per_instance or global"));
  }
  STEPMESH_RETURN_IF_ERROR(as.Number("tpot_ms", 0, 1e9, &out.tpot_ms));
  STEPMESH_RETURN_IF_ERROR(as.Number("min_gain_percent", 0, 1000, &out.min_gain_percent));
  STEPMESH_RETURN_IF_ERROR(as.Int("confirmations", 1, 1000, &out.confirmations));
  STEPMESH_RETURN_IF_ERROR(as.CheckAllRead());
  STEPMESH_RETURN_IF_ERROR(top.CheckAllRead());
  STEPMESH_RETURN_IF_ERROR(ValidateAutoscalePlan(out));
  return out;
}

absl::StatusOr<AutoscalePlan> ReadAutoscalePlan(const std::string& path) {
  STEPMESH_ASSIGN_OR_RETURN(const std::string text, ReadTextFile(path));
  absl::StatusOr<Json> doc = Json::Parse(text);
  if (!doc.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", doc.status().message()));
  }
  absl::StatusOr<AutoscalePlan> plan = ParseAutoscalePlan(*doc);
  if (!plan.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", plan.status().message()));
  }
  return plan;
}

std::string AutoscalePlanToJson(const AutoscalePlan& p) {
  return absl::StrFormat(
      "{\n\"autoscale\": {\"attention\": [%d, %d], \"ffn\": [%d, %d], \"max_instances\": %d, "
      "\"batch_policy\": \"%s\", \"tpot_ms\": %.10g, \"min_gain_percent\": %.10g, "
      "\"confirmations\": %d},\n\"plan\": %s}\n",
      p.min_attention, p.max_attention, p.min_ffn, p.max_ffn, p.max_instances,
      BatchPolicyName(p.batch_policy), p.tpot_ms, p.min_gain_percent, p.confirmations,
      PlanToJson(p.plan));
}

absl::Status WriteAutoscalePlan(const std::string& path, const AutoscalePlan& plan) {
  STEPMESH_RETURN_IF_ERROR(ValidateAutoscalePlan(plan));
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << AutoscalePlanToJson(plan);
  out.close();
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::StatusOr<RatioPrediction> Predict(const AutoscalePlan& plan, const ObservedWorkload& observed,
                                        int observed_attention, int x, int y) {
  if (!(observed.mean_context >= 0 && std::isfinite(observed.mean_context))) {
    return absl::InvalidArgumentError(
        absl::StrCat("observed mean_context = ", observed.mean_context, ": must be >= 0"));
  }
  if (!(observed.batch > 0 && std::isfinite(observed.batch))) {
    return absl::InvalidArgumentError(
        absl::StrCat("observed batch = ", observed.batch, ": must be > 0"));
  }
  if (!(observed.mean_decode >= 0 && std::isfinite(observed.mean_decode))) {
    return absl::InvalidArgumentError(
        absl::StrCat("observed mean_decode = ", observed.mean_decode, ": must be >= 0"));
  }
  if (observed_attention < 1 || x < 1 || y < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("shapes need at least one instance of each kind: observed at ",
                     observed_attention, " attention instances, asked for ", ShapeName(x, y)));
  }
  Plan p = plan.plan;
  Workload& w = p.workload;
  // The model's mean KV tokens per slot is mu_P + mu_D: put the observed
  // context there, keeping mu_D (observed or planned) when it fits.
  const double mu_d = observed.mean_decode > 0 ? observed.mean_decode : w.mu_d;
  w.mu_d = std::min(mu_d, observed.mean_context);
  w.mu_p = observed.mean_context - w.mu_d;
  const double slots = plan.batch_policy == BatchPolicy::kGlobal
                           ? observed.batch * observed_attention / x
                           : observed.batch;
  w.batch = static_cast<int>(std::clamp(std::round(slots), 1.0, double(1 << 24)));
  w.ffn_instances = y;
  const RatioRow row = EvaluateRatio(p, x, y);
  RatioPrediction out;
  out.attention = x;
  out.ffn = y;
  out.batch = w.batch;
  out.cycle_us = row.tau_full;
  out.throughput_per_instance = row.full;
  out.tpot_ms = row.tpot_ms;
  out.binding = row.full_binding;
  out.meets_tpot = plan.tpot_ms <= 0 || row.tpot_ms <= plan.tpot_ms;
  return out;
}

absl::StatusOr<Recommendation> Recommend(const AutoscalePlan& plan,
                                         const ObservedWorkload& observed, int current_a,
                                         int current_f) {
  STEPMESH_RETURN_IF_ERROR(ValidateAutoscalePlan(plan));
  Recommendation rec;
  STEPMESH_ASSIGN_OR_RETURN(rec.current, Predict(plan, observed, current_a, current_a, current_f));
  bool have_best = false;
  for (int y = plan.min_ffn; y <= plan.max_ffn; ++y) {
    for (int x = plan.min_attention; x <= plan.max_attention; ++x) {
      if (plan.max_instances > 0 && x + y > plan.max_instances) break;
      STEPMESH_ASSIGN_OR_RETURN(const RatioPrediction c, Predict(plan, observed, current_a, x, y));
      // A candidate that meets the TPOT target beats one that does not;
      // then throughput per instance; a tie keeps the smaller shape (found
      // first).
      const bool better =
          !have_best || (c.meets_tpot && !rec.best.meets_tpot) ||
          (c.meets_tpot == rec.best.meets_tpot &&
           c.throughput_per_instance > rec.best.throughput_per_instance * (1 + 1e-12));
      if (better) {
        rec.best = c;
        have_best = true;
      }
    }
  }
  rec.gain = rec.current.throughput_per_instance > 0
                 ? rec.best.throughput_per_instance / rec.current.throughput_per_instance - 1
                 : 0;
  rec.favours_change = !SameShape(rec.best, rec.current) &&
                       ((rec.best.meets_tpot && !rec.current.meets_tpot) ||
                        (rec.best.meets_tpot == rec.current.meets_tpot &&
                         rec.gain * 100 >= plan.min_gain_percent && rec.gain > 0));
  rec.streak = rec.favours_change ? 1 : 0;
  rec.changed = rec.favours_change && plan.confirmations <= 1;
  rec.recommended = rec.changed ? rec.best : rec.current;
  return rec;
}

AutoscaleController::AutoscaleController(AutoscalePlan plan, int current_a, int current_f)
    : plan_(std::move(plan)), a_(current_a), f_(current_f) {}

absl::StatusOr<Recommendation> AutoscaleController::Observe(const ObservedWorkload& observed) {
  STEPMESH_ASSIGN_OR_RETURN(Recommendation rec, Recommend(plan_, observed, a_, f_));
  const int streak = rec.favours_change ? streak_ + 1 : 0;
  rec.streak = streak;
  rec.changed = rec.favours_change && streak >= plan_.confirmations;
  rec.recommended = rec.changed ? rec.best : rec.current;
  if (rec.changed) {
    a_ = rec.best.attention;
    f_ = rec.best.ffn;
    streak_ = 0;
  } else {
    streak_ = streak;
  }
  return rec;
}

void AutoscaleController::SetCurrent(int a, int f) {
  a_ = a;
  f_ = f;
  streak_ = 0;
}

std::string ShapeName(int attention, int ffn) { return absl::StrCat(attention, "A", ffn, "F"); }

std::string FormatChange(const Recommendation& rec) {
  const RatioPrediction& from = rec.current;
  const RatioPrediction& to = rec.best;
  std::string line = absl::StrFormat(
      "recommend %s (was %s): %.6g -> %.6g tokens/s per instance (%+.1f %%), cycle %.4g -> "
      "%.4g us",
      ShapeName(to.attention, to.ffn), ShapeName(from.attention, from.ffn),
      from.throughput_per_instance, to.throughput_per_instance, rec.gain * 100, from.cycle_us,
      to.cycle_us);
  if (to.tpot_ms > 0) {
    absl::StrAppendFormat(&line, ", TPOT %.4g -> %.4g ms", from.tpot_ms, to.tpot_ms);
  }
  return line;
}

}  // namespace stepmesh::planner
