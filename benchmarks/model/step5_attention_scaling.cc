// step5_attention_scaling: attention time per decode token against context
// length, tiny-Step-3 (MFA: every layer reads the whole history) against
// tiny-step5 (3 sliding-window layers per global sparse layer; the global
// layer scores T/8 block summaries and reads at most budget + 1 blocks).
// This is what moves the attention side's cost per token, and so the best
// A/F ratio, when contexts grow (docs/model.md, "Step-5-Preview").
//
//   step5_attention_scaling [--contexts 64,128,...,4096] [--decode 16]
//                           [--dat FILE]
//
// One sequence per model. The cache is filled to each context length by
// prefilling prompt tokens through the attention layers (the FFN is skipped:
// it does not touch the caches and its cost does not depend on the context),
// then `--decode` single-token steps are timed, each through every
// attention layer (AttentionSide::Attention / Step5AttentionSide::Attention:
// norms, projections, RoPE, the indexer, selection and attention, the output
// projection). The median step is reported, per token and per layer type.
// Both runs use the CPU kernels on one thread, measured in the same process.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "examples/afd_model/attention_side.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/step5/step5_attention_side.h"
#include "examples/afd_model/step5/step5_config.h"

namespace afd {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Step-3 tiny: prefill to `context`, time `decode` steps; returns per-token
// median microseconds over all layers.
struct Step3Timer {
  explicit Step3Timer(const ModelConfig& config, int64_t capacity)
      : config(config),
        side(config, 1, capacity),
        tokens(GeneratePromptTokens(config, 1, static_cast<int>(capacity))) {}

  void Run(std::span<const int32_t> chunk) {
    const SequenceChunk c{0, static_cast<int32_t>(chunk.size())};
    if (!side.BeginStep({&c, 1}, chunk, &state)) std::abort();
    for (int l = 0; l < config.num_layers; ++l) side.Attention(l, &state);
  }

  void FillTo(int64_t context) {
    while (side.SequenceLength(0) < context) {
      const int64_t at = side.SequenceLength(0);
      const int64_t n = std::min<int64_t>(256, context - at);
      Run(std::span<const int32_t>(tokens.data() + at, n));
    }
  }

  double DecodeMicros(int steps) {
    std::vector<double> times;
    for (int i = 0; i < steps; ++i) {
      const int64_t at = side.SequenceLength(0);
      const auto start = Clock::now();
      Run(std::span<const int32_t>(tokens.data() + at, 1));
      times.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    }
    return Median(times);
  }

  ModelConfig config;
  AttentionSide side;
  StepState state;
  std::vector<int32_t> tokens;
};

struct Step5Timer {
  explicit Step5Timer(const step5::Step5Config& config, int64_t capacity)
      : config(config),
        side(config, 1, capacity),
        tokens(GeneratePromptTokens(config.model, 1, static_cast<int>(capacity))) {}

  // Per layer type microseconds of one step (global, sliding).
  void Run(std::span<const int32_t> chunk, double* global_us, double* sliding_us) {
    const SequenceChunk c{0, static_cast<int32_t>(chunk.size())};
    if (!side.BeginStep({&c, 1}, chunk, &state)) std::abort();
    for (int l = 0; l < config.model.num_layers; ++l) {
      const auto start = Clock::now();
      side.Attention(l, &state);
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      *(config.is_global_layer[l] ? global_us : sliding_us) += us;
    }
  }

  void FillTo(int64_t context) {
    double ignored = 0.0;
    while (side.SequenceLength(0) < context) {
      const int64_t at = side.SequenceLength(0);
      const int64_t n = std::min<int64_t>(256, context - at);
      Run(std::span<const int32_t>(tokens.data() + at, n), &ignored, &ignored);
    }
  }

  // Medians of the total, the global layers and the sliding layers.
  void DecodeMicros(int steps, double* total, double* global, double* sliding) {
    std::vector<double> totals, globals, slidings;
    state.history_blocks = state.attended_blocks = 0;
    for (int i = 0; i < steps; ++i) {
      const int64_t at = side.SequenceLength(0);
      double g = 0.0, s = 0.0;
      Run(std::span<const int32_t>(tokens.data() + at, 1), &g, &s);
      totals.push_back(g + s);
      globals.push_back(g);
      slidings.push_back(s);
    }
    *total = Median(totals);
    *global = Median(globals);
    *sliding = Median(slidings);
  }

  step5::Step5Config config;
  step5::Step5AttentionSide side;
  step5::Step5StepState state;
  std::vector<int32_t> tokens;
};

int Main(int argc, char** argv) {
  std::vector<int64_t> contexts = {64, 128, 256, 512, 1024, 2048, 4096};
  int decode = 16;
  std::string dat;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "step5_attention_scaling: %s needs a value\n", flag.c_str());
      return 2;
    }
    const std::string value = argv[++i];
    if (flag == "--contexts") {
      contexts.clear();
      std::stringstream stream(value);
      std::string item;
      while (std::getline(stream, item, ',')) contexts.push_back(std::atoll(item.c_str()));
    } else if (flag == "--decode") {
      decode = std::atoi(value.c_str());
    } else if (flag == "--dat") {
      dat = value;
    } else {
      std::fprintf(
          stderr,
          "usage: step5_attention_scaling [--contexts a,b,...] [--decode N] [--dat FILE]\n");
      return 2;
    }
  }
  std::sort(contexts.begin(), contexts.end());
  if (contexts.empty() || contexts.front() <= 0 || decode <= 0) {
    std::fprintf(stderr, "step5_attention_scaling: contexts and --decode must be positive\n");
    return 2;
  }
  std::string error;
  const auto step3 = LoadModelConfig("tiny", BundledConfigDir(), &error);
  const auto step5 = step5::LoadStep5Config("tiny-step5", BundledConfigDir(), &error);
  if (!step3 || !step5) {
    std::fprintf(stderr, "step5_attention_scaling: %s\n", error.c_str());
    return 2;
  }
  // The decode steps after each context add to the last one, so the caches
  // hold a little more than the largest context. tiny-step3's
  // max_position_embedding is exactly 4096; its RoPE needs no table, so the
  // benchmark may go a few positions past it.
  const int64_t capacity =
      contexts.back() + int64_t{decode} * static_cast<int64_t>(contexts.size());
  if (contexts.back() > step3->max_positions || capacity > step5->model.max_positions) {
    std::fprintf(stderr, "step5_attention_scaling: contexts exceed max_position_embedding\n");
    return 2;
  }

  Step3Timer mfa(*step3, capacity);
  Step5Timer sparse(*step5, capacity);
  std::printf("attention per decode token, one sequence, CPU kernels, one thread\n");
  std::printf(
      "tiny-step3: %d MFA layers (8 heads x 64, 1 KV head); tiny-step5: %d sliding "
      "(window %lld) + %d global sparse (budget %lld blocks of %lld)\n",
      step3->num_layers, step5->num_sliding_layers(), static_cast<long long>(step5->sliding_window),
      step5->num_global_layers(), static_cast<long long>(step5->topk_blocks),
      static_cast<long long>(step5->block_size));
  std::printf("%8s %12s %12s %12s %12s %10s %12s %12s\n", "context", "step3 us", "step5 us",
              "s5 global", "s5 sliding", "s3/s5", "step3 KV B", "step5 KV B");
  std::ofstream out;
  if (!dat.empty()) {
    out.open(dat);
    out << "# context step3_us step5_us step5_global_us step5_sliding_us step3_kv_bytes "
           "step5_kv_bytes (per decode token; KV of the sequence, fp32 caches)\n";
  }
  for (const int64_t context : contexts) {
    mfa.FillTo(context);
    sparse.FillTo(context);
    const double s3 = mfa.DecodeMicros(decode);
    double s5 = 0.0, global = 0.0, sliding = 0.0;
    sparse.DecodeMicros(decode, &s5, &global, &sliding);
    const int64_t s3_kv = int64_t{step3->num_layers} * context * 2 * step3->head_dim * 4;
    const int64_t s5_kv = step5::KvBytes(*step5, context, 4).total();
    std::printf("%8lld %12.1f %12.1f %12.1f %12.1f %10.2f %12lld %12lld\n",
                static_cast<long long>(context), s3, s5, global, sliding, s3 / s5,
                static_cast<long long>(s3_kv), static_cast<long long>(s5_kv));
    if (out) {
      out << context << ' ' << s3 << ' ' << s5 << ' ' << global << ' ' << sliding << ' ' << s3_kv
          << ' ' << s5_kv << '\n';
    }
  }
  return 0;
}

}  // namespace
}  // namespace afd

int main(int argc, char** argv) { return afd::Main(argc, argv); }
