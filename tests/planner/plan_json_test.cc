// The JSON reader and the plan file: what parses, and that every mistake is
// reported by name and position.

#include <catch2/catch.hpp>
#include <string>

#include "src/tools/planner/json.h"
#include "src/tools/planner/plan.h"

namespace stepmesh::planner {
namespace {

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST_CASE("JSON documents parse into a tree", "[planner][json]") {
  absl::StatusOr<Json> j = Json::Parse(
      R"( {"a": [1, -2.5e3, true, false, null], "b": {"c": "x\"\u00e9\ud83d\ude00\n"}, "d": 0} )");
  REQUIRE(j.ok());
  REQUIRE(j->is_object());
  const Json* a = j->Find("a");
  REQUIRE(a != nullptr);
  REQUIRE(a->array().size() == 5);
  CHECK(a->array()[0].number() == 1);
  CHECK(a->array()[1].number() == -2500);
  CHECK(a->array()[2].boolean());
  CHECK(a->array()[4].is_null());
  CHECK(j->Find("b")->Find("c")->string() == "x\"\xc3\xa9\xf0\x9f\x98\x80\n");
  CHECK(j->Find("missing") == nullptr);
  CHECK(a->Find("a") == nullptr);  // not an object
}

TEST_CASE("malformed JSON is refused with line and column", "[planner][json]") {
  struct Bad {
    const char* text;
    const char* expect;
  };
  for (const Bad& b :
       {Bad{"{\"a\": 1,\n  \"b\" 2}", "line 2 column 7: expected ':'"},
        Bad{"[1, 2", "expected ',' or ']'"}, Bad{"{\"a\": 01}", "leading zero"},
        Bad{"\"abc", "unterminated string"}, Bad{"[1] x", "trailing characters"},
        Bad{"{\"a\": tru}", "unexpected character 't'"}, Bad{"\"\\ud800\"", "high surrogate"},
        Bad{"1e999", "out of range"}, Bad{"", "unexpected end of input"}}) {
    absl::StatusOr<Json> j = Json::Parse(b.text);
    INFO(b.text);
    REQUIRE_FALSE(j.ok());
    CHECK(Message(j.status()).find(b.expect) != std::string::npos);
  }
  std::string deep(300, '[');
  CHECK(Message(Json::Parse(deep).status()).find("nesting deeper than 200") != std::string::npos);
}

const char* kPlan = R"({
  "name": "test",
  "coefficients": {
    "attention": {"alpha_us_per_token": 4e-5, "beta_us": 111},
    "comm": {"alpha_us_per_row": 0.18, "beta_us": 20, "a2f_fraction": 0.5},
    "ffn": {"alpha_us_per_row": 0.11, "beta_us": 300}
  },
  "workload": {"mu_p": 3584, "mu_d": 512, "batch": 1024, "micro_batches": 3, "layers": 61,
               "prefill": "uniform"},
  "attention_context": {"kind": "sparse", "window": 512},
  "model": {"hidden": 7168, "top_k": 3},
  "wire": {"ffn_link_gbps": 400},
  "emulation": {"time_scale": 10, "seed": 3}
})";

TEST_CASE("a plan file parses with derived wire bytes", "[planner][json]") {
  absl::StatusOr<Json> doc = Json::Parse(kPlan);
  REQUIRE(doc.ok());
  absl::StatusOr<Plan> p = ParsePlan(*doc);
  REQUIRE(p.ok());
  CHECK(p->has_coefficients);
  CHECK(p->coefficients.ffn.beta == 300);
  CHECK(p->workload.batch == 1024);
  CHECK(p->workload.prefill == PrefillDistribution::kUniform);
  CHECK(p->workload.context.sparse);
  CHECK(p->workload.context.window == 512);
  CHECK(p->workload.ffn_instances == 1);
  // FP8 codes + 56 fp32 scales + 3 ids and 3 weights; BF16 back.
  CHECK(p->wire.a2f_bytes_per_row == 7168 + 4 * 56 + 24);
  CHECK(p->wire.f2a_bytes_per_row == 2 * 7168);
  CHECK(p->wire.ffn_link_gbps == 400);
  CHECK(p->emulation.time_scale == 10);
  CHECK(p->emulation.seed == 3);
}

TEST_CASE("plan mistakes are named", "[planner][json]") {
  struct Bad {
    const char* from;
    const char* to;
    const char* expect;
  };
  for (const Bad& b :
       {Bad{"\"batch\": 1024", "\"batchsize\": 1024", "workload.batch is missing"},
        Bad{"\"layers\": 61", "\"layers\": 61, \"layer\": 3", "unknown key(s): workload.layer"},
        Bad{"\"batch\": 1024", "\"batch\": 10.5", "workload.batch must be an integer"},
        Bad{"\"batch\": 1024", "\"batch\": 0", "workload.batch = 0 is outside"},
        Bad{"\"beta_us\": 300", "\"beta_us\": \"300\"",
            "coefficients.ffn.beta_us must be a number, not a string"},
        Bad{"\"alpha_us_per_row\": 0.11", "\"alpha_us_per_row\": 0",
            "coefficients.ffn.alpha_us_per_row must be > 0"},
        Bad{"\"uniform\"", "\"zipf\"", "workload.prefill = \"zipf\""},
        Bad{"\"sparse\"", "\"linear\"", "attention_context.kind = \"linear\""},
        Bad{"\"a2f_fraction\": 0.5", "\"a2f_fraction\": 2",
            "coefficients.comm.a2f_fraction = 2"}}) {
    std::string text = kPlan;
    const size_t at = text.find(b.from);
    REQUIRE(at != std::string::npos);
    text.replace(at, std::string(b.from).size(), b.to);
    absl::StatusOr<Json> doc = Json::Parse(text);
    REQUIRE(doc.ok());
    absl::StatusOr<Plan> p = ParsePlan(*doc);
    INFO(b.to);
    REQUIRE_FALSE(p.ok());
    CHECK(Message(p.status()).find(b.expect) != std::string::npos);
  }
  CHECK(Message(LoadPlan("/nonexistent/plan.json").status()).find("cannot read /nonexistent") == 0);
}

}  // namespace
}  // namespace stepmesh::planner
