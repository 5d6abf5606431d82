// The discrete-event simulator: queueing sanity (Little's law), the seed's
// workload facts, determinism, and agreement with the closed form where the
// closed form's assumptions hold (low variance, enough micro-batches).

#include "src/tools/planner/simulator.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>

#include "src/tools/planner/ratio.h"
#include "src/tools/planner/workload.h"

namespace stepmesh::planner {
namespace {

Plan BasePlan() {
  Plan p;
  p.has_coefficients = true;
  p.coefficients.attention = {0.02, 200};
  p.coefficients.comm = {0.5, 20};
  p.coefficients.ffn = {2.0, 600};
  p.coefficients.a2f_fraction = 0.5;
  p.workload.mu_p = 300;
  p.workload.mu_d = 20;
  p.workload.batch = 32;
  p.workload.micro_batches = 3;
  p.workload.layers = 4;
  return p;
}

TEST_CASE("Little's law: slots = completion rate x time in system", "[planner][simulator]") {
  for (int x : {1, 3}) {
    Plan p = BasePlan();
    SimOptions o;
    o.attention = x;
    o.warmup_steps = 200;  // start-up requests (mean 21 steps) are long gone
    o.measure_steps = 2000;
    absl::StatusOr<SimResult> r = Simulate(p, o);
    REQUIRE(r.ok());
    const double little = r->completion_rate_per_us * r->mean_residence_us;
    std::printf("Little %dA1F: slots %.0f, lambda*W %.1f (%lld requests), tokens/request %.2f\n", x,
                r->slots, little, static_cast<long long>(r->completed), r->mean_tokens_per_request);
    CHECK(little == Approx(r->slots).epsilon(0.03));
    // Every slot emits a token per step and a request ends with p = 1/(1+mu_D).
    CHECK(r->mean_tokens_per_request == Approx(p.workload.mu_d + 1).epsilon(0.03));
    // The horizon-average token load (the seed's Proposition 4.3).
    CHECK(r->mean_kv_tokens ==
          Approx(p.workload.batch * (p.workload.mu_p + p.workload.mu_d)).epsilon(0.03));
    // Tokens per second = slots / (step time) and step time = residence / tokens.
    CHECK(r->tokens_per_s * 1e-6 ==
          Approx(r->slots / (r->mean_residence_us / r->mean_tokens_per_request)).epsilon(0.03));
  }
}

TEST_CASE("a fresh start ramps the token load up as the seed's E[T_k] recursion says",
          "[planner][simulator]") {
  // E[T_k] = B*mu_P + B*(1-p)/p*(1-(1-p)^k): after k steps of fresh
  // requests the mean decode part has reached mu_D*(1-(1-p)^k).
  Workload w = BasePlan().workload;
  w.prefill = PrefillDistribution::kFixed;
  const int k = 10;
  const double p = w.EndProbability();
  double sum = 0;
  const int runs = 2000;
  for (int i = 0; i < runs; ++i) {
    SlotBatch s(w, w.batch, 77 + i, /*stationary=*/false);
    for (int step = 0; step < k; ++step) s.FinishStep(step, nullptr);
    sum += s.KvTokens();
  }
  const double expect = w.batch * (w.mu_p + (1 - p) / p * (1 - std::pow(1 - p, k)));
  CHECK(sum / runs == Approx(expect).epsilon(0.01));
}

TEST_CASE("the simulator is deterministic for a seed", "[planner][simulator]") {
  Plan p = BasePlan();
  SimOptions o;
  o.attention = 2;
  o.seed = 5;
  absl::StatusOr<SimResult> a = Simulate(p, o);
  absl::StatusOr<SimResult> b = Simulate(p, o);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->tokens_per_s == b->tokens_per_s);
  CHECK(a->window_us == b->window_us);
  CHECK(a->mean_kv_tokens == b->mean_kv_tokens);
  CHECK(a->completed == b->completed);
  o.seed = 6;
  absl::StatusOr<SimResult> c = Simulate(p, o);
  REQUIRE(c.ok());
  CHECK(c->mean_kv_tokens != a->mean_kv_tokens);
}

// With a huge batch (the token load barely varies) and enough micro-batches,
// the simulated throughput is the closed form's f(r) in every regime.
TEST_CASE("low variance: the simulator matches the closed form in each regime",
          "[planner][simulator]") {
  struct Case {
    const char* name;
    Coefficients c;
    Regime regime;
  };
  Coefficients attn, comm, ffn;
  attn.attention = {1e-4, 100};  // t_A = 1e-4*4096*3000 + 100 = 1329
  attn.comm = {0.01, 10};
  attn.ffn = {0.05, 100};
  comm.attention = {1e-6, 10};
  comm.comm = {0.3, 50};  // t_C = 1279
  comm.ffn = {0.05, 100};
  ffn.attention = {1e-6, 10};
  ffn.comm = {0.01, 10};
  ffn.ffn = {0.01, 1500};
  for (const Case& k :
       {Case{"attention", attn, Regime::kAttention}, Case{"comm", comm, Regime::kCommunication},
        Case{"ffn", ffn, Regime::kFfn}}) {
    Plan p;
    p.has_coefficients = true;
    p.coefficients = k.c;
    p.workload.mu_p = 2000;
    p.workload.mu_d = 1000;
    p.workload.prefill = PrefillDistribution::kFixed;
    p.workload.batch = 4096;
    p.workload.micro_batches = 8;  // deep enough: the seed's assumption
    p.workload.layers = 2;
    const SeedSolution s = SolveSeed(p.coefficients, p.workload);
    REQUIRE(s.regime == k.regime);
    const std::vector<CycleTerm> terms = CycleTerms(p.coefficients, p.workload, {}, false);
    for (int x : {1, 2, 4}) {
      SimOptions o;
      o.attention = x;
      o.measure_steps = 60;
      absl::StatusOr<SimResult> r = Simulate(p, o);
      REQUIRE(r.ok());
      const double predicted = ThroughputPerInstance(terms, p.workload, x);
      INFO(k.name << " " << x << "A1F: r* " << s.r_star);
      CHECK(r->tokens_per_s_per_instance == Approx(predicted).epsilon(0.02));
    }
  }
}

TEST_CASE("few micro-batches: the simulator follows the pipeline-depth bound",
          "[planner][simulator]") {
  Plan p = BasePlan();
  p.workload.batch = 2048;
  p.workload.mu_d = 500;
  p.workload.prefill = PrefillDistribution::kFixed;
  p.workload.micro_batches = 1;  // one micro-batch: nothing overlaps
  p.coefficients.attention = {0.002, 200};
  const std::vector<CycleTerm> full = CycleTerms(p.coefficients, p.workload, {}, true);
  const std::vector<CycleTerm> seed = CycleTerms(p.coefficients, p.workload, {}, false);
  for (int x : {1, 3}) {
    SimOptions o;
    o.attention = x;
    o.measure_steps = 60;
    absl::StatusOr<SimResult> r = Simulate(p, o);
    REQUIRE(r.ok());
    Regime binding;
    CycleTime(full, x, &binding);
    CHECK(binding == Regime::kPipelineDepth);
    CHECK(r->tokens_per_s_per_instance ==
          Approx(ThroughputPerInstance(full, p.workload, x)).epsilon(0.02));
    CHECK(r->tokens_per_s_per_instance < 0.8 * ThroughputPerInstance(seed, p.workload, x));
  }
}

TEST_CASE("the simulator refuses impossible options", "[planner][simulator]") {
  Plan p = BasePlan();
  SimOptions o;
  o.attention = 0;
  CHECK_FALSE(Simulate(p, o).ok());
  o.attention = 1;
  o.measure_steps = 1;
  CHECK_FALSE(Simulate(p, o).ok());
  p.has_coefficients = false;
  o.measure_steps = 10;
  CHECK_FALSE(Simulate(p, o).ok());
}

}  // namespace
}  // namespace stepmesh::planner
