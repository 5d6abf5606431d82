// The seed's closed form (arXiv 2601.21351 Theorem 4.4) against direct
// numerical maximisation of the throughput it optimises, and the full
// model's envelope optimiser against the same brute force.

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>

#include "src/tools/planner/ratio.h"
#include "src/tools/planner/workload.h"

namespace stepmesh::planner {
namespace {

Coefficients Make(double aa, double ba, double ac, double bc, double af, double bf) {
  Coefficients c;
  c.attention = {aa, ba};
  c.comm = {ac, bc};
  c.ffn = {af, bf};
  return c;
}

Workload Dense(double mu_p, double mu_d, int batch) {
  Workload w;
  w.mu_p = mu_p;
  w.mu_d = mu_d;
  w.batch = batch;
  return w;
}

// f(r) = r*B / ((r+1) * max{t_A, t_C, alpha_F*r*B + beta_F}), straight from
// the seed's definitions (no code shared with ratio.cc); with y FFN
// instances t_C carries y partials and each instance has beta_F/y.
double SeedThroughput(const Coefficients& c, const Workload& w, double r) {
  const double t_a = c.attention.alpha * w.batch * (w.mu_p + w.mu_d) + c.attention.beta;
  const double t_c = c.comm.alpha * w.batch * w.ffn_instances + c.comm.beta;
  const double t_f = c.ffn.alpha * r * w.batch + c.ffn.beta / w.ffn_instances;
  return r * w.batch / ((r + 1) * std::max({t_a, t_c, t_f}));
}

// The argmax of `f` on a fine grid in (0, hi].
template <typename F>
double GridArgmax(F f, double hi, double step) {
  double best_r = step, best = -1;
  for (double r = step; r <= hi; r += step) {
    const double v = f(r);
    if (v > best) best = v, best_r = r;
  }
  return best_r;
}

TEST_CASE("each regime of the closed form is reachable", "[planner][closed_form]") {
  const Workload w = Dense(200, 300, 32);  // T-bar = 16000
  SECTION("attention-bound: r* = r_A = (t_A - beta_F)/(alpha_F B)") {
    // t_A = 0.05*16000 + 100 = 900; beta_F = 100, alpha_F*B = 32*1 = 32.
    const SeedSolution s = SolveSeed(Make(0.05, 100, 0.1, 10, 1.0, 100), w);
    CHECK(s.kv_tokens == 16000);
    CHECK(s.t_a == Approx(900));
    CHECK(s.r_a == Approx(25.0));
    CHECK(s.r_peak == Approx(std::sqrt(100.0 / 32)));
    CHECK(s.regime == Regime::kAttention);
    CHECK(s.r_star == s.r_a);
  }
  SECTION("communication-bound: r* = r_C") {
    // t_C = 20*32 + 60 = 700 > t_A = 0.001*16000 + 10 = 26.
    const SeedSolution s = SolveSeed(Make(0.001, 10, 20, 60, 1.0, 100), w);
    CHECK(s.t_c == Approx(700));
    CHECK(s.r_c == Approx(600.0 / 32));
    CHECK(s.regime == Regime::kCommunication);
    CHECK(s.r_star == s.r_c);
  }
  SECTION("FFN-bound: r* = r_peak = sqrt(beta_F/(alpha_F B))") {
    // t_A and t_C below beta_F: r_A, r_C < 0.
    const SeedSolution s = SolveSeed(Make(0.001, 10, 0.1, 10, 0.5, 800), w);
    CHECK(s.r_a < 0);
    CHECK(s.r_c < 0);
    CHECK(s.r_peak == Approx(std::sqrt(800.0 / 16)));
    CHECK(s.regime == Regime::kFfn);
    CHECK(s.r_star == s.r_peak);
  }
  SECTION("y FFN instances divide beta_F") {
    Workload w2 = w;
    w2.ffn_instances = 4;
    const SeedSolution s = SolveSeed(Make(0.001, 10, 0.1, 10, 0.5, 800), w2);
    CHECK(s.beta_f == Approx(200));
    CHECK(s.r_peak == Approx(std::sqrt(200.0 / 16)));
  }
}

TEST_CASE("r_peak is the numerical argmax of the FFN-bound f(r)", "[planner][closed_form]") {
  for (auto [af, bf, batch] :
       {std::tuple{0.5, 800.0, 16}, {0.11, 300.0, 1024}, {2.0, 50.0, 8}, {0.01, 5000.0, 64}}) {
    const Coefficients c = Make(0, 0, 0, 0, af, bf);  // t_A = t_C = 0: always FFN-bound
    const Workload w = Dense(1, 1, batch);
    const SeedSolution s = SolveSeed(c, w);
    const double hi = 20 * s.r_peak;
    const double step = s.r_peak * 1e-4;
    const double argmax = GridArgmax([&](double r) { return SeedThroughput(c, w, r); }, hi, step);
    INFO("alpha_F " << af << " beta_F " << bf << " B " << batch);
    CHECK(argmax == Approx(s.r_peak).epsilon(2e-4));
  }
}

TEST_CASE("r* = max{r_A, r_C, r_peak} is the argmax of f over random coefficients",
          "[planner][closed_form]") {
  Rng rng(20260601);
  auto log_uniform = [&](double lo, double hi) { return lo * std::pow(hi / lo, rng.Uniform()); };
  int regimes[3] = {0, 0, 0};
  for (int trial = 0; trial < 300; ++trial) {
    const Coefficients c =
        Make(log_uniform(1e-6, 1e-2), log_uniform(1, 1000), log_uniform(1e-3, 10),
             log_uniform(1, 1000), log_uniform(1e-3, 10), log_uniform(1, 5000));
    Workload w = Dense(log_uniform(10, 10000), log_uniform(10, 5000),
                       static_cast<int>(log_uniform(1, 4096)));
    w.ffn_instances = 1 + trial % 3;
    const SeedSolution s = SolveSeed(c, w);
    if (s.r_star > 200 || s.r_star < 0.05) continue;  // keep the grid search affordable
    ++regimes[static_cast<int>(s.regime)];
    const double step = s.r_star * 2e-4;
    const double argmax =
        GridArgmax([&](double r) { return SeedThroughput(c, w, r); }, 4 * s.r_star + 1, step);
    INFO("trial " << trial << " r_A " << s.r_a << " r_C " << s.r_c << " r_peak " << s.r_peak);
    CHECK(argmax == Approx(s.r_star).epsilon(5e-4));
    // The envelope optimiser on the seed's three terms is the same optimum.
    const Optimum o = Optimize(CycleTerms(c, w, {}, /*full=*/false), w);
    CHECK(o.r == Approx(s.r_star).epsilon(1e-9));
    CHECK(o.regime == s.regime);
  }
  // The random draws visit every regime.
  CHECK(regimes[0] > 10);
  CHECK(regimes[1] > 10);
  CHECK(regimes[2] > 10);
}

TEST_CASE("the full model's optimiser finds the argmax with depth and link bounds",
          "[planner][closed_form]") {
  Rng rng(7);
  int regimes[5] = {0, 0, 0, 0, 0};
  for (int trial = 0; trial < 200; ++trial) {
    Coefficients c = Make(1e-4 * (0.2 + rng.Uniform()), 100 * rng.Uniform(), 0.2 * rng.Uniform(),
                          50 * rng.Uniform(), 0.1 * (0.1 + rng.Uniform()), 500 * rng.Uniform());
    c.a2f_fraction = rng.Uniform();
    Workload w = Dense(4000 * rng.Uniform(), 1000 * rng.Uniform(), 1 + int(512 * rng.Uniform()));
    w.micro_batches = 1 + trial % 4;
    w.layers = 61;
    WireModel wire{7400, 14336, trial % 2 ? 100.0 + 3000 * rng.Uniform() : 0.0};
    const std::vector<CycleTerm> terms = CycleTerms(c, w, wire, /*full=*/true);
    const Optimum o = Optimize(terms, w);
    REQUIRE(o.r > 0);
    if (o.r > 100) continue;
    ++regimes[static_cast<int>(o.regime)];
    const double step = o.r * 2e-4;
    const double argmax =
        GridArgmax([&](double r) { return ThroughputPerInstance(terms, w, r); }, 4 * o.r + 1, step);
    INFO("trial " << trial);
    CHECK(argmax == Approx(o.r).epsilon(5e-4));
    CHECK(ThroughputPerInstance(terms, w, argmax) <= o.throughput * (1 + 1e-12));
  }
  CHECK(regimes[static_cast<int>(Regime::kPipelineDepth)] > 0);
  CHECK(regimes[static_cast<int>(Regime::kFfnLink)] + regimes[static_cast<int>(Regime::kFfn)] > 0);
}

TEST_CASE("the link bound marks where the FFN stops being compute-bound",
          "[planner][closed_form]") {
  const Coefficients c = Make(0, 0, 0, 0, 0.1, 300);
  Workload w = Dense(1, 1, 1024);
  // 1024 rows * 14336 B at 100 Gb/s = 1174 us per r; FFN grows 102.4 us per r.
  const WireModel wire{7400, 14336, 100};
  const std::vector<CycleTerm> terms = CycleTerms(c, w, wire, true);
  const double r_link = LinkBoundFrom(terms);
  const double per_r = 1024 * 14336 * 8 / 100e3;
  CHECK(r_link == Approx(300 / (per_r - 102.4)));
  Regime below, above;
  CycleTime(terms, r_link * 0.9, &below);
  CycleTime(terms, r_link * 1.1, &above);
  CHECK(below == Regime::kFfn);
  CHECK(above == Regime::kFfnLink);
}

TEST_CASE("sparse attention flattens the token load in context length", "[planner][closed_form]") {
  ContextModel sparse;
  sparse.sparse = true;
  // Up to the window every layer is dense.
  CHECK(sparse.EffectiveTokens(400) == Approx(400 * (1 + 0.25 * sparse.index_ratio)));
  // Past the budget only the indexer grows: 0.25 * 32/3072 per token.
  const double slope = sparse.EffectiveTokens(200000) - sparse.EffectiveTokens(100000);
  CHECK(slope == Approx(100000 * 0.25 * 32.0 / 3072));

  Workload w = Dense(8000, 2000, 64);
  w.context = sparse;
  w.prefill = PrefillDistribution::kExponential;
  // The quadrature expectation against the stationary slots' sample mean.
  double sum = 0;
  const int batches = 400;
  for (int i = 0; i < batches; ++i) sum += SlotBatch(w, w.batch, 1000 + i, true).KvTokens();
  CHECK(MeanKvTokens(w) == Approx(sum / batches).epsilon(0.01));
  Workload dense = w;
  dense.context = ContextModel{};
  CHECK(MeanKvTokens(dense) == Approx(64 * 10000.0));
  CHECK(MeanKvTokens(w) < 0.2 * MeanKvTokens(dense));
}

}  // namespace
}  // namespace stepmesh::planner

namespace stepmesh::planner {
namespace {

TEST_CASE("the barrier refinement's ingredients", "[planner][closed_form]") {
  // Known order statistics of the standard normal.
  CHECK(ExpectedMaxOfNormals(1) == 0);
  CHECK(ExpectedMaxOfNormals(2) == Approx(1 / std::sqrt(M_PI)).epsilon(1e-4));
  CHECK(ExpectedMaxOfNormals(3) == Approx(0.846284).epsilon(1e-4));
  CHECK(ExpectedMaxOfNormals(10) == Approx(1.538753).epsilon(1e-4));
  // The token load's spread against stationary slot batches' sample spread.
  for (bool sparse : {false, true}) {
    for (PrefillDistribution d : {PrefillDistribution::kFixed, PrefillDistribution::kUniform,
                                  PrefillDistribution::kExponential}) {
      Workload w;
      w.mu_p = 3000;
      w.mu_d = 800;
      w.batch = 16;
      w.prefill = d;
      w.context.sparse = sparse;
      double sum = 0, sum2 = 0;
      const int n = 4000;
      for (int i = 0; i < n; ++i) {
        const double t = SlotBatch(w, w.batch, 5000 + i, true).KvTokens();
        sum += t;
        sum2 += t * t;
      }
      const double sd = std::sqrt(sum2 / n - (sum / n) * (sum / n));
      INFO("sparse " << sparse << " prefill " << PrefillDistributionName(d));
      CHECK(KvTokensStdDev(w) == Approx(sd).epsilon(0.05));
    }
  }
}

}  // namespace
}  // namespace stepmesh::planner
