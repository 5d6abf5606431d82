// afd_launch --resize without processes: the shape schedule (parsing, spans,
// capacity), the report's resize lines, and Gate A replaying the expert
// layout schedule (CheckAgainstReference against results made by the
// monolithic ReferenceModel, which replays the schedule on its own).

#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/afd_report.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/elastic_sync.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/reference.h"
#include "examples/afd_model/resize_launch.h"
#include "examples/afd_model/resize_plan.h"
#include "tests/afd/afd_test_config.h"

namespace afd::example {
namespace {

TEST_CASE("resize schedule: parsing with spans and capacity", "[afd][resize]") {
  // The README's command: 2A2F, 6:3A2F, 11:3A3F over 17 steps.
  absl::StatusOr<ResizeSchedule> s = ResizeSchedule::Parse({2, 2}, 17, {"6:3A2F", "11:3A3F"});
  REQUIRE(s.ok());
  CHECK(s->At(0) == MeshShape{2, 2});
  CHECK(s->At(5) == MeshShape{2, 2});
  CHECK(s->At(6) == MeshShape{3, 2});
  CHECK(s->At(16) == MeshShape{3, 3});
  CHECK(s->Capacity() == MeshShape{3, 3});
  CHECK(s->AttentionSpan(0).begin == 0);
  CHECK(s->AttentionSpan(0).end == 17);
  CHECK(s->AttentionSpan(2).begin == 6);
  CHECK(s->AttentionSpan(2).end == 17);
  CHECK(s->FfnSpan(2).begin == 11);
  CHECK(s->Specs() == std::vector<std::string>{"6:3A2F", "11:3A3F"});
  CHECK(s->changes()[1].from == MeshShape{3, 2});

  // A shrink: the highest ranks leave; their span ends at the change.
  absl::StatusOr<ResizeSchedule> shrink = ResizeSchedule::Parse({3, 3}, 10, {"4:2A2F"});
  REQUIRE(shrink.ok());
  CHECK(shrink->AttentionSpan(2).end == 4);
  CHECK(shrink->FfnSpan(2).end == 4);
  CHECK(shrink->FfnSpan(1).end == 10);

  // Errors name the spec and say what is wrong.
  auto error = [](MeshShape start, int steps, std::vector<std::string> specs) {
    absl::StatusOr<ResizeSchedule> r = ResizeSchedule::Parse(start, steps, specs);
    return r.ok() ? std::string("ok") : std::string(r.status().message());
  };
  CHECK_THAT(error({2, 2}, 17, {"6-3A2F"}), Catch::Contains("--resize 6-3A2F: want STEP:xAyF"));
  CHECK_THAT(error({2, 2}, 17, {"6:3X2F"}), Catch::Contains("not a shape xAyF"));
  CHECK_THAT(error({2, 2}, 17, {"6:0A2F"}), Catch::Contains("not a shape xAyF"));
  CHECK_THAT(error({2, 2}, 17, {"0:3A2F"}), Catch::Contains("must be after 0 (the prefill)"));
  CHECK_THAT(error({2, 2}, 17, {"17:3A2F"}), Catch::Contains("before 17"));
  CHECK_THAT(error({2, 2}, 17, {"6:3A2F", "6:3A3F"}),
             Catch::Contains("after 6 (the previous --resize)"));
  CHECK_THAT(error({2, 2}, 17, {"6:2A2F"}), Catch::Contains("already 2A2F"));
  CHECK_THAT(error({3, 2}, 17, {"4:2A2F", "8:3A2F"}),
             Catch::Contains("attention 2 would leave at step 4 and come back at step 8"));
}

TEST_CASE("resize lines: the exact format with epochs and times from the logs", "[afd][resize]") {
  const ShapeChange change{6, {2, 2}, {3, 2}};
  CHECK(FormatResizeLine(change, 3, 41.6) == "resize at step 6: 2A2F -> 3A2F (epoch 3, 42 ms)");

  const std::string dir = "/tmp/afd_resize_test." + std::to_string(::getpid());
  const std::string epochs = dir + ".epochs", log0 = dir + ".0", log2 = dir + ".2";
  {
    std::ofstream e(epochs);
    e << FormatEpochRecord({0, 100, 2, 2}) << FormatEpochRecord({1, 200, 3, 2})
      << FormatEpochRecord({2, 300, 3, 3});
    std::ofstream a(log0);
    a << "resize 6 took 5000000\nresize 11 took 1000000\n";
    std::ofstream b(log2);
    b << "resize 6 took 7000000\nresize 11 took 2600000\n";
  }
  const ResizeSchedule s = *ResizeSchedule::Parse({2, 2}, 17, {"6:3A2F", "11:3A3F"});
  absl::StatusOr<std::string> lines = FormatResizeLines(s, epochs, {log0, log2});
  REQUIRE(lines.ok());
  CHECK(*lines ==
        "resize at step 6: 2A2F -> 3A2F (epoch 1, 7 ms)\n"
        "resize at step 11: 3A2F -> 3A3F (epoch 2, 3 ms)\n");
  // A change nobody recorded is an error, not a made-up line.
  {
    std::ofstream e(epochs);
    e << FormatEpochRecord({0, 100, 2, 2}) << FormatEpochRecord({1, 200, 3, 2});
  }
  lines = FormatResizeLines(s, epochs, {log0, log2});
  REQUIRE_FALSE(lines.ok());
  CHECK_THAT(std::string(lines.status().message()),
             Catch::Contains("resize at step 11 (3A2F -> 3A3F): no membership epoch of 3A3F"));
  for (const std::string& p : {epochs, log0, log2}) std::remove(p.c_str());
}

// What attention instance `rank` of the elastic run `run` writes, made by the
// monolithic ReferenceModel on that instance's requests alone: prefilled at
// the instance's first step, the expert layout of each global step of its
// span (`partitions` per global step).
AttentionResults ReferenceResults(const RunShape& run, const ModelConfig& config, int rank,
                                  const std::vector<int>& partitions) {
  const RunShape shape = run.ForAttention(rank);
  const MemberSpan span = run.Schedule().AttentionSpan(rank);
  ReferenceOptions options{Codec::kAfd, partitions[span.begin], shape.requests,
                           int64_t{shape.prompt_len} + shape.decode_steps};
  options.partitions_per_step.assign(partitions.begin() + span.begin,
                                     partitions.begin() + span.end);
  ReferenceModel model(config, options);
  AttentionResults r = SizedResults(rank, shape, config);
  std::fill(r.step_end_ns.begin(), r.step_end_ns.end(), 1);
  model.set_layer_observer([&](int, const StepState& state) {
    r.layer_hidden.insert(r.layer_hidden.end(), state.hidden.begin(), state.hidden.end());
  });
  const int total = shape.attention * shape.requests;  // prompts are drawn for every rank
  const std::vector<int32_t> flat = GeneratePromptTokens(config, total, shape.prompt_len);
  std::vector<std::vector<int32_t>> prompts(shape.requests);
  for (int i = 0; i < shape.requests; ++i) {
    const int g = rank * shape.requests + i;
    prompts[i].assign(flat.begin() + g * shape.prompt_len,
                      flat.begin() + (g + 1) * shape.prompt_len);
  }
  const GenerationResult gen = model.Generate(prompts, shape.decode_steps);
  r.tokens.resize(size_t(shape.requests) * r.steps);
  for (int i = 0; i < shape.requests; ++i) {
    for (int s = 0; s < r.steps; ++s) r.tokens[size_t(i) * r.steps + s] = gen.tokens[i][s];
  }
  for (const auto& logits : gen.step_logits) {
    r.logits.insert(r.logits.end(), logits.begin(), logits.end());
  }
  return r;
}

TEST_CASE("resize: gate A replays the expert layout schedule", "[afd][resize][gate_a]") {
  const ModelConfig config = Tiny();
  ExampleModel model;
  model.config = config;
  RunShape run;
  run.attention = 1;
  run.ffn = 2;
  run.requests = 3;
  run.prompt_len = 8;
  run.decode_steps = 4;  // 5 steps
  run.micro_batches = 3;
  // 1A2F -> 2A2F at step 2 (attention 1 and its requests arrive) -> 2A3F at 3.
  run.resize = {"2:2A2F", "3:2A3F"};
  REQUIRE(run.Validate().ok());
  const std::vector<int> layout = {2, 2, 2, 3, 3};
  std::vector<AttentionResults> results = {ReferenceResults(run, config, 0, layout),
                                           ReferenceResults(run, config, 1, layout)};
  for (int a = 0; a < 2; ++a) {
    const RunShape shape = run.ForAttention(a);
    INFO("attention " << a);
    REQUIRE(
        ValidateResults(results[a], ExpectedResults{a, &shape, config.num_layers,
                                                    config.hidden_size, config.vocab_size, true})
            .ok());
  }
  CHECK(results[1].steps == 3);

  SECTION("results made under the schedule pass bitwise") {
    const ReferenceCheck check = CheckAgainstReference(run, model, results, true);
    INFO(check.summary);
    CHECK(check.pass);
    CHECK_THAT(check.summary, Catch::Contains("24/24 tokens identical"));
    CHECK_THAT(check.summary, Catch::Contains("2 (steps 0-2), 3 (steps 3-4) partitions"));
  }
  SECTION("results of a run that kept 2 partitions fail") {
    const std::vector<int> fixed = {2, 2, 2, 2, 2};
    results = {ReferenceResults(run, config, 0, fixed), ReferenceResults(run, config, 1, fixed)};
    const ReferenceCheck check = CheckAgainstReference(run, model, results, true);
    INFO(check.summary);
    CHECK_FALSE(check.pass);
    CHECK_THAT(check.summary, Catch::Contains("step 3"));
  }
  SECTION("a joiner's first token off fails, naming its request and global step") {
    results[1].tokens[0] ^= 1;  // attention 1's request 0 = request 3, its step 0 = step 2
    const ReferenceCheck check = CheckAgainstReference(run, model, results, true);
    CHECK_FALSE(check.pass);
    CHECK_THAT(check.summary, Catch::Contains("token of request 3 step 2"));
  }
}

}  // namespace
}  // namespace afd::example
