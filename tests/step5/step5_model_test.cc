// The Step-5 variant as a model: configs, streaming decode vs prefill
// identity, the dense-equivalence check (budget >= ceil(T/8) => dense causal
// attention), and a 112-token prompt whose selection really drops history.

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "examples/afd_model/config.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/reference.h"
#include "examples/afd_model/step5/step5_attention_side.h"
#include "examples/afd_model/step5/step5_config.h"
#include "examples/afd_model/step5/step5_reference.h"

namespace afd::step5 {
namespace {

Step5Config Load(const std::string& name) {
  std::string error;
  auto config = LoadStep5Config(name, BundledConfigDir(), &error);
  INFO(error);
  REQUIRE(config.has_value());
  return *config;
}

const Step5Config& Tiny() {
  static const Step5Config config = Load("tiny-step5");
  return config;
}

std::vector<int32_t> Prompt(const Step5Config& config, int request, int length) {
  const auto all = GeneratePromptTokens(config.model, request + 1, length);
  return std::vector<int32_t>(all.begin() + int64_t{request} * length, all.end());
}

TEST_CASE("step5 configs load", "[step5][config]") {
  const Step5Config& tiny = Tiny();
  CHECK(tiny.model.hidden_size == 256);
  CHECK(tiny.model.num_layers == 8);
  CHECK(tiny.is_global_layer ==
        std::vector<bool>{false, false, false, true, false, false, false, true});
  CHECK(tiny.model.is_moe_layer ==
        std::vector<bool>{false, true, true, true, true, true, true, false});
  CHECK(tiny.model.num_heads == 16);
  CHECK(tiny.num_kv_groups == 4);
  CHECK(tiny.model.head_dim == 48);
  CHECK(tiny.full_rotary_dim == 16);
  CHECK(tiny.index_heads_per_group() == 4);
  CHECK(tiny.index_dim == 64);
  CHECK(tiny.block_size == 8);
  CHECK(tiny.topk_blocks == 4);
  CHECK(tiny.sliding_window == 32);
  CHECK(tiny.model.q_rank == 0);

  const Step5Config full = Load("full-width-step5");
  CHECK(full.model.hidden_size == 4096);
  CHECK(full.heads_per_group() == 16);
  CHECK(full.topk_blocks == 512);
  CHECK(full.num_global_layers() == 1);

  // Step-5-Preview itself: 23 global + 69 sliding layers, 88 MoE layers; the
  // model card's "about 600 B total, 27 B active" within a few percent (the
  // checkpoint also holds 3 MTP layers and vision weights this does not count).
  const Step5Config step5 = Load("step5");
  CHECK(step5.num_global_layers() == 23);
  CHECK(step5.num_sliding_layers() == 69);
  CHECK(std::count(step5.model.is_moe_layer.begin(), step5.model.is_moe_layer.end(), true) == 88);
  const double total = static_cast<double>(step5.ParameterCount());
  const double active = static_cast<double>(step5.ActiveParameterCount());
  INFO("total " << total << " active " << active);
  CHECK(std::fabs(total / 600e9 - 1.0) < 0.03);
  CHECK(std::fabs(active / 27e9 - 1.0) < 0.05);
}

TEST_CASE("step5 config parser names what is wrong", "[step5][config]") {
  std::string error;
  CHECK_FALSE(ParseStep5Config("hidden_size = 256\n", &error).has_value());
  CHECK(error.find("missing keys") != std::string::npos);
  CHECK(error.find("index_topk_blocks") != std::string::npos);
  CHECK_FALSE(ParseStep5Config("just words\n", &error).has_value());
  CHECK(error.find("line 1") != std::string::npos);

  std::string error2;
  const auto base = LoadStep5ConfigFile(BundledConfigDir() + "/tiny_step5.cfg", &error2);
  REQUIRE(base.has_value());
  CHECK_FALSE(LoadStep5Config("no-such-config", BundledConfigDir(), &error).has_value());
  CHECK(error.find("no-such-config") != std::string::npos);
  CHECK_FALSE(IsStep5ConfigName("tiny"));
  CHECK(IsStep5ConfigName("tiny-step5"));
}

// The whole model, prefill of a 100-token prompt in one step vs the same
// tokens streamed in uneven chunks (1, 7, 8, 13, ...) and one token per step:
// every layer's residual stream and the logits must be bit-identical, which
// requires that a block is summarised only once complete (pending tokens are
// never summarised) and that every kernel is row-independent.
TEST_CASE("streaming decode and prefill give identical bits", "[step5][streaming]") {
  const Step5Config& config = Tiny();
  const int length = 100;
  const std::vector<int32_t> prompt = Prompt(config, 0, length);
  ReferenceOptions options;
  options.codec = Codec::kAfd;
  options.partitions = 2;
  options.max_sequences = 2;
  options.max_seq_len = length;

  auto run = [&](const std::vector<int>& chunk_sizes) {
    Step5ReferenceModel model(config, options);
    Step5StepState state;
    std::vector<float> hidden;  // [token][layer][H], in position order
    std::vector<float> logits;  // last token of every chunk ends up in here
    int offset = 0;
    size_t c = 0;
    while (offset < length) {
      const int n = std::min(chunk_sizes[c++ % chunk_sizes.size()], length - offset);
      // Sequence 1 rides along in the same steps with its own tokens, so the
      // batch layout differs between the runs too.
      const std::vector<SequenceChunk> chunks = {{1, 1}, {0, n}};
      std::vector<int32_t> tokens = {prompt[(offset * 7) % length]};
      tokens.insert(tokens.end(), prompt.begin() + offset, prompt.begin() + offset + n);
      std::vector<float> layers;
      REQUIRE(model.RunStep(chunks, tokens, &state, &layers));
      const int64_t h = config.model.hidden_size;
      const int64_t rows = n + 1;
      for (int i = 1; i < rows; ++i) {
        for (int l = 0; l < config.model.num_layers; ++l) {
          hidden.insert(hidden.end(), layers.begin() + (l * rows + i) * h,
                        layers.begin() + (l * rows + i + 1) * h);
        }
      }
      std::vector<float> step_logits;
      model.attention().LastTokenLogits(state, nullptr, &step_logits);
      logits.assign(step_logits.begin() + config.model.vocab_size, step_logits.end());
      offset += n;
    }
    return std::make_pair(hidden, logits);
  };
  const auto prefill = run({length});
  const auto streamed = run({1});
  const auto chunked = run({1, 7, 8, 13, 3, 16});
  REQUIRE(prefill.first.size() ==
          size_t(length) * config.model.num_layers * config.model.hidden_size);
  CHECK(streamed.first == prefill.first);
  CHECK(streamed.second == prefill.second);
  CHECK(chunked.first == prefill.first);
  CHECK(chunked.second == prefill.second);
}

// Runs the attention side through layers 0..layer with the fp32 FFN and
// returns the state right after layer `layer`'s attention.
Step5StepState AttentionAt(const Step5Config& config, int layer,
                           const std::vector<int32_t>& prompt) {
  ReferenceOptions options;
  options.max_seq_len = static_cast<int64_t>(prompt.size());
  Step5ReferenceModel model(config, options);
  Step5StepState state;
  const std::vector<SequenceChunk> chunks = {{0, static_cast<int32_t>(prompt.size())}};
  REQUIRE(model.attention().BeginStep(chunks, prompt, &state));
  for (int l = 0; l <= layer; ++l) {
    model.attention().Attention(l, &state);
    if (l == layer) break;
    model.ComputeFfnOutput(l, &state);
    model.attention().AddFfnOutput(&state);
  }
  return state;
}

// Dense causal GQA of every token in double, from the state's (normed,
// rotated) Q, K, V, then the sigmoid gate: what a global layer computes
// without any selection.
std::vector<double> DenseGatedAttention(const Step5Config& config, const Step5StepState& s) {
  const int64_t n = s.num_tokens();
  const int64_t heads = config.model.num_heads;
  const int64_t groups = config.num_kv_groups;
  const int64_t d = config.model.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> out(n * heads * d, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t g = h / (heads / groups);
      std::vector<double> w(t + 1);
      double m = -1e300;
      for (int64_t j = 0; j <= t; ++j) {
        double dot = 0.0;
        for (int64_t i = 0; i < d; ++i) {
          dot += double{s.queries[(t * heads + h) * d + i]} * s.keys[(j * groups + g) * d + i];
        }
        w[j] = dot * scale;
        m = std::max(m, w[j]);
      }
      double z = 0.0;
      for (double& x : w) z += (x = std::exp(x - m));
      const double gate = 1.0 / (1.0 + std::exp(-double{s.gates[t * heads + h]}));
      for (int64_t j = 0; j <= t; ++j) {
        for (int64_t i = 0; i < d; ++i) {
          out[(t * heads + h) * d + i] += gate * w[j] / z * s.values[(j * groups + g) * d + i];
        }
      }
    }
  }
  return out;
}

double RelError(const float* a, const double* b, int64_t count) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return std::sqrt(diff / norm);
}

TEST_CASE("dense equivalence: a budget of ceil(T/8) blocks is dense causal attention",
          "[step5][dense]") {
  Step5Config config = Tiny();
  const int length = 112;
  config.topk_blocks = (length + config.block_size - 1) / config.block_size;  // 14
  const std::vector<int32_t> prompt = Prompt(config, 0, length);
  const Step5StepState s = AttentionAt(config, 3, prompt);
  CHECK(s.attended_blocks == s.history_blocks);  // every history block selected
  const auto dense = DenseGatedAttention(config, s);
  const int64_t row = config.q_width();
  double worst = 0.0;
  for (int64_t t = 0; t < length; ++t) {
    worst = std::max(worst, RelError(s.attn_heads.data() + t * row, dense.data() + t * row, row));
  }
  INFO("worst per-token rel L2 vs dense: " << worst);
  CHECK(worst < 1e-5);
}

TEST_CASE("a 112-token prompt: selection drops history, and it matters", "[step5][sparse]") {
  const Step5Config& config = Tiny();
  const int length = 112;  // 14 blocks; budget 4 + the current one
  const std::vector<int32_t> prompt = Prompt(config, 0, length);
  const Step5StepState s = AttentionAt(config, 3, prompt);
  // (token, group) pairs: sum over t of floor(t/8) history blocks, each
  // group attending min(4, floor(t/8)).
  int64_t history = 0, attended = 0;
  for (int64_t t = 0; t < length; ++t) {
    history += t / 8;
    attended += std::min<int64_t>(4, t / 8);
  }
  CHECK(s.history_blocks == history * config.num_kv_groups);
  CHECK(s.attended_blocks == attended * config.num_kv_groups);
  const double fraction = double(s.attended_blocks) / double(s.history_blocks);
  INFO("fraction of history blocks attended: " << fraction);
  CHECK(fraction < 0.6);

  // Tokens whose history fits the budget (t < 40) see exactly the dense
  // causal window; later tokens lose blocks and their output moves away from
  // dense attention.
  const auto dense = DenseGatedAttention(config, s);
  const int64_t row = config.q_width();
  double early = 0.0, late_min = 1e9, late_max = 0.0;
  for (int64_t t = 0; t < length; ++t) {
    const double e = RelError(s.attn_heads.data() + t * row, dense.data() + t * row, row);
    if (t < 40) {
      early = std::max(early, e);
    } else if (t >= 96) {
      late_min = std::min(late_min, e);
      late_max = std::max(late_max, e);
    }
  }
  INFO("early max " << early << ", late min " << late_min << ", late max " << late_max);
  CHECK(early < 1e-5);
  CHECK(late_max > 1e-2);
  CHECK(late_min > 1e-4);
}

TEST_CASE("AFD emulation with 2 partitions stays close to fp32", "[step5][gate]") {
  const Step5Config& config = Tiny();
  const int length = 96;
  std::vector<std::vector<int32_t>> prompts = {Prompt(config, 0, length),
                                               Prompt(config, 1, length)};
  ReferenceOptions options;
  options.max_sequences = 2;
  options.max_seq_len = length + 8;
  Step5ReferenceModel fp32(config, options);
  options.codec = Codec::kAfd;
  options.partitions = 2;
  Step5ReferenceModel afd(config, options);
  // Prefill both prompts, then the final norm and LM head of their last tokens.
  auto prefill = [&](Step5ReferenceModel& model, Step5StepState* state) {
    const std::vector<SequenceChunk> chunks = {{0, length}, {1, length}};
    std::vector<int32_t> tokens = prompts[0];
    tokens.insert(tokens.end(), prompts[1].begin(), prompts[1].end());
    REQUIRE(model.RunStep(chunks, tokens, state));
    std::vector<float> hidden, logits;
    model.attention().LastTokenLogits(*state, &hidden, &logits);
    return std::make_pair(hidden, logits);
  };
  Step5StepState fp32_state, state;
  const auto [a_hidden, a_logits] = prefill(fp32, &fp32_state);
  const auto [b_hidden, b_logits] = prefill(afd, &state);
  for (float x : b_logits) REQUIRE(std::isfinite(x));
  const double logits_error = RelativeL2(b_logits, a_logits);
  const double hidden_error = RelativeL2(b_hidden, a_hidden);
  INFO("afd vs fp32: logits " << logits_error << ", final hidden " << hidden_error);
  // Gate C of the Step-3 example (rel L2 <= 0.05 at 6 layers, scaled by
  // sqrt(8/6) for 8).
  CHECK(logits_error < 0.058);
  CHECK(hidden_error < 0.058);
  CHECK(state.history_blocks > state.attended_blocks);
}

TEST_CASE("kv footprint formula", "[step5][memory]") {
  const Step5Config& tiny = Tiny();
  const KvFootprint f = KvBytes(tiny, 100, 2);
  // 2 global layers x 100 positions x (K+V: 2 x 4 groups x 48) x 2 B, and 6
  // sliding rings of 32 positions.
  CHECK(f.original == 2 * 100 * 768 + 6 * 32 * 768);
  CHECK(f.summaries == 2 * 12 * 64);
  CHECK(f.proxy == 2 * 4 * 2 * 64 * 4);
  // The seed's figure for Step-5-Preview at T = 1,048,576, BF16: 69 GiB of
  // global K/V, 103.5 MiB of sliding rings, 736 MiB of summaries.
  const Step5Config step5 = Load("step5");
  const KvFootprint big = KvBytes(step5, 1 << 20, 2);
  CHECK(big.original == 3072LL * (23LL * (1 << 20) + 69 * 512));
  CHECK(big.summaries == 23LL * (1 << 17) * 256);
  CHECK(big.summaries == 736LL << 20);
}

}  // namespace
}  // namespace afd::step5
