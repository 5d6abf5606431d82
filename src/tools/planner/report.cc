#include "src/tools/planner/report.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/tools/planner/workload.h"
#include "stepmesh/status.h"

namespace stepmesh::planner {
namespace {

Workload WithFfn(const Workload& w, int y) {
  Workload out = w;
  out.ffn_instances = y;
  return out;
}

std::string Num(double v) {
  if (!std::isfinite(v)) return "null";
  return absl::StrFormat("%.6g", v);
}

std::string Quote(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out.push_back('\\');
    if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", c);
      continue;
    }
    out.push_back(c);
  }
  return out + "\"";
}

}  // namespace

RatioRow EvaluateRatio(const Plan& plan, int x, int y) {
  const Workload w = WithFfn(plan.workload, y);
  const std::vector<CycleTerm> seed = CycleTerms(plan.coefficients, w, plan.wire, false);
  const std::vector<CycleTerm> full = CycleTerms(plan.coefficients, w, plan.wire, true);
  RatioRow row;
  row.x = x;
  row.y = y;
  row.r = double(x) / y;
  row.tau_seed = CycleTime(seed, row.r, &row.seed_binding);
  row.tau_full = CycleTime(full, row.r, &row.full_binding);
  row.seed = ThroughputPerInstance(seed, w, row.r);
  row.full = ThroughputPerInstance(full, w, row.r);
  const Hardware& hw = plan.hardware;
  row.full_per_gpu =
      row.full * (x + y) /
      (double(x) * hw.gpus_per_attention_instance + double(y) * hw.gpus_per_ffn_instance);
  Coefficients slowest = plan.coefficients;
  const double excess =
      plan.coefficients.attention.alpha * KvTokensStdDev(w) * ExpectedMaxOfNormals(x);
  slowest.attention.beta += excess;
  row.barrier_t_a = plan.coefficients.attention.At(MeanKvTokens(w)) + excess;
  row.barrier = ThroughputPerInstance(CycleTerms(slowest, w, plan.wire, true), w, row.r);
  row.ffn_utilisation = plan.coefficients.ffn.At(double(x) * w.batch) / y / row.tau_full;
  row.a2f_bytes = double(x) * w.batch * plan.wire.a2f_bytes_per_row;
  row.f2a_bytes = double(x) * w.batch * plan.wire.f2a_bytes_per_row;
  if (w.micro_batches > 0) row.tpot_ms = row.tau_full * w.layers * w.micro_batches * 1e-3;
  if (plan.wire.ffn_link_gbps > 0) {
    row.link_us = std::max(row.a2f_bytes, row.f2a_bytes) * 8 / (plan.wire.ffn_link_gbps * 1e3);
  }
  return row;
}

absl::StatusOr<PlanReport> BuildReport(const Plan& plan, int max_x,
                                       const std::optional<SimOptions>& simulation) {
  STEPMESH_RETURN_IF_ERROR(ValidatePlan(plan));
  PlanReport rep;
  rep.plan = plan;
  rep.simulation = simulation;
  const Workload& w = plan.workload;
  const int y = w.ffn_instances;
  rep.seed = SolveSeed(plan.coefficients, w);
  const std::vector<CycleTerm> full = CycleTerms(plan.coefficients, w, plan.wire, true);
  rep.full = Optimize(full, w);
  rep.link_bound_from = LinkBoundFrom(full);
  if (max_x <= 0) {
    const double r_max = std::max(rep.seed.r_star, rep.full.r);
    max_x = std::max(8, 2 * static_cast<int>(std::ceil(r_max * y)));
  }
  max_x = std::min(max_x, 4096);
  for (int x = 1; x <= max_x; ++x) {
    RatioRow row = EvaluateRatio(plan, x, y);
    if (simulation) {
      SimOptions o = *simulation;
      o.attention = x;
      o.ffn = y;
      STEPMESH_ASSIGN_OR_RETURN(const SimResult sim, Simulate(plan, o));
      row.simulated = sim.tokens_per_s_per_instance;
    }
    rep.ratios.push_back(row);
  }
  auto best = [&](auto value) {
    int best_x = 1;
    double best_v = -1;
    for (const RatioRow& row : rep.ratios) {
      if (value(row) > best_v) best_v = value(row), best_x = row.x;
    }
    return best_x;
  };
  rep.best_x = best([](const RatioRow& r) { return r.full; });
  rep.best_x_seed = best([](const RatioRow& r) { return r.seed; });
  rep.best_x_barrier = best([](const RatioRow& r) { return r.barrier; });
  rep.best_x_per_gpu = best([](const RatioRow& r) { return r.full_per_gpu; });
  if (simulation) rep.best_x_simulated = best([](const RatioRow& r) { return *r.simulated; });
  if (w.tpot_ms > 0) {
    for (const RatioRow& row : rep.ratios) {
      if (row.tpot_ms <= w.tpot_ms &&
          (!rep.best_x_within_tpot || row.full > rep.ratios[*rep.best_x_within_tpot - 1].full)) {
        rep.best_x_within_tpot = row.x;
      }
    }
  }
  for (int yy = 1; yy <= 4; ++yy) rep.ffn_sweep.push_back(EvaluateRatio(plan, rep.best_x, yy));
  return rep;
}

std::string FormatText(const PlanReport& rep) {
  const Plan& p = rep.plan;
  const Coefficients& c = p.coefficients;
  const Workload& w = p.workload;
  std::string out;
  absl::StrAppendFormat(&out, "plan: %s\n", p.name.empty() ? "(unnamed)" : p.name);
  absl::StrAppend(&out, "coefficients (one layer, one micro-batch; microseconds):\n");
  absl::StrAppendFormat(&out, "  attention t_A = %.6g * KV tokens + %.6g\n", c.attention.alpha,
                        c.attention.beta);
  absl::StrAppendFormat(&out, "  comm      t_C = %.6g * rows + %.6g   (A2F = %.2f x t_C)\n",
                        c.comm.alpha, c.comm.beta, c.a2f_fraction);
  absl::StrAppendFormat(&out,
                        "  ffn       t_F = %.6g * rows + %.6g   (whole FFN; /y per instance)\n",
                        c.ffn.alpha, c.ffn.beta);
  for (const auto& [label, f] : rep.fits) {
    absl::StrAppendFormat(&out,
                          "  fitted %s: alpha %.6g, beta %.6g, R^2 %.4f, rmse %.3g us, %d samples "
                          "(%d outliers left out), x in [%.6g, %.6g]\n",
                          label, f.alpha, f.beta, f.r2, f.rmse, f.n, f.rejected, f.x_min, f.x_max);
  }
  absl::StrAppendFormat(
      &out,
      "workload: mu_P %.6g, mu_D %.6g (end probability %.4g), prefill %s, B %d slots per "
      "micro-batch, m %s, L %d layers, y %d FFN instance(s), %s attention\n",
      w.mu_p, w.mu_d, w.EndProbability(), PrefillDistributionName(w.prefill), w.batch,
      w.micro_batches > 0 ? absl::StrCat(w.micro_batches) : "unlimited", w.layers, w.ffn_instances,
      w.context.sparse ? "sparse" : "dense");
  const SeedSolution& s = rep.seed;
  absl::StrAppend(&out, "seed closed form (arXiv 2601.21351, Theorem 4.4):\n");
  absl::StrAppendFormat(&out,
                        "  T-bar %.6g KV tokens per micro-batch; t_A %.4g us, t_C %.4g us, "
                        "beta_F/y %.4g us, alpha_F*B %.4g us\n",
                        s.kv_tokens, s.t_a, s.t_c, s.beta_f, s.alpha_f_b);
  absl::StrAppendFormat(&out, "  r_A %.4g   r_C %.4g   r_peak %.4g   ->  r* = %.4g, %s\n", s.r_a,
                        s.r_c, s.r_peak, s.r_star, RegimeName(s.regime));
  absl::StrAppend(&out, "full model (");
  absl::StrAppend(&out, w.micro_batches > 0
                            ? absl::StrCat(w.micro_batches, " micro-batches in flight")
                            : "no depth bound");
  absl::StrAppend(&out, p.wire.ffn_link_gbps > 0
                            ? absl::StrFormat(", FFN link %.6g Gb/s", p.wire.ffn_link_gbps)
                            : std::string(", no link bound"));
  absl::StrAppendFormat(&out, "): r* = %.4g, %s, %.6g tokens/s per instance\n", rep.full.r,
                        RegimeName(rep.full.regime), rep.full.throughput);
  if (p.wire.ffn_link_gbps > 0) {
    if (rep.link_bound_from > 0) {
      absl::StrAppendFormat(&out,
                            "communication bound: beyond r = %.4g an FFN instance's link, not its "
                            "compute, sets its pace (the dead zone: more attention per FFN adds "
                            "bytes, not FFN work)\n",
                            rep.link_bound_from);
    } else {
      absl::StrAppend(&out, "communication bound: the FFN link is never the FFN's bound here\n");
    }
  }
  const bool sim = rep.best_x_simulated.has_value();
  absl::StrAppendFormat(&out,
                        "integer ratios (y = %d; tokens/s per instance, and per GPU with %d GPUs "
                        "per attention and %d per FFN instance):\n",
                        w.ffn_instances, p.hardware.gpus_per_attention_instance,
                        p.hardware.gpus_per_ffn_instance);
  absl::StrAppendFormat(
      &out, "  %-7s %6s  %10s %-5s %12s  %10s %-5s %12s %12s %10s %7s %8s %10s %10s %9s%s\n",
      "xAyF", "r", "tau_seed", "bind", "seed", "tau_full", "bind", "full", "barrier", "full/GPU",
      "FFN", "TPOT ms", "A2F MB", "F2A MB", "link us", sim ? "    simulated" : "");
  for (const RatioRow& row : rep.ratios) {
    absl::StrAppendFormat(&out,
                          "  %-7s %6.3g  %10.4g %-5s %12.6g  %10.4g %-5s %12.6g %12.6g %10.6g "
                          "%6.0f%% %8.3g %10.4g %10.4g %9.4g",
                          absl::StrCat(row.x, "A", row.y, "F"), row.r, row.tau_seed,
                          RegimeShortName(row.seed_binding), row.seed, row.tau_full,
                          RegimeShortName(row.full_binding), row.full, row.barrier,
                          row.full_per_gpu, 100 * row.ffn_utilisation, row.tpot_ms,
                          row.a2f_bytes / 1e6, row.f2a_bytes / 1e6, row.link_us);
    if (sim) absl::StrAppendFormat(&out, " %12.6g", *row.simulated);
    absl::StrAppend(&out, row.x == rep.best_x ? "  <- best (full model)" : "", "\n");
  }
  absl::StrAppendFormat(&out,
                        "FFN instances at %dA (t_F per instance shrinks with y; the link time does "
                        "not, every instance receives every row):\n",
                        rep.ffn_sweep.empty() ? 0 : rep.ffn_sweep.front().x);
  for (const RatioRow& row : rep.ffn_sweep) {
    absl::StrAppendFormat(
        &out, "  %dA%dF: t_F %.4g us, link %.4g us, tau %.4g us (%s), %.6g tokens/s per instance\n",
        row.x, row.y, p.coefficients.ffn.At(double(row.x) * w.batch) / row.y, row.link_us,
        row.tau_full, RegimeName(row.full_binding), row.full);
  }
  absl::StrAppendFormat(&out, "recommendation: %dA%dF (full model)", rep.best_x, w.ffn_instances);
  if (rep.best_x_barrier != rep.best_x) {
    absl::StrAppendFormat(&out, "; with the barrier priced in %dA%dF", rep.best_x_barrier,
                          w.ffn_instances);
  }
  if (rep.best_x_per_gpu != rep.best_x) {
    absl::StrAppendFormat(&out, "; per GPU %dA%dF", rep.best_x_per_gpu, w.ffn_instances);
  }
  if (rep.best_x_seed != rep.best_x) {
    absl::StrAppendFormat(&out, "; the seed's model alone says %dA%dF", rep.best_x_seed,
                          w.ffn_instances);
  }
  if (sim) {
    absl::StrAppendFormat(&out, "; the simulator's best is %dA%dF", *rep.best_x_simulated,
                          w.ffn_instances);
  }
  if (w.tpot_ms > 0) {
    if (rep.best_x_within_tpot) {
      absl::StrAppendFormat(&out, "; within TPOT %.4g ms: %dA%dF", w.tpot_ms,
                            *rep.best_x_within_tpot, w.ffn_instances);
    } else {
      absl::StrAppendFormat(&out, "; no ratio meets TPOT %.4g ms", w.tpot_ms);
    }
  }
  absl::StrAppend(&out, "\n");
  return out;
}

std::string FormatJson(const PlanReport& rep) {
  const Plan& p = rep.plan;
  const Coefficients& c = p.coefficients;
  const Workload& w = p.workload;
  std::string out = "{\n  \"tool\": \"stepmesh_plan\",\n";
  absl::StrAppend(&out, "  \"name\": ", Quote(p.name), ",\n");
  absl::StrAppend(&out, "  \"coefficients\": {\"attention\": {\"alpha_us_per_token\": ",
                  Num(c.attention.alpha), ", \"beta_us\": ", Num(c.attention.beta),
                  "}, \"comm\": {\"alpha_us_per_row\": ", Num(c.comm.alpha),
                  ", \"beta_us\": ", Num(c.comm.beta), ", \"a2f_fraction\": ", Num(c.a2f_fraction),
                  "}, \"ffn\": {\"alpha_us_per_row\": ", Num(c.ffn.alpha),
                  ", \"beta_us\": ", Num(c.ffn.beta), "}},\n");
  absl::StrAppend(&out, "  \"workload\": {\"mu_p\": ", Num(w.mu_p), ", \"mu_d\": ", Num(w.mu_d),
                  ", \"batch\": ", w.batch, ", \"micro_batches\": ", w.micro_batches,
                  ", \"layers\": ", w.layers, ", \"ffn_instances\": ", w.ffn_instances,
                  ", \"prefill\": ", Quote(PrefillDistributionName(w.prefill)),
                  ", \"sparse\": ", w.context.sparse ? "true" : "false", "},\n");
  absl::StrAppend(&out, "  \"fits\": [");
  for (size_t i = 0; i < rep.fits.size(); ++i) {
    const auto& [label, f] = rep.fits[i];
    absl::StrAppend(&out, i ? ", " : "", "{\"what\": ", Quote(label), ", \"alpha\": ", Num(f.alpha),
                    ", \"beta\": ", Num(f.beta), ", \"r2\": ", Num(f.r2), ", \"n\": ", f.n, "}");
  }
  absl::StrAppend(&out, "],\n");
  const SeedSolution& s = rep.seed;
  absl::StrAppend(&out, "  \"seed\": {\"kv_tokens\": ", Num(s.kv_tokens),
                  ", \"t_a_us\": ", Num(s.t_a), ", \"t_c_us\": ", Num(s.t_c),
                  ", \"beta_f_us\": ", Num(s.beta_f), ", \"alpha_f_b_us\": ", Num(s.alpha_f_b),
                  ", \"r_a\": ", Num(s.r_a), ", \"r_c\": ", Num(s.r_c),
                  ", \"r_peak\": ", Num(s.r_peak), ", \"r_star\": ", Num(s.r_star),
                  ", \"regime\": ", Quote(RegimeName(s.regime)), "},\n");
  absl::StrAppend(&out, "  \"full\": {\"r_star\": ", Num(rep.full.r),
                  ", \"regime\": ", Quote(RegimeName(rep.full.regime)),
                  ", \"throughput\": ", Num(rep.full.throughput),
                  ", \"link_bound_from\": ", Num(rep.link_bound_from), ", \"best_x\": ", rep.best_x,
                  ", \"best_x_seed\": ", rep.best_x_seed,
                  ", \"best_x_barrier\": ", rep.best_x_barrier,
                  ", \"best_x_per_gpu\": ", rep.best_x_per_gpu);
  if (rep.best_x_simulated)
    absl::StrAppend(&out, ", \"best_x_simulated\": ", *rep.best_x_simulated);
  if (rep.best_x_within_tpot)
    absl::StrAppend(&out, ", \"best_x_within_tpot\": ", *rep.best_x_within_tpot);
  absl::StrAppend(&out, "},\n");
  // The curve for the plot: the seed's and the full model's throughput per
  // instance, which bound binds, and what the link alone would allow.
  const double r_max = rep.ratios.empty() ? 8.0 : rep.ratios.back().r;
  const Workload& wy = w;
  const std::vector<CycleTerm> seed_terms = CycleTerms(c, wy, p.wire, false);
  const std::vector<CycleTerm> full_terms = CycleTerms(c, wy, p.wire, true);
  absl::StrAppend(&out, "  \"curve\": [\n");
  constexpr int kPoints = 400;
  for (int i = 1; i <= kPoints; ++i) {
    const double r = r_max * i / kPoints;
    Regime seed_binding, full_binding;
    CycleTime(seed_terms, r, &seed_binding);
    CycleTime(full_terms, r, &full_binding);
    double link_only = 0;
    for (const CycleTerm& t : full_terms) {
      if (t.regime == Regime::kFfnLink)
        link_only = r * w.batch / ((r + 1) * w.layers * t.At(r)) * 1e6;
    }
    absl::StrAppend(&out, "    {\"r\": ", Num(r),
                    ", \"seed\": ", Num(ThroughputPerInstance(seed_terms, wy, r)),
                    ", \"full\": ", Num(ThroughputPerInstance(full_terms, wy, r)),
                    ", \"seed_bound\": ", Quote(RegimeShortName(seed_binding)),
                    ", \"full_bound\": ", Quote(RegimeShortName(full_binding)),
                    ", \"link_only\": ", Num(link_only), "}", i < kPoints ? "," : "", "\n");
  }
  absl::StrAppend(&out, "  ],\n  \"ratios\": [\n");
  for (size_t i = 0; i < rep.ratios.size(); ++i) {
    const RatioRow& row = rep.ratios[i];
    absl::StrAppend(&out, "    {\"x\": ", row.x, ", \"y\": ", row.y, ", \"r\": ", Num(row.r),
                    ", \"seed\": ", Num(row.seed), ", \"full\": ", Num(row.full),
                    ", \"barrier\": ", Num(row.barrier),
                    ", \"seed_bound\": ", Quote(RegimeShortName(row.seed_binding)),
                    ", \"full_bound\": ", Quote(RegimeShortName(row.full_binding)),
                    ", \"tau_seed_us\": ", Num(row.tau_seed),
                    ", \"tau_full_us\": ", Num(row.tau_full),
                    ", \"ffn_utilisation\": ", Num(row.ffn_utilisation),
                    ", \"tpot_ms\": ", Num(row.tpot_ms), ", \"a2f_bytes\": ", Num(row.a2f_bytes),
                    ", \"f2a_bytes\": ", Num(row.f2a_bytes), ", \"link_us\": ", Num(row.link_us));
    if (row.simulated) absl::StrAppend(&out, ", \"simulated\": ", Num(*row.simulated));
    absl::StrAppend(&out, "}", i + 1 < rep.ratios.size() ? "," : "", "\n");
  }
  absl::StrAppend(&out, "  ]\n}\n");
  return out;
}

}  // namespace stepmesh::planner
