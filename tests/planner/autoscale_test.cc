// The planner in the loop (src/tools/planner/autoscale.h): the Step-3
// paper's context-to-shape points from its own figures, the hysteresis rule,
// the instance budget, and the autoscale file's errors.

#include "src/tools/planner/autoscale.h"

#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <string>

#include "src/tools/planner/report.h"

namespace stepmesh::planner {
namespace {

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// step3_h800.json (docs/planning.md, "Worked case"): the coefficients read
// from the Step-3 paper's Table 9, 2A2F, 3 micro-batches, 61 layers.
AutoscalePlan Step3(BatchPolicy policy, double tpot_ms) {
  absl::StatusOr<Plan> plan = LoadPlan(STEPMESH_PLANNER_CONFIG_DIR "/step3_h800.json");
  REQUIRE(plan.ok());
  AutoscalePlan a;
  a.plan = *plan;
  a.min_attention = 1;
  a.max_attention = 24;
  a.min_ffn = 2;
  a.max_ffn = 2;
  a.batch_policy = policy;
  a.tpot_ms = tpot_ms;
  a.confirmations = 1;
  return a;
}

// The paper's 2A2F at 4K: 3 micro-batches x 2 instances x 1024 = 6144.
constexpr double kSlots = 1024;

std::string Best(const Recommendation& r) { return ShapeName(r.best.attention, r.best.ffn); }

TEST_CASE(
    "autoscale: the Step-3 paper's shapes follow the context at the same global batch and TPOT",
    "[planner][autoscale]") {
  // The paper: 2A2F at 4K, "4A2F with the same global batch" at 8K, 16A2F at
  // 32K. It keeps the TPOT of its 4K deployment (the full model's 51.4 ms
  // for 2A2F) and the global batch; with both held, the throughput per
  // instance picks exactly its shapes.
  const AutoscalePlan plan = Step3(BatchPolicy::kGlobal, 52);
  struct Point {
    double context;
    const char* shape;
    int batch;
  };
  for (const Point& p :
       {Point{4096, "2A2F", 1024}, Point{8192, "4A2F", 512}, Point{32768, "16A2F", 128}}) {
    INFO("context " << p.context);
    absl::StatusOr<Recommendation> r = Recommend(plan, {p.context, kSlots, 0}, 2, 2);
    REQUIRE(r.ok());
    CHECK(Best(*r) == p.shape);
    CHECK(r->best.batch == p.batch);
    CHECK(r->best.meets_tpot);
    CHECK(r->best.tpot_ms == Approx(51.4).margin(0.05));
    CHECK(r->changed == (p.context > 4096));
  }
  // 2A2F at 4K is the worked case's 29 884 tokens/s per instance at 51.4 ms,
  // the report's own full-model number.
  absl::StatusOr<Recommendation> r4 = Recommend(plan, {4096, kSlots, 0}, 2, 2);
  REQUIRE(r4.ok());
  const RatioRow row = EvaluateRatio(plan.plan, 2, 2);
  CHECK(r4->current.throughput_per_instance == Approx(row.full).epsilon(1e-12));
  CHECK(r4->current.throughput_per_instance == Approx(29884).margin(1));
  CHECK(r4->current.cycle_us == Approx(row.tau_full).epsilon(1e-12));
  CHECK(!r4->favours_change);
  CHECK(r4->recommended.attention == 2);

  // 3A2F at 8K misses the TPOT (61.8 ms) and loses to 4A2F; 2A2F is far off.
  absl::StatusOr<Recommendation> r8 = Recommend(plan, {8192, kSlots, 0}, 2, 2);
  REQUIRE(r8.ok());
  CHECK(!r8->current.meets_tpot);
  CHECK(r8->current.tpot_ms == Approx(82.5).margin(0.1));
  CHECK(r8->gain == Approx(19923.0 / 18622 - 1).margin(1e-3));
  absl::StatusOr<RatioPrediction> three = Predict(plan, {8192, kSlots, 0}, 2, 3, 2);
  REQUIRE(three.ok());
  CHECK(three->batch == 683);
  CHECK(!three->meets_tpot);
}

TEST_CASE("autoscale: without a target the throughput per instance decides",
          "[planner][autoscale]") {
  // Each attention instance keeps B = 1024 (docs/planning.md: the best
  // integer at 4K is 3A2F); the paper's 2A2F is its SLA choice.
  absl::StatusOr<Recommendation> per =
      Recommend(Step3(BatchPolicy::kPerInstance, 0), {4096, kSlots, 0}, 2, 2);
  REQUIRE(per.ok());
  CHECK(Best(*per) == "3A2F");
  CHECK(per->best.batch == 1024);
  CHECK(per->gain == Approx(32763.0 / 29884 - 1).margin(1e-3));
  // Same global batch, no TPOT: 4A2F still wins at 8K, but at 32K throughput
  // per instance wants 7A2F (attention-bound, 91 ms TPOT), not 16A2F.
  const AutoscalePlan global = Step3(BatchPolicy::kGlobal, 0);
  absl::StatusOr<Recommendation> r8 = Recommend(global, {8192, kSlots, 0}, 2, 2);
  absl::StatusOr<Recommendation> r32 = Recommend(global, {32768, kSlots, 0}, 2, 2);
  REQUIRE(r8.ok());
  REQUIRE(r32.ok());
  CHECK(Best(*r8) == "4A2F");
  CHECK(Best(*r32) == "7A2F");
  CHECK(r32->best.binding == Regime::kAttention);
  // The observation was made at 4 instances: the same global batch.
  absl::StatusOr<Recommendation> at4 = Recommend(global, {32768, kSlots / 2, 0}, 4, 2);
  REQUIRE(at4.ok());
  CHECK(Best(*at4) == "7A2F");
  CHECK(at4->best.throughput_per_instance == Approx(r32->best.throughput_per_instance));
}

TEST_CASE("autoscale: the instance budget bounds the grid", "[planner][autoscale]") {
  AutoscalePlan plan = Step3(BatchPolicy::kGlobal, 52);
  plan.max_instances = 12;  // at most 10A2F
  absl::StatusOr<Recommendation> r = Recommend(plan, {32768, kSlots, 0}, 2, 2);
  REQUIRE(r.ok());
  // No shape within 12 instances meets 52 ms: the best throughput, flagged.
  CHECK(!r->best.meets_tpot);
  CHECK(r->best.attention + r->best.ffn <= 12);
  CHECK(Best(*r) == "7A2F");
  plan.max_instances = 8;
  r = Recommend(plan, {32768, kSlots, 0}, 2, 2);
  REQUIRE(r.ok());
  CHECK(Best(*r) == "6A2F");
  CHECK(r->changed);
  plan.max_attention = 3;
  r = Recommend(plan, {32768, kSlots, 0}, 2, 2);
  REQUIRE(r.ok());
  CHECK(Best(*r) == "3A2F");
  // A current shape outside the grid is still evaluated; the grid's best
  // must beat it to move.
  r = Recommend(plan, {32768, kSlots / 4, 0}, 8, 2);
  REQUIRE(r.ok());
  CHECK(r->current.attention == 8);
  CHECK(r->gain < 0);
  CHECK(!r->favours_change);
}

TEST_CASE("autoscale: hysteresis moves after K consecutive observations that beat by H percent",
          "[planner][autoscale]") {
  AutoscalePlan plan = Step3(BatchPolicy::kGlobal, 0);
  plan.min_gain_percent = 5;
  plan.confirmations = 3;
  AutoscaleController ctl(plan, 2, 2);
  const ObservedWorkload at4k{4096, kSlots, 0}, at8k{8192, kSlots, 0};
  // 8K: 4A2F beats 2A2F by 7 %. Interrupted by a 4K observation, the streak restarts.
  auto observe = [&](const ObservedWorkload& o) {
    absl::StatusOr<Recommendation> r = ctl.Observe(o);
    REQUIRE(r.ok());
    return *r;
  };
  Recommendation r = observe(at8k);
  CHECK((r.favours_change && r.streak == 1 && !r.changed));
  CHECK(observe(at8k).streak == 2);
  r = observe(at4k);
  CHECK((!r.favours_change && r.streak == 0 && !r.changed));
  CHECK(observe(at8k).streak == 1);
  CHECK(!observe(at8k).changed);
  r = observe(at8k);
  CHECK(r.changed);
  CHECK(r.streak == 3);
  CHECK(ShapeName(r.recommended.attention, r.recommended.ffn) == "4A2F");
  CHECK(FormatChange(r).rfind("recommend 4A2F (was 2A2F): ", 0) == 0);
  CHECK(ctl.current_attention() == 4);
  CHECK(ctl.streak() == 0);
  // Now at 4A2F: 8K again favours nothing.
  r = observe(at8k);
  CHECK(!r.favours_change);
  CHECK(r.recommended.attention == 4);

  // 3A2F at 8K (the same global batch) is 0.1 % below 4A2F: a better
  // shape, but not by 5 %.
  ctl.SetCurrent(3, 2);
  const ObservedWorkload at8k_3a{8192, 2 * kSlots / 3, 0};
  r = observe(at8k_3a);
  CHECK(Best(r) == "4A2F");
  CHECK(r.gain > 0);
  CHECK(r.gain < 0.01);
  CHECK(!r.favours_change);
  plan.min_gain_percent = 0;
  plan.confirmations = 1;
  absl::StatusOr<Recommendation> zero = Recommend(plan, at8k_3a, 3, 2);
  REQUIRE(zero.ok());
  CHECK(zero->changed);

  // A bad observation changes nothing.
  ctl.SetCurrent(2, 2);
  CHECK(observe(at8k).streak == 1);
  absl::StatusOr<Recommendation> bad = ctl.Observe({8192, 0, 0});
  REQUIRE(!bad.ok());
  CHECK(Message(bad.status()).find("batch") != std::string::npos);
  CHECK(ctl.streak() == 1);
  bad = ctl.Observe({-1, kSlots, 0});
  REQUIRE(!bad.ok());
  CHECK(Message(bad.status()).find("mean_context") != std::string::npos);
  CHECK(ctl.current_attention() == 2);
}

TEST_CASE("autoscale: the plan file round-trips and names every mistake",
          "[planner][autoscale][json]") {
  AutoscalePlan plan = Step3(BatchPolicy::kGlobal, 52);
  plan.max_instances = 20;
  plan.min_gain_percent = 7.5;
  plan.confirmations = 4;
  const std::string text = AutoscalePlanToJson(plan);
  absl::StatusOr<Json> doc = Json::Parse(text);
  REQUIRE(doc.ok());
  absl::StatusOr<AutoscalePlan> back = ParseAutoscalePlan(*doc);
  REQUIRE(back.ok());
  CHECK(back->max_attention == 24);
  CHECK(back->min_ffn == 2);
  CHECK(back->max_instances == 20);
  CHECK(back->batch_policy == BatchPolicy::kGlobal);
  CHECK(back->tpot_ms == 52);
  CHECK(back->min_gain_percent == 7.5);
  CHECK(back->confirmations == 4);
  CHECK(back->plan.coefficients.ffn.beta == 290);
  absl::StatusOr<Recommendation> a = Recommend(plan, {8192, kSlots, 0}, 2, 2);
  absl::StatusOr<Recommendation> b = Recommend(*back, {8192, kSlots, 0}, 2, 2);
  REQUIRE((a.ok() && b.ok()));
  CHECK(b->best.throughput_per_instance == Approx(a->best.throughput_per_instance));

  const std::string good_plan = R"("plan": {"coefficients": {
      "attention": {"alpha_us_per_token": 0.01, "beta_us": 100},
      "comm": {"alpha_us_per_row": 0.001, "beta_us": 20},
      "ffn": {"alpha_us_per_row": 1.5, "beta_us": 3000}},
      "workload": {"mu_p": 400, "mu_d": 100, "batch": 64, "micro_batches": 3}})";
  struct Bad {
    std::string autoscale;
    std::string expect;
  };
  for (const Bad& c : {
           Bad{R"({"confirmation": 3})", "unknown key(s): autoscale.confirmation"},
           Bad{R"({"attention": [3, 1]})", "autoscale.attention = [3, 1]: lo must not exceed hi"},
           Bad{R"({"attention": [0, 4]})", "autoscale.attention[0] must be an integer in [1, "},
           Bad{R"({"ffn": 2})", "autoscale.ffn must be an array [lo, hi], not a number"},
           Bad{R"({"batch_policy": "fixed"})", "autoscale.batch_policy = \"fixed\""},
           Bad{R"({"confirmations": 0})", "autoscale.confirmations = 0 is outside [1, 1000]"},
           Bad{R"({"min_gain_percent": "5"})", "autoscale.min_gain_percent must be a number"},
           Bad{R"({"attention": [2, 4], "ffn": [2, 2], "max_instances": 3})",
               "autoscale.max_instances = 3"},
           Bad{R"([])", "autoscale must be an object"},
       }) {
    INFO(c.autoscale);
    absl::StatusOr<Json> j = Json::Parse("{\"autoscale\": " + c.autoscale + ", " + good_plan + "}");
    REQUIRE(j.ok());
    absl::StatusOr<AutoscalePlan> p = ParseAutoscalePlan(*j);
    REQUIRE(!p.ok());
    CHECK(Message(p.status()).find(c.expect) != std::string::npos);
  }
  // The plan's own errors, under "plan".
  absl::StatusOr<Json> j = Json::Parse(R"({"plan": {"workload": {"mu_p": 1, "mu_d": 1,
      "batch": 0}}})");
  REQUIRE(j.ok());
  absl::StatusOr<AutoscalePlan> p = ParseAutoscalePlan(*j);
  REQUIRE(!p.ok());
  CHECK(Message(p.status()) == "plan: workload.batch = 0 is outside [1, 16777216]");
  j = Json::Parse(R"({"plan": {"workload": {"mu_p": 1, "mu_d": 1, "batch": 4}}})");
  REQUIRE(j.ok());
  p = ParseAutoscalePlan(*j);
  REQUIRE(!p.ok());
  CHECK(Message(p.status()).find("plan.coefficients is missing") == 0);
  j = Json::Parse(R"({"autoscale": {}})");
  REQUIRE(j.ok());
  CHECK(Message(ParseAutoscalePlan(*j).status()) == "plan is missing");
  j = Json::Parse(R"({"autoscale": {"tpot_ms": 50}, "plan": {"coefficients": {
      "attention": {"alpha_us_per_token": 0.01, "beta_us": 100},
      "comm": {"alpha_us_per_row": 0.001, "beta_us": 20},
      "ffn": {"alpha_us_per_row": 1.5, "beta_us": 3000}},
      "workload": {"mu_p": 400, "mu_d": 100, "batch": 64}}})");
  REQUIRE(j.ok());
  CHECK(Message(ParseAutoscalePlan(*j).status()).find("autoscale.tpot_ms needs") == 0);

  // From a file: the file's name first; a syntax error names line and column.
  const std::string path = "autoscale_test_plan.json";
  {
    std::ofstream out(path);
    out << "{\"autoscale\": {\"confirmations\": 2},\n \"plan\": {\"workload\": 3,}}";
  }
  absl::StatusOr<AutoscalePlan> f = ReadAutoscalePlan(path);
  REQUIRE(!f.ok());
  CHECK(Message(f.status()).find(path + ": ") == 0);
  CHECK(Message(f.status()).find("line 2") != std::string::npos);
  REQUIRE(WriteAutoscalePlan(path, plan).ok());
  f = ReadAutoscalePlan(path);
  REQUIRE(f.ok());
  CHECK(f->confirmations == 4);
  std::remove(path.c_str());
  f = ReadAutoscalePlan(path);
  REQUIRE(!f.ok());
  CHECK(Message(f.status()).find(path) != std::string::npos);
  // Writing refuses an invalid plan and leaves no file.
  plan.confirmations = 0;
  CHECK(!WriteAutoscalePlan(path, plan).ok());
  CHECK(!std::ifstream(path).good());
}

}  // namespace
}  // namespace stepmesh::planner

namespace stepmesh::planner {
namespace {

TEST_CASE("autoscale: the emulated Step-3 file goes 2A2F to 4A2F as the context grows 1K to 8K",
          "[planner][autoscale]") {
  // configs/autoscale_step3_emulated.json, for afd_launch --autoscale: the
  // global batch (2 x 1024 slots per micro-batch) held, the TPOT of 2A2F at
  // 4K (5.06 ms at 6 layers) the target. The context climbs in 256-token
  // steps; each observation reports the slots per instance of the shape the
  // controller last announced.
  absl::StatusOr<AutoscalePlan> plan =
      ReadAutoscalePlan(STEPMESH_PLANNER_CONFIG_DIR "/autoscale_step3_emulated.json");
  REQUIRE(plan.ok());
  AutoscaleController ctl(*plan, 2, 2);
  std::vector<std::pair<double, std::string>> changes;
  for (double context = 1024; context <= 8192; context += 256) {
    const int x = ctl.current_attention();
    absl::StatusOr<Recommendation> r = ctl.Observe({context, 2048.0 / x, 0});
    REQUIRE(r.ok());
    CHECK(r->recommended.attention * r->recommended.batch == Approx(2048).margin(2));
    if (context <= 4096) CHECK(!r->favours_change);  // 2A2F meets 5.12 ms up to 4K
    if (r->changed) changes.emplace_back(context, Best(*r));
  }
  REQUIRE(changes.size() == 2);
  CHECK(changes[0].second == "3A2F");
  CHECK(changes[1].second == "4A2F");
  // Each change is confirmed 3 observations (768 tokens) after 2A2F or 3A2F
  // first missed the target: 4352 and 6400.
  CHECK(changes[0].first == 4864);
  CHECK(changes[1].first == 6912);
  CHECK(ctl.current_attention() == 4);
}

}  // namespace
}  // namespace stepmesh::planner
