// Least squares and calibration: known coefficients are recovered from
// synthetic noisy samples, written in the formats the tools emit.

#include "src/tools/planner/fit.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "src/tools/planner/calibrate.h"
#include "src/tools/planner/workload.h"

namespace stepmesh::planner {
namespace {

// Zero-mean noise with standard deviation `sd` (Box-Muller on the planner's
// fixed-algorithm generator, so the samples are the same everywhere).
double Gaussian(Rng& rng, double sd) {
  const double u1 = 1.0 - rng.Uniform(), u2 = rng.Uniform();
  return sd * std::sqrt(-2.0 * std::log(u1)) * std::cos(2 * M_PI * u2);
}

TEST_CASE("a line is recovered within 2% from noisy samples", "[planner][fit]") {
  struct Case {
    const char* what;
    double alpha, beta, x_lo, x_hi, noise;  // noise: relative standard deviation
  };
  // 2% relative Gaussian noise (a calibration run's stage times on a quiet
  // machine), 1000 samples spread over the sizes a run visits.
  for (const Case& c : {Case{"attention us vs KV tokens", 4.15e-5, 111, 2e5, 8e6, 0.02},
                        Case{"FFN us vs rows", 0.11, 300, 64, 4096, 0.02},
                        Case{"round trip us vs bytes", 2.1e-4, 35, 4096, 4e6, 0.02}}) {
    Rng rng(99);
    std::vector<double> x, y;
    for (int i = 0; i < 1000; ++i) {
      const double xi = c.x_lo + (c.x_hi - c.x_lo) * rng.Uniform();
      const double yi = c.alpha * xi + c.beta;
      x.push_back(xi);
      y.push_back(yi * (1 + Gaussian(rng, c.noise)));
    }
    absl::StatusOr<LinearFit> fit = FitLine(x, y, c.what);
    REQUIRE(fit.ok());
    std::printf("fit %-26s alpha %.4g (true %.4g)  beta %.4g (true %.4g)  R^2 %.4f  n %zu\n",
                c.what, fit->alpha, c.alpha, fit->beta, c.beta, fit->r2, fit->n);
    INFO(c.what);
    CHECK(fit->alpha == Approx(c.alpha).epsilon(0.02));
    CHECK(fit->beta == Approx(c.beta).epsilon(0.02));
    CHECK(fit->r2 > 0.9);
    CHECK(fit->r2 <= 1.0);
  }
}

TEST_CASE("the robust fit leaves out late wake-ups that pull an ordinary fit", "[planner][fit]") {
  // FFN batch times with 2 % noise; one in twenty delayed by 2-20 ms.
  Rng rng(31);
  std::vector<double> x, y;
  for (int i = 0; i < 800; ++i) {
    const double rows = (i % 2) ? 64 : 192;
    double t = (1.5625 * rows + 3000) * 3 * (1 + Gaussian(rng, 0.02));
    if (i % 20 == 1) t += 2000 + 18000 * rng.Uniform();  // at 64 rows (i odd)
    x.push_back(rows);
    y.push_back(t);
  }
  absl::StatusOr<LinearFit> plain = FitLine(x, y, "ffn");
  absl::StatusOr<LinearFit> robust = FitLineRobust(x, y, "ffn");
  REQUIRE(plain.ok());
  REQUIRE(robust.ok());
  std::printf(
      "late wake-ups: ordinary alpha %.4g beta %.4g R^2 %.3f; robust alpha %.4g beta %.4g "
      "R^2 %.3f (%zu left out)\n",
      plain->alpha, plain->beta, plain->r2, robust->alpha, robust->beta, robust->r2,
      robust->rejected);
  CHECK(plain->alpha < 0);  // the delays at 64 rows tilt the ordinary fit
  CHECK(robust->alpha == Approx(1.5625 * 3).epsilon(0.1));
  CHECK(robust->beta == Approx(3000 * 3).epsilon(0.02));
  CHECK(robust->rejected >= 40);  // the 40 delayed ones, and a few noisy ones at most
  CHECK(robust->rejected <= 60);
  // Clean samples lose nothing.
  absl::StatusOr<LinearFit> exact = FitLineRobust({1, 2, 3, 4}, {3, 5, 7, 9}, "exact");
  REQUIRE(exact.ok());
  CHECK(exact->rejected == 0);
}

TEST_CASE("an exact line fits with R^2 = 1 and bad inputs are refused by name", "[planner][fit]") {
  absl::StatusOr<LinearFit> exact = FitLine({1, 2, 3}, {5, 7, 9}, "exact");
  REQUIRE(exact.ok());
  CHECK(exact->alpha == Approx(2));
  CHECK(exact->beta == Approx(3));
  CHECK(exact->r2 == Approx(1));

  absl::StatusOr<LinearFit> one = FitLine({1}, {2}, "ffn");
  REQUIRE_FALSE(one.ok());
  CHECK(std::string(one.status().message()).find("ffn: need at least 2 samples") == 0);
  absl::StatusOr<LinearFit> flat = FitLine({4, 4, 4}, {1, 2, 3}, "attention");
  REQUIRE_FALSE(flat.ok());
  CHECK(std::string(flat.status().message()).find("x does not vary") != std::string::npos);
  CHECK_FALSE(FitLine({1, 2}, {1}, "x").ok());
  CHECK_FALSE(FitLine({1, NAN}, {1, 2}, "x").ok());
}

// stepmesh_perf --json, as benchmarks/perf_report.cc writes it (trimmed to
// the fields the calibration reads, plus a baseline it must ignore).
std::string PerfJson(double a, double b, Rng& rng) {
  std::string out =
      R"({"tool": "stepmesh_perf", "config": {"pattern": "2A2F", "servers": 2}, "results": [)";
  bool first = true;
  // The default sweep's shape: powers of two from 8 B to 2 MiB pushed, twice
  // that pulled; 1% noise (each row is itself a median of many samples).
  for (double push = 8; push <= 2097152; push *= 2) {
    const double pull = 2 * push;
    const double us = (a * (push + pull) + b) * (1 + Gaussian(rng, 0.01));
    absl::StrAppend(&out, first ? "" : ",", R"({"push_bytes": )", push, R"(, "pull_bytes": )", pull,
                    R"(, "methods": [{"method": "stepmesh", "available": true, "latency": )",
                    R"({"p50_us": )", us, R"(, "mean_us": )", us * 1.1, "}},",
                    R"({"method": "raw-tcp", "available": true, "latency": {"p50_us": 1}}]})");
    first = false;
  }
  return out + "]}";
}

// afd_launch --chrome-trace with the planner's args: decode attention stages
// and FFN batches, some of which queue behind the previous batch.
std::string TraceJson(double aa, double ba, double af, double bf, Rng& rng) {
  std::string out =
      R"({"traceEvents":[{"name":"process_name","ph":"M","pid":1,"args":{"name":"attention 0"}})";
  double ffn_free = 0;
  for (int i = 0; i < 300; ++i) {
    const int step = 1 + i % 40;
    const double kv = 3 * (64 + step) * (1 + i % 7) * 10;
    const double rows = 3 * (1 + i % 5) * (i % 2 ? 1 : 20);
    const double t_attn = (aa * kv + ba) * (1 + Gaussian(rng, 0.02));
    const double t_ffn = (af * rows + bf) * (1 + Gaussian(rng, 0.02));
    const double ts = 1000.0 * i;
    // Every third batch arrives while the previous one still computes.
    const double arrival = (i % 3 == 0 && i > 0) ? ffn_free - 50 : std::max(ts, ffn_free + 5);
    const double begin = std::max(arrival, ffn_free);
    ffn_free = begin + t_ffn;
    absl::StrAppend(&out, R"(,{"name":"attention s)", step,
                    R"( L0 mb0","ph":"X","pid":1,"tid":1,"ts":)", ts, R"(,"dur":)", t_attn,
                    R"(,"args":{"step":)", step, R"(,"layer":0,"mb":0,"rows":)", rows / 3,
                    R"(,"kv_tokens":)", kv, "}}");
    // The FFN event spans handler (arrival) to reply, queueing included.
    absl::StrAppend(&out, R"(,{"name":"FFN s)", step,
                    R"( L0 mb0","ph":"X","pid":100,"tid":1,"ts":)", arrival, R"(,"dur":)",
                    ffn_free - arrival, R"(,"args":{"rows":)", rows, "}}");
  }
  // A prefill stage (step 0) is left out of the attention fit.
  absl::StrAppend(&out,
                  R"(,{"name":"attention s0 L0 mb0","ph":"X","pid":1,"tid":1,"ts":0,"dur":1e6,)",
                  R"("args":{"step":0,"layer":0,"mb":0,"rows":96,"kv_tokens":96}})");
  return out + "]}";
}

TEST_CASE("calibration recovers the coefficients from perf and trace JSON", "[planner][fit]") {
  Rng rng(4242);
  const double a = 3.0e-4, b = 40;
  const double aa = 0.02, ba = 150, af = 12, bf = 400;
  absl::StatusOr<Json> perf = Json::Parse(PerfJson(a, b, rng));
  absl::StatusOr<Json> trace = Json::Parse(TraceJson(aa, ba, af, bf, rng));
  REQUIRE(perf.ok());
  REQUIRE(trace.ok());
  CalibrationSamples samples;
  REQUIRE(AddPerfSamples(*perf, "perf.json", "p50_us", &samples).ok());
  REQUIRE(AddTraceSamples(*trace, "trace.json", &samples).ok());
  CHECK(samples.round_trip.x.size() == 19);
  CHECK(samples.attention.x.size() == 300);
  CHECK(samples.ffn.x.size() == 300);
  absl::StatusOr<Calibration> cal = Fit(samples);
  REQUIRE(cal.ok());
  std::printf("calibration: round trip R^2 %.4f, attention R^2 %.4f, FFN R^2 %.4f\n",
              cal->round_trip->r2, cal->attention->r2, cal->ffn->r2);
  // Two servers: the worker's link carries twice the per-server bytes.
  CHECK(cal->round_trip->alpha == Approx(a / 2).epsilon(0.02));
  CHECK(cal->round_trip->beta == Approx(b).epsilon(0.02));
  CHECK(cal->attention->alpha == Approx(aa).epsilon(0.02));
  CHECK(cal->attention->beta == Approx(ba).epsilon(0.02));
  // The queueing in front of a third of the batches is removed.
  CHECK(cal->ffn->alpha == Approx(af).epsilon(0.02));
  CHECK(cal->ffn->beta == Approx(bf).epsilon(0.02));

  Plan plan;
  plan.workload.batch = 128;
  plan.wire = {7400, 14336, 0};
  REQUIRE(ApplyCalibration(*cal, &plan).ok());
  CHECK(plan.has_coefficients);
  CHECK(plan.coefficients.comm.alpha == Approx(cal->round_trip->alpha * 14336));
  CHECK(plan.coefficients.comm.beta == Approx(cal->round_trip->beta / 2));
  CHECK(plan.coefficients.a2f_fraction > 0.4);
  CHECK(plan.coefficients.a2f_fraction < 0.6);
}

TEST_CASE("calibration refuses foreign or incomplete inputs", "[planner][fit]") {
  CalibrationSamples samples;
  absl::StatusOr<Json> not_perf = Json::Parse(R"({"results": []})");
  REQUIRE(not_perf.ok());
  absl::Status s = AddPerfSamples(*not_perf, "x.json", "p50_us", &samples);
  CHECK(std::string(s.message()).find("x.json: not stepmesh_perf") == 0);
  absl::StatusOr<Json> old_trace =
      Json::Parse(R"({"traceEvents":[{"name":"attention s1 L0 mb0","ph":"X","ts":1,"dur":2}]})");
  REQUIRE(old_trace.ok());
  s = AddTraceSamples(*old_trace, "t.json", &samples);
  CHECK(std::string(s.message()).find("no rows/kv_tokens args") != std::string::npos);

  // Only a trace: no comm coefficients for a plan that has none.
  Rng rng(1);
  absl::StatusOr<Json> trace = Json::Parse(TraceJson(0.02, 150, 12, 400, rng));
  REQUIRE(AddTraceSamples(*trace, "t.json", &samples).ok());
  absl::StatusOr<Calibration> cal = Fit(samples);
  REQUIRE(cal.ok());
  Plan plan;
  s = ApplyCalibration(*cal, &plan);
  CHECK(std::string(s.message()).find("comm (--calibrate-perf)") != std::string::npos);
}

}  // namespace
}  // namespace stepmesh::planner
