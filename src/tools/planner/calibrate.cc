#include "src/tools/planner/calibrate.h"

#include <algorithm>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "stepmesh/status.h"

namespace stepmesh::planner {
namespace {

absl::StatusOr<double> NumberAt(const Json& obj, absl::string_view key, const std::string& where) {
  const Json* v = obj.Find(key);
  if (v == nullptr || !v->is_number()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"", key, "\" missing or not a number"));
  }
  return v->number();
}

void Add(Samples* s, double x, double y, const std::string& source) {
  s->x.push_back(x);
  s->y.push_back(y);
  if (s->sources.empty() || s->sources.back() != source) s->sources.push_back(source);
}

}  // namespace

absl::Status AddPerfSamples(const Json& doc, const std::string& source, const std::string& stat,
                            CalibrationSamples* out) {
  const Json* tool = doc.Find("tool");
  if (tool == nullptr || !tool->is_string() || tool->string() != "stepmesh_perf") {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not stepmesh_perf --json output (no \"tool\": \"stepmesh_perf\")"));
  }
  const Json* results = doc.Find("results");
  if (results == nullptr || !results->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": no \"results\" array"));
  }
  // The round trip moves every server's bytes through the worker's link.
  double servers = 1;
  if (const Json* config = doc.Find("config"); config != nullptr) {
    if (const Json* n = config->Find("servers");
        n != nullptr && n->is_number() && n->number() >= 1) {
      servers = n->number();
    }
  }
  size_t added = 0;
  for (size_t i = 0; i < results->array().size(); ++i) {
    const Json& r = results->array()[i];
    const std::string where = absl::StrCat(source, ": results[", i, "]");
    STEPMESH_ASSIGN_OR_RETURN(const double push, NumberAt(r, "push_bytes", where));
    STEPMESH_ASSIGN_OR_RETURN(const double pull, NumberAt(r, "pull_bytes", where));
    const Json* methods = r.Find("methods");
    if (methods == nullptr || !methods->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": no \"methods\" array"));
    }
    for (const Json& m : methods->array()) {
      const Json* name = m.Find("method");
      const Json* available = m.Find("available");
      if (name == nullptr || !name->is_string() || name->string() != "stepmesh") continue;
      if (available != nullptr && available->is_bool() && !available->boolean()) continue;
      const Json* latency = m.Find("latency");
      if (latency == nullptr || !latency->is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": stepmesh has no \"latency\""));
      }
      STEPMESH_ASSIGN_OR_RETURN(const double us, NumberAt(*latency, stat, where + ".latency"));
      Add(&out->round_trip, (push + pull) * servers, us, source);
      ++added;
    }
  }
  if (added == 0) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": no \"stepmesh\" results to fit"));
  }
  return absl::OkStatus();
}

absl::Status AddTraceSamples(const Json& doc, const std::string& source, CalibrationSamples* out) {
  const Json* events = doc.Find("traceEvents");
  if (events == nullptr || !events->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not a Chrome trace (no \"traceEvents\" array)"));
  }
  struct FfnBatch {
    double begin, end, rows;
  };
  std::map<int, std::vector<FfnBatch>> ffn_by_server;
  size_t attention_events = 0, with_args = 0;
  for (size_t i = 0; i < events->array().size(); ++i) {
    const Json& e = events->array()[i];
    const Json* name = e.Find("name");
    const Json* ph = e.Find("ph");
    if (name == nullptr || !name->is_string() || ph == nullptr || !ph->is_string() ||
        ph->string() != "X") {
      continue;
    }
    const bool attention = absl::StartsWith(name->string(), "attention ");
    const bool ffn = absl::StartsWith(name->string(), "FFN ");
    if (!attention && !ffn) continue;
    attention_events += attention;
    const std::string where = absl::StrCat(source, ": traceEvents[", i, "] (", name->string(), ")");
    const Json* args = e.Find("args");
    if (args == nullptr || !args->is_object() || args->Find("rows") == nullptr) continue;
    ++with_args;
    STEPMESH_ASSIGN_OR_RETURN(const double ts, NumberAt(e, "ts", where));
    STEPMESH_ASSIGN_OR_RETURN(const double dur, NumberAt(e, "dur", where));
    STEPMESH_ASSIGN_OR_RETURN(const double rows, NumberAt(*args, "rows", where + ".args"));
    if (attention) {
      STEPMESH_ASSIGN_OR_RETURN(const double step, NumberAt(*args, "step", where + ".args"));
      STEPMESH_ASSIGN_OR_RETURN(const double kv, NumberAt(*args, "kv_tokens", where + ".args"));
      // Decode steps only: a prefill stage attends causally over its own
      // prompt, a different cost than one new token over a cache.
      if (step >= 1) Add(&out->attention, kv, dur, source);
    } else {
      STEPMESH_ASSIGN_OR_RETURN(const double pid, NumberAt(e, "pid", where));
      ffn_by_server[static_cast<int>(pid)].push_back({ts, ts + dur, rows});
    }
  }
  if (with_args == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": ",
                     attention_events > 0 ? "events carry no rows/kv_tokens args (written by an "
                                            "afd_launch older than the planner)"
                                          : "no attention or FFN events"));
  }
  for (auto& [server, batches] : ffn_by_server) {
    std::sort(batches.begin(), batches.end(),
              [](const FfnBatch& a, const FfnBatch& b) { return a.begin < b.begin; });
    double previous_end = -1e300;
    for (const FfnBatch& b : batches) {
      const double begin = std::max(b.begin, previous_end);
      if (b.end > begin) Add(&out->ffn, b.rows, b.end - begin, source);
      previous_end = std::max(previous_end, b.end);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Calibration> Fit(const CalibrationSamples& s) {
  Calibration cal;
  auto fit = [](const Samples& samples, const char* what,
                std::optional<LinearFit>* out) -> absl::Status {
    if (samples.x.empty()) return absl::OkStatus();
    STEPMESH_ASSIGN_OR_RETURN(*out, FitLineRobust(samples.x, samples.y, what));
    return absl::OkStatus();
  };
  STEPMESH_RETURN_IF_ERROR(
      fit(s.round_trip, "round trip vs bytes (stepmesh_perf)", &cal.round_trip));
  STEPMESH_RETURN_IF_ERROR(fit(s.attention, "attention time vs KV tokens (trace)", &cal.attention));
  STEPMESH_RETURN_IF_ERROR(fit(s.ffn, "FFN time vs rows (trace)", &cal.ffn));
  return cal;
}

absl::Status ApplyCalibration(const Calibration& cal, Plan* plan) {
  Coefficients& c = plan->coefficients;
  std::vector<std::string> missing;
  if (cal.attention) c.attention = {cal.attention->alpha, cal.attention->beta};
  if (cal.ffn) c.ffn = {cal.ffn->alpha, cal.ffn->beta};
  if (cal.round_trip) {
    const double a2f = plan->wire.a2f_bytes_per_row, f2a = plan->wire.f2a_bytes_per_row;
    if (a2f + f2a <= 0) {
      return absl::InvalidArgumentError(
          "a stepmesh_perf calibration needs the bytes per row: give model.hidden (and top_k) or "
          "wire.a2f_bytes_per_row / wire.f2a_bytes_per_row in the plan");
    }
    const double a = cal.round_trip->alpha, b = cal.round_trip->beta;
    c.comm = {a * f2a, b / 2};
    const double t_c = CommTime(c, plan->workload);
    const double rows = double(plan->workload.batch) * plan->workload.ffn_instances;
    c.a2f_fraction = t_c > 0 ? std::min(1.0, (a * rows * a2f + b / 2) / t_c) : 1.0;
  }
  if (!plan->has_coefficients) {
    if (!cal.attention) missing.push_back("attention (--calibrate-trace)");
    if (!cal.round_trip) missing.push_back("comm (--calibrate-perf)");
    if (!cal.ffn) missing.push_back("ffn (--calibrate-trace)");
    if (!missing.empty()) {
      std::string list;
      for (const std::string& m : missing) absl::StrAppend(&list, list.empty() ? "" : ", ", m);
      return absl::InvalidArgumentError(
          absl::StrCat("the plan has no \"coefficients\" and calibration did not give: ", list));
    }
    plan->has_coefficients = true;
  }
  // Fitted intercepts can come out slightly negative under noise; a
  // negative fixed cost has no meaning in the model.
  for (Linear* l : {&c.attention, &c.comm, &c.ffn}) l->beta = std::max(0.0, l->beta);
  return ValidatePlan(*plan);
}

}  // namespace stepmesh::planner
