#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "examples/afd_model/attention_side.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/ffn_side.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/reference.h"
#include "examples/afd_model/weights.h"
#include "examples/afd_model/wire.h"

namespace afd {
namespace {

ModelConfig LoadBundled(const std::string& name) {
  std::string error;
  auto config = LoadModelConfig(name, BundledConfigDir(), &error);
  INFO(error);
  REQUIRE(config.has_value());
  return *config;
}

const ModelConfig& Tiny() {
  static const ModelConfig config = LoadBundled("tiny");
  return config;
}

std::vector<std::vector<int32_t>> Prompts(const ModelConfig& config, int batch, int length) {
  const auto flat = GeneratePromptTokens(config, batch, length);
  std::vector<std::vector<int32_t>> prompts(batch);
  for (int s = 0; s < batch; ++s) {
    prompts[s].assign(flat.begin() + s * length, flat.begin() + (s + 1) * length);
  }
  return prompts;
}

TEST_CASE("bundled configs load", "[model][config]") {
  const ModelConfig& tiny = Tiny();
  CHECK(tiny.hidden_size == 256);
  CHECK(tiny.num_layers == 6);
  CHECK(tiny.is_moe_layer == std::vector<bool>{false, true, true, true, true, false});
  CHECK(tiny.q_rank == 128);
  CHECK(tiny.num_heads == 8);
  CHECK(tiny.head_dim == 64);
  CHECK(tiny.num_experts == 16);
  CHECK(tiny.top_k == 3);
  CHECK(tiny.vocab_size == 2048);
  CHECK(tiny.weight_seed == 0x5354455033ull);
  CHECK(std::abs(tiny.ParameterCount() - 13'650'000) < 10'000);

  const ModelConfig full = LoadBundled("full");
  CHECK(full.num_layers == 4);
  CHECK(full.expert_intermediate == 5120);
  CHECK(full.dense_intermediate == 18432);

  // The real Step-3: 5 dense layers (0-3 and 60), 316,294,538,240 parameters.
  const ModelConfig step3 = LoadBundled("step3");
  CHECK(step3.num_layers == 61);
  CHECK(std::count(step3.is_moe_layer.begin(), step3.is_moe_layer.end(), false) == 5);
  CHECK(!step3.is_moe_layer[3]);
  CHECK(step3.is_moe_layer[4]);
  CHECK(step3.is_moe_layer[59]);
  CHECK(!step3.is_moe_layer[60]);
  CHECK(step3.ParameterCount() == 316'294'538'240LL);
}

TEST_CASE("config parser rejects bad input", "[model][config]") {
  std::string error;
  CHECK_FALSE(ParseModelConfig("hidden_size = 256\n", &error).has_value());
  CHECK(error.find("missing") != std::string::npos);
  CHECK_FALSE(ParseModelConfig("no equals sign\n", &error).has_value());
  CHECK_FALSE(LoadModelConfig("/nonexistent.cfg", "", &error).has_value());
}

TEST_CASE("weights follow the SplitMix64 scheme", "[model][weights]") {
  // SplitMix64 reference values for seed 0 (first outputs of the stream).
  CHECK(SplitMix64(0) == 0xE220A8397B1DCDAFull);
  CHECK(Fnv1a64("") == 0xCBF29CE484222325ull);
  CHECK(Fnv1a64("a") == 0xAF63DC4C8601EC8Cull);
  const ModelConfig& config = Tiny();
  const TensorSpec wq{LayerTensorName(1, "self_attn.wq.weight"), WeightKind::kLinear,
                      config.q_rank};
  std::vector<float> values(4096);
  FillTensor(wq, config.weight_seed, 0, 4096, values.data());
  const uint64_t key = TensorKey(wq.name, config.weight_seed);
  for (int i = 0; i < 4096; ++i) {
    // fan_in 128: s = round(log2 sqrt 128) = 4, value = k * 2^-11.
    REQUIRE(values[i] == std::ldexp(static_cast<float>(WeightInt(key, i)), -11));
  }
  double sum = 0.0, sum_squares = 0.0;
  for (const float v : values) {
    sum += v;
    sum_squares += double{v} * v;
  }
  const double stddev = std::sqrt(sum_squares / 4096 - (sum / 4096) * (sum / 4096));
  // Uniform bytes have std 73.9; times 2^-11 that is 0.58/sqrt(128)/sqrt(2)
  // (s rounds log2 sqrt(128) = 3.5 up, the scheme's documented tie rule).
  CHECK(stddev == Approx(73.9 / 2048).epsilon(0.05));
  // Slices equal the whole tensor generated at once.
  std::vector<float> slice(100);
  FillTensor(wq, config.weight_seed, 1000, 100, slice.data());
  CHECK(std::equal(slice.begin(), slice.end(), values.begin() + 1000));
  // Norm gammas lie in [0.875, 1.117].
  std::vector<float> gamma(256);
  FillTensor({"model.norm.weight", WeightKind::kNormGamma, 1}, config.weight_seed, 0, 256,
             gamma.data());
  for (float g : gamma) {
    CHECK(g >= 0.875f);
    CHECK(g <= 1.1171875f);
  }
}

TEST_CASE("prefill in one chunk equals prefill then cached decode", "[model]") {
  const ModelConfig& config = Tiny();
  ReferenceModel model(config, {Codec::kNone, 1, 2, 32});
  const auto prompts = Prompts(config, 2, 10);
  StepState whole;
  std::vector<int32_t> tokens = prompts[0];
  tokens.insert(tokens.end(), prompts[1].begin(), prompts[1].end());
  const std::vector<SequenceChunk> chunks = {{0, 10}, {1, 10}};
  REQUIRE(model.RunStep(chunks, tokens, &whole));
  std::vector<float> whole_logits;
  model.attention().LastTokenLogits(whole, nullptr, &whole_logits);

  // Same tokens: 7-token prefill, then three single-token decode steps.
  model.attention().ResetSequence(0);
  model.attention().ResetSequence(1);
  StepState step;
  std::vector<int32_t> first(prompts[0].begin(), prompts[0].begin() + 7);
  first.insert(first.end(), prompts[1].begin(), prompts[1].begin() + 7);
  const std::vector<SequenceChunk> prefill_chunks = {{0, 7}, {1, 7}};
  REQUIRE(model.RunStep(prefill_chunks, first, &step));
  const std::vector<SequenceChunk> decode_chunks = {{0, 1}, {1, 1}};
  for (int t = 7; t < 10; ++t) {
    const std::vector<int32_t> next = {prompts[0][t], prompts[1][t]};
    REQUIRE(model.RunStep(decode_chunks, next, &step));
  }
  CHECK(model.attention().SequenceLength(0) == 10);
  std::vector<float> decode_logits;
  model.attention().LastTokenLogits(step, nullptr, &decode_logits);
  CHECK(RelativeL2(decode_logits, whole_logits) < 1e-5);
}

TEST_CASE("BeginStep rejects overflow and bad tokens", "[model]") {
  AttentionSide side(Tiny(), 1, 4);
  StepState state;
  const std::vector<SequenceChunk> too_long = {{0, 5}};
  CHECK_FALSE(side.BeginStep(too_long, std::vector<int32_t>(5, 1), &state));
  const std::vector<SequenceChunk> one = {{0, 1}};
  CHECK_FALSE(side.BeginStep(one, std::vector<int32_t>{4096}, &state));
  CHECK_FALSE(side.BeginStep(std::vector<SequenceChunk>{{1, 1}}, std::vector<int32_t>{3}, &state));
  CHECK(side.BeginStep(one, std::vector<int32_t>{3}, &state));
  CHECK(side.SequenceLength(0) == 1);
}

TEST_CASE("FFN partitions add up to the whole FFN", "[model]") {
  const ModelConfig& config = Tiny();
  AttentionSide side(config, 1, 16);
  StepState state;
  const auto prompts = Prompts(config, 1, 6);
  REQUIRE(side.BeginStep(std::vector<SequenceChunk>{{0, 6}}, prompts[0], &state));
  const int64_t n = state.num_tokens();
  const int64_t h = config.hidden_size;
  FfnSide whole(config, {0, 1});
  std::vector<FfnSide> parts;
  for (int p = 0; p < 3; ++p) parts.emplace_back(config, FfnPartition{p, 3});
  FfnWorkspace workspace;
  for (int layer : {0, 1}) {  // one dense, one MoE layer
    side.Attention(layer, &state);
    side.PrepareFfnInput(layer, &state);
    std::vector<float> expected(n * h);
    whole.ForwardFp32(layer, n, state.normed.data(), state.topk_ids.data(),
                      state.topk_weights.data(), expected.data(), &workspace);
    std::vector<float> sum(n * h, 0.0f), partial(n * h);
    for (const FfnSide& part : parts) {
      part.ForwardFp32(layer, n, state.normed.data(), state.topk_ids.data(),
                       state.topk_weights.data(), partial.data(), &workspace);
      for (int64_t i = 0; i < n * h; ++i) sum[i] += partial[i];
    }
    INFO("layer " << layer);
    CHECK(RelativeL2(sum, expected) < 1e-5);
  }
}

// What the disaggregated run does, by hand: the attention side writes the
// A2F wire, each FFN partition reads it and writes its F2A wire, and the
// attention side reduces. It must equal the reference's AFD emulation bit
// for bit (the structure behind gate A).
TEST_CASE("hand-driven wire round trip equals the AFD emulation bitwise", "[model][gate_a]") {
  const ModelConfig& config = Tiny();
  constexpr int kPartitions = 2;
  const auto prompts = Prompts(config, 2, 8);
  ReferenceModel reference(config, {Codec::kAfd, kPartitions, 2, 16});
  const GenerationResult expected = reference.Generate(prompts, 3);

  AttentionSide attention(config, 2, 16);
  std::vector<FfnSide> ffns;
  for (int p = 0; p < kPartitions; ++p) {
    ffns.emplace_back(config, FfnPartition{p, kPartitions});
  }
  FfnWorkspace workspace;
  StepState state;
  std::vector<SequenceChunk> chunks = {{0, 8}, {1, 8}};
  std::vector<int32_t> inputs = prompts[0];
  inputs.insert(inputs.end(), prompts[1].begin(), prompts[1].end());
  for (int step = 0; step < 4; ++step) {
    REQUIRE(attention.BeginStep(chunks, inputs, &state));
    const int64_t n = state.num_tokens();
    const A2FSizes sizes{n, config.hidden_size, config.top_k, kFp8GroupSize};
    std::vector<uint8_t> codes(sizes.codes_bytes());
    std::vector<float> scales(sizes.scales_bytes() / sizeof(float));
    std::vector<int32_t> ids(sizes.topk_ids_bytes() / sizeof(int32_t));
    std::vector<float> weights(sizes.topk_weights_bytes() / sizeof(float));
    std::vector<std::vector<uint16_t>> f2a(
        kPartitions,
        std::vector<uint16_t>(F2APartialBytes(n, config.hidden_size) / sizeof(uint16_t)));
    for (int l = 0; l < config.num_layers; ++l) {
      attention.Attention(l, &state);
      attention.PrepareFfnInput(l, &state);
      const A2FBuffers a2f{codes.data(), scales.data(), ids.data(), weights.data()};
      attention.WriteA2F(state, a2f);
      std::vector<const uint16_t*> partials;
      for (int p = 0; p < kPartitions; ++p) {
        ffns[p].Forward(l, AsView(a2f, n), f2a[p].data(), &workspace);
        partials.push_back(f2a[p].data());
      }
      attention.ApplyF2A(partials, &state);
    }
    std::vector<float> logits;
    attention.LastTokenLogits(state, nullptr, &logits);
    INFO("step " << step);
    CHECK(logits == expected.step_logits[step]);
    chunks = {{0, 1}, {1, 1}};
    inputs = {expected.tokens[0][step], expected.tokens[1][step]};
  }
}

// Gate B: teacher-forced per layer. The unquantised reference drives the
// residual stream; at every layer the AFD path (FP8 A2F, 2 partitions, BF16
// F2A) computes the FFN of the same y.
TEST_CASE("gate B: teacher-forced FFN output error per layer", "[model][gate_b]") {
  const ModelConfig& config = Tiny();
  ReferenceModel exact(config, {Codec::kNone, 1, 2, 16});
  ReferenceModel afd(config, {Codec::kAfd, 2, 2, 16});
  const auto prompts = Prompts(config, 2, 12);
  std::vector<int32_t> tokens = prompts[0];
  tokens.insert(tokens.end(), prompts[1].begin(), prompts[1].end());
  const std::vector<SequenceChunk> chunks = {{0, 12}, {1, 12}};
  StepState state;
  REQUIRE(exact.attention().BeginStep(chunks, tokens, &state));
  const int64_t n = state.num_tokens();
  const int64_t h = config.hidden_size;
  double worst_ffn = 0.0, worst_residual = 0.0;
  for (int l = 0; l < config.num_layers; ++l) {
    exact.attention().Attention(l, &state);
    afd.ComputeFfnOutput(l, &state);
    const std::vector<float> afd_ffn = state.ffn_output;
    exact.ComputeFfnOutput(l, &state);
    for (int64_t t = 0; t < n; ++t) {
      const std::span<const float> a(afd_ffn.data() + t * h, h);
      const std::span<const float> e(state.ffn_output.data() + t * h, h);
      const double ffn_error = RelativeL2(a, e);
      std::vector<float> afd_residual(h), exact_residual(h);
      for (int64_t c = 0; c < h; ++c) {
        afd_residual[c] = state.hidden[t * h + c] + a[c];
        exact_residual[c] = state.hidden[t * h + c] + e[c];
      }
      const double residual_error = RelativeL2(afd_residual, exact_residual);
      INFO("layer " << l << " token " << t);
      CHECK(ffn_error <= 0.08);
      CHECK(residual_error <= 0.02);
      CHECK(ffn_error > 0.0);  // the codec really ran
      worst_ffn = std::max(worst_ffn, ffn_error);
      worst_residual = std::max(worst_residual, residual_error);
    }
    exact.attention().AddFfnOutput(&state);
  }
  WARN("gate B: max FFN rel L2 " << worst_ffn << ", max post-residual rel L2 " << worst_residual);
}

// Gate C: end to end on tiny (6 layers), the AFD emulation against fp32,
// decode inputs forced to the fp32 run's tokens so both see the same text.
TEST_CASE("gate C: end-to-end final hidden and logits", "[model][gate_c]") {
  const ModelConfig& config = Tiny();
  const auto prompts = Prompts(config, 2, 12);
  constexpr int kDecodeSteps = 4;
  ReferenceModel exact(config, {Codec::kNone, 1, 2, 16});
  const GenerationResult reference = exact.Generate(prompts, kDecodeSteps);
  ReferenceModel afd(config, {Codec::kAfd, 2, 2, 16});
  const GenerationResult emulated = afd.Generate(prompts, kDecodeSteps, &reference.tokens);
  REQUIRE(emulated.step_logits.size() == reference.step_logits.size());
  double worst_hidden = 0.0, worst_logits = 0.0;
  for (size_t step = 0; step < reference.step_logits.size(); ++step) {
    const double hidden_error =
        RelativeL2(emulated.step_final_hidden[step], reference.step_final_hidden[step]);
    const double logits_error = RelativeL2(emulated.step_logits[step], reference.step_logits[step]);
    INFO("step " << step);
    CHECK(hidden_error <= 0.05);
    CHECK(logits_error <= 0.05);
    CHECK(logits_error > 0.0);
    worst_hidden = std::max(worst_hidden, hidden_error);
    worst_logits = std::max(worst_logits, logits_error);
  }
  WARN("gate C: max final-hidden rel L2 " << worst_hidden << ", max logits rel L2 "
                                          << worst_logits);
}

}  // namespace
}  // namespace afd

namespace afd {
namespace {

TEST_CASE("kv cache formats: sizes and names", "[model][kv_cache]") {
  CHECK(KvCacheBytesPerToken(KvCacheFormat::kFp32, 256) == 2048);
  CHECK(KvCacheBytesPerToken(KvCacheFormat::kBf16, 256) == 1024);  // Step-3's BF16: 1 KiB
  // Step-3's FP8 cache is 512 B of codes; the per-token scales add 8 B.
  CHECK(KvCacheBytesPerToken(KvCacheFormat::kFp8, 256) == 520);
  for (KvCacheFormat f : {KvCacheFormat::kFp32, KvCacheFormat::kBf16, KvCacheFormat::kFp8}) {
    KvCacheFormat parsed = KvCacheFormat::kFp32;
    REQUIRE(ParseKvCacheFormat(KvCacheFormatName(f), &parsed));
    CHECK(parsed == f);
  }
  KvCacheFormat unchanged = KvCacheFormat::kBf16;
  CHECK_FALSE(ParseKvCacheFormat("fp16", &unchanged));
  CHECK(unchanged == KvCacheFormat::kBf16);
}

TEST_CASE("kv cache formats: fp32 is the default, bf16 and fp8 stay close", "[model][kv_cache]") {
  const ModelConfig& config = Tiny();
  const auto prompts = Prompts(config, 2, 8);
  const ReferenceOptions base{Codec::kNone, 1, 2, 8 + 32};
  const GenerationResult plain = ReferenceModel(config, base).Generate(prompts, 32);
  ReferenceOptions fp32 = base;
  fp32.kv_format = KvCacheFormat::kFp32;
  CHECK(ReferenceModel(config, fp32).Generate(prompts, 32).step_logits == plain.step_logits);

  // Teacher forced over 32 decode steps (docs/model.md has the 256-step
  // figures): bf16 moves logits by ~3e-4 relative on average, fp8 by ~4e-3;
  // both must change something (the cache really is narrower) and keep the
  // top-1 token almost always.
  const KvCacheEffect bf16 = MeasureKvCacheEffect(config, base, KvCacheFormat::kBf16, prompts, 32);
  const KvCacheEffect fp8 = MeasureKvCacheEffect(config, base, KvCacheFormat::kFp8, prompts, 32);
  INFO("bf16 mean " << bf16.logits_rel_l2_mean << " max " << bf16.logits_rel_l2_max << " top1 "
                    << bf16.top1_agree << "/" << bf16.tokens);
  INFO("fp8 mean " << fp8.logits_rel_l2_mean << " max " << fp8.logits_rel_l2_max << " top1 "
                   << fp8.top1_agree << "/" << fp8.tokens);
  CHECK(bf16.tokens == 2 * 33);
  CHECK(bf16.logits_rel_l2_mean > 0.0);
  CHECK(bf16.logits_rel_l2_mean < 2e-3);
  CHECK(fp8.logits_rel_l2_mean > bf16.logits_rel_l2_mean);
  CHECK(fp8.logits_rel_l2_mean < 2e-2);
  CHECK(bf16.top1_agree >= bf16.tokens - 1);
  CHECK(fp8.top1_agree >= fp8.tokens * 9 / 10);
}

}  // namespace
}  // namespace afd
