// The launcher's side of Gate A without processes: the results file
// (ReadResults validates sizes against the run's shape) and
// CheckAgainstReference (memcmp on tokens, logits and per-layer residuals).

#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/afd_engine.h"
#include "examples/afd_model/afd_report.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/reference.h"
#include "stepmesh/cuda.h"
#include "stepmesh/stepmesh.h"
#include "tests/afd/afd_test_config.h"

namespace afd::example {
namespace {

RunShape SmallShape() {
  RunShape s;
  s.attention = 1;
  s.ffn = 2;
  s.requests = 3;
  s.prompt_len = 8;
  s.decode_steps = 3;
  s.micro_batches = 3;
  return s;
}

// What a correct attention instance 0 of a 1A run would write: the
// reference's tokens, logits and residual stream after every layer, laid out
// as afd_attention lays them out (AttentionResults comments).
AttentionResults ReferenceResults(const RunShape& shape, const ModelConfig& config,
                                  bool dump_layers) {
  const int total = shape.attention * shape.requests;
  ReferenceModel model(config, ReferenceOptions{Codec::kAfd, shape.ffn, total,
                                                int64_t{shape.prompt_len} + shape.decode_steps});
  AttentionResults r = SizedResults(0, shape, config);
  std::fill(r.step_end_ns.begin(), r.step_end_ns.end(), 1);
  if (dump_layers) {
    // [step][layer][rows of the step][H], in the order the observer sees them.
    model.set_layer_observer([&](int, const StepState& state) {
      r.layer_hidden.insert(r.layer_hidden.end(), state.hidden.begin(), state.hidden.end());
    });
  }
  const std::vector<int32_t> flat = GeneratePromptTokens(config, total, shape.prompt_len);
  std::vector<std::vector<int32_t>> prompts(total);
  for (int g = 0; g < total; ++g) {
    prompts[g].assign(flat.begin() + g * shape.prompt_len,
                      flat.begin() + (g + 1) * shape.prompt_len);
  }
  const GenerationResult gen = model.Generate(prompts, shape.decode_steps);
  r.tokens.resize(size_t(total) * r.steps);
  for (int g = 0; g < total; ++g) {
    for (int s = 0; s < r.steps; ++s) r.tokens[size_t(g) * r.steps + s] = gen.tokens[g][s];
  }
  for (const auto& logits : gen.step_logits) {
    r.logits.insert(r.logits.end(), logits.begin(), logits.end());
  }
  return r;
}

// The Step-3 model of `config`, as LoadExampleModel makes it.
ExampleModel AsModel(const ModelConfig& config) {
  ExampleModel model;
  model.config = config;
  return model;
}

ExpectedResults Expect(const RunShape& shape, const ModelConfig& config, bool dumped) {
  return ExpectedResults{0,     &shape, config.num_layers, config.hidden_size, config.vocab_size,
                         dumped};
}

std::string TempPath(const std::string& name) {
  return "/tmp/afd_results_test." + std::to_string(::getpid()) + "." + name;
}

TEST_CASE("gate A passes only on bitwise equality", "[afd][gate_a]") {
  const ModelConfig config = Tiny();
  const RunShape shape = SmallShape();
  const AttentionResults good = ReferenceResults(shape, config, true);
  REQUIRE(ValidateResults(good, Expect(shape, config, true)).ok());
  // Gate A (per-layer dumps asked for) on `results`: passes or not, and the
  // summary says `says`.
  auto gate = [&](const AttentionResults& results, bool pass, const std::string& says) {
    const ReferenceCheck check = CheckAgainstReference(shape, AsModel(config), {results}, true);
    INFO(check.summary);
    CHECK(check.pass == pass);
    CHECK(check.summary.find(says) != std::string::npos);
  };

  SECTION("the reference's own results pass") {
    const ReferenceCheck check = CheckAgainstReference(shape, AsModel(config), {good}, true);
    INFO(check.summary);
    CHECK(check.pass);
    CHECK(check.summary.find("logits bitwise equal") != std::string::npos);
    CHECK(check.summary.find("per-layer residuals bitwise equal") != std::string::npos);
  }
  SECTION("one logit one ulp off fails") {
    AttentionResults bad = good;
    float& x = bad.logits[bad.logits.size() / 2 + 7];
    x = std::nextafter(x, INFINITY);
    // Within the old rel-L2 <= 1e-4 bound, which passed this run.
    const size_t v = config.vocab_size;
    const size_t row = (bad.logits.size() / 2 + 7) / v;
    CHECK(RelativeL2({bad.logits.data() + row * v, v}, {good.logits.data() + row * v, v}) < 1e-6);
    gate(bad, false, "logits 1 of 12 differ");
  }
  SECTION("one residual element one ulp off fails") {
    AttentionResults bad = good;
    float& x = bad.layer_hidden[bad.layer_hidden.size() - 3];
    x = std::nextafter(x, INFINITY);
    gate(bad, false, "per-layer residuals 1 of");
  }
  SECTION("a wrong token fails") {
    AttentionResults bad = good;
    bad.tokens[4] = (bad.tokens[4] + 1) % config.vocab_size;
    gate(bad, false, "11/12 tokens identical");
  }
  SECTION("missing per-layer dumps fail when they were asked for") {
    AttentionResults bad = good;
    bad.layer_hidden.clear();
    gate(bad, false, "did not dump its per-layer residuals");
    CHECK_FALSE(ValidateResults(bad, Expect(shape, config, true)).ok());
  }
  SECTION("without dumps asked for, tokens and logits still decide") {
    AttentionResults plain = good;
    plain.layer_hidden.clear();
    const ReferenceCheck check = CheckAgainstReference(shape, AsModel(config), {plain}, false);
    INFO(check.summary);
    CHECK(check.pass);
    CHECK(check.summary.find("not checked (--no-layer-check)") != std::string::npos);
  }
}

// Top-1 minus top-2 of a row.
float TestMargin(const float* row, int64_t v) {
  std::vector<float> sorted(row, row + v);
  std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
  return sorted[0] - sorted[1];
}

TEST_CASE("gate C bounds for the cuda engine", "[afd][gate_c]") {
  const ModelConfig config = Tiny();
  RunShape shape = SmallShape();
  shape.requests = 12;
  const AttentionResults good = ReferenceResults(shape, config, true);
  const int64_t v = config.vocab_size;
  auto check = [&](const AttentionResults& r) {
    return CheckAgainstReference(shape, AsModel(config), {r}, true, {}, GateMode::kBounded);
  };

  SECTION("exact results pass") {
    const ReferenceCheck c = check(good);
    INFO(c.summary);
    CHECK(c.pass);
    CHECK(c.summary.find("gate C bounds") != std::string::npos);
  }
  SECTION("bf16-sized noise passes the bound, not memcmp") {
    AttentionResults noisy = good;
    for (size_t i = 0; i < noisy.logits.size(); ++i) noisy.logits[i] *= 1.0f + 3e-3f * (i % 3);
    for (size_t i = 0; i < noisy.layer_hidden.size(); ++i) {
      noisy.layer_hidden[i] *= 1.0f - 3e-3f * (i % 2);
    }
    const ReferenceCheck c = check(noisy);
    INFO(c.summary);
    CHECK(c.pass);
    CHECK_FALSE(CheckAgainstReference(shape, AsModel(config), {noisy}, true).pass);
  }
  SECTION("logits or residuals over the bound fail") {
    AttentionResults bad = good;
    for (int64_t c = 0; c < v; ++c) bad.logits[5 * v + c] *= 1.2f;
    CHECK_FALSE(check(bad).pass);
    AttentionResults bad_layer = good;
    for (int64_t c = 0; c < 8 * config.hidden_size; ++c) bad_layer.layer_hidden[c] *= 1.3f;
    CHECK_FALSE(check(bad_layer).pass);
  }
  SECTION("a token differing where the reference is decisive fails; a near tie may differ") {
    // The last step: no later step is fed the changed token.
    const int last = shape.steps() - 1;
    int decisive = -1, tie = -1;
    for (int r = 0; r < shape.requests; ++r) {
      const float m = TestMargin(good.logits.data() + (size_t(last) * shape.requests + r) * v, v);
      if (m > 0.5f && decisive < 0) decisive = r;
      if (m <= kTokenMargin && tie < 0) tie = r;
    }
    REQUIRE(decisive >= 0);
    AttentionResults bad = good;
    int32_t& token = bad.tokens[size_t(decisive) * shape.steps() + last];
    token = (token + 1) % config.vocab_size;
    CHECK_FALSE(check(bad).pass);
    REQUIRE(tie >= 0);  // 12 requests: at least one near tie at the last step
    AttentionResults flipped = good;
    const float* row = good.logits.data() + (size_t(last) * shape.requests + tie) * v;
    std::vector<int32_t> order(v);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 2, order.end(),
                      [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    flipped.tokens[size_t(tie) * shape.steps() + last] = order[1];  // the runner-up
    const ReferenceCheck c = check(flipped);
    INFO(c.summary);
    CHECK(c.pass);
    CHECK(c.summary.find("(1 near ties differ") != std::string::npos);
  }
}

TEST_CASE("results files: round trip and size validation", "[afd][results]") {
  const ModelConfig config = Tiny();
  const RunShape shape = SmallShape();
  AttentionResults r = ReferenceResults(shape, config, true);
  const std::string path = TempPath("results");
  REQUIRE(WriteResults(path, r).ok());

  SECTION("round trip") {
    absl::StatusOr<AttentionResults> back = ReadResults(path, Expect(shape, config, true));
    REQUIRE(back.ok());
    CHECK(back->logits == r.logits);
    CHECK(back->layer_hidden == r.layer_hidden);
    CHECK(back->tokens == r.tokens);
  }
  SECTION("another run's shape is named") {
    RunShape other = shape;
    other.requests = 4;
    absl::StatusOr<AttentionResults> back = ReadResults(path, Expect(other, config, true));
    REQUIRE_FALSE(back.ok());
    CHECK(std::string(back.status().message()).find("requests is 3, the run needs 4") !=
          std::string::npos);
  }
  SECTION("dumps asked for but absent") {
    r.layer_hidden.clear();
    REQUIRE(WriteResults(path, r).ok());
    absl::StatusOr<AttentionResults> back = ReadResults(path, Expect(shape, config, true));
    REQUIRE_FALSE(back.ok());
    CHECK(std::string(back.status().message()).find("layer_hidden elements is 0") !=
          std::string::npos);
  }
  SECTION("a short vector is caught before any element is read") {
    r.logits.resize(r.logits.size() - 1);
    REQUIRE(WriteResults(path, r).ok());
    absl::StatusOr<AttentionResults> back = ReadResults(path, Expect(shape, config, true));
    REQUIRE_FALSE(back.ok());
    CHECK(std::string(back.status().message()).find("logits elements") != std::string::npos);
  }
  SECTION("truncated, corrupt count, trailing bytes") {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    REQUIRE(f != nullptr);
    std::vector<char> bytes(1 << 24);
    bytes.resize(std::fread(bytes.data(), 1, bytes.size(), f));
    std::fclose(f);
    auto write = [&](const std::vector<char>& b) {
      std::FILE* out = std::fopen(path.c_str(), "wb");
      REQUIRE(out != nullptr);
      REQUIRE(std::fwrite(b.data(), 1, b.size(), out) == b.size());
      std::fclose(out);
    };
    auto truncated = bytes;
    truncated.resize(bytes.size() - 100);
    write(truncated);
    CHECK(ReadResults(path, Expect(shape, config, true)).status().code() ==
          absl::StatusCode::kDataLoss);
    // The step_end_ns count (after the magic and 48 header bytes) says 2^60.
    auto corrupt = bytes;
    corrupt[8 + 48 + 7] = 0x10;
    write(corrupt);
    CHECK(ReadResults(path, Expect(shape, config, true)).status().code() ==
          absl::StatusCode::kDataLoss);
    auto trailing = bytes;
    trailing.push_back(0);
    write(trailing);
    absl::StatusOr<AttentionResults> back = ReadResults(path, Expect(shape, config, true));
    REQUIRE_FALSE(back.ok());
    CHECK(std::string(back.status().message()).find("trailing") != std::string::npos);
  }
  ::unlink(path.c_str());
}

TEST_CASE("A2F header: a frame for another layer, step or shape is refused", "[afd][wire]") {
  const WireHeader want{3, 2, 1, 48, 1, WireHeader::kMoeLayer, 256};
  int32_t words[kWireHeaderInts];
  WriteWireHeader(want, words);
  CHECK(CheckWireHeader(words, want, 0).ok());
  auto refused = [&](WireHeader sent) {
    int32_t w[kWireHeaderInts];
    WriteWireHeader(sent, w);
    const absl::Status s = CheckWireHeader(w, want, 1);
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kDataLoss);
    return std::string(s.message());
  };
  WireHeader other = want;
  other.layer = 3;
  CHECK(refused(other) ==
        "ffn 1: attention 1 sent step 3 layer 3 micro-batch 1, this FFN expects step 3 layer 2 "
        "micro-batch 1");
  other = want;
  other.step = 2;
  CHECK(refused(other).find("sent step 2 layer 2") != std::string::npos);
  other = want;
  other.micro_batch = 0;
  refused(other);
  other = want;
  other.rows = 47;
  CHECK(refused(other).find("47 rows") != std::string::npos);
  other = want;
  other.flags = 0;  // a dense-layer frame where the FFN expects MoE
  refused(other);
  other = want;
  other.instance = 0;
  refused(other);
  words[0] = 0;  // no header at all (a stale region)
  CHECK(CheckWireHeader(words, want, 0).message().find("without an A2F header") !=
        absl::string_view::npos);
}

TEST_CASE("NativeCudaStream: none behind a cpu_mock stream", "[afd][engine]") {
  std::unique_ptr<stepmesh::Backend> backend = stepmesh::CreateCpuMockBackend();
  absl::StatusOr<std::unique_ptr<stepmesh::Stream>> stream = backend->CreateStream();
  REQUIRE(stream.ok());
  // What the cuda engine's Bind gets on a stream of the wrong backend:
  // INVALID_ARGUMENT, or UNIMPLEMENTED from a libstepmesh built without CUDA.
  const absl::StatusCode code = stepmesh::NativeCudaStream(**stream).status().code();
  CHECK((code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kUnimplemented));
}

TEST_CASE("RowsContiguous: consecutive workers, full slots but the last", "[afd][engine]") {
  const std::vector<WorkerRows> prefill = {{0, 8}, {1, 8}, {2, 5}};
  CHECK(RowsContiguous(prefill, 8));
  const std::vector<WorkerRows> decode = {{0, 2}, {1, 2}};
  CHECK_FALSE(RowsContiguous(decode, 8));
  const std::vector<WorkerRows> gap = {{0, 8}, {2, 8}};
  CHECK_FALSE(RowsContiguous(gap, 8));
  CHECK(RowsContiguous(std::vector<WorkerRows>{{1, 3}}, 8));
  CHECK_FALSE(RowsContiguous({}, 8));
}

}  // namespace
}  // namespace afd::example
