// afd_reference: runs the monolithic Step-3 example forward (prefill a batch
// of prompts, then greedy decode) and prints the tokens, timing and tokens/s.
//
//   afd_reference [--config tiny|full|step3|PATH] [--prompt-len N]
//                 [--decode-steps N] [--batch B] [--codec none|afd]
//                 [--partitions F] [--max-params N] [--dump FILE]
//                 [--kv-cache fp32|bf16|fp8] [--compare-kv-cache 0|1]
//
// --compare-kv-cache 1 measures the --kv-cache format against the fp32 cache
// (MeasureKvCacheEffect): teacher-forced logits rel-L2 and top-1 agreement,
// free-running token agreement.
//
// --dump FILE writes the greedy tokens, every step's logits and the residual
// stream after every layer, for tests/model/compare_numpy_reference.py:
//   "AFDREF01", int64 batch, prompt_len, decode_steps, layers, hidden, vocab,
//   int32 tokens [batch][steps], f32 logits [steps][batch][vocab],
//   then per step f32 hidden [layers][rows][hidden] (rows request-major:
//   batch*prompt_len at step 0, batch after), steps = decode_steps + 1.

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "examples/afd_model/config.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/reference.h"

namespace {

struct Flags {
  std::string config = "tiny";
  int prompt_len = 16;
  int decode_steps = 16;
  int batch = 4;
  afd::Codec codec = afd::Codec::kNone;
  int partitions = 2;
  std::string dump;
  afd::KvCacheFormat kv_format = afd::KvCacheFormat::kFp32;
  bool compare_kv = false;
  // Weights are materialised in fp32 host memory; refuse configs that would
  // not fit instead of thrashing (full-width is for the GPU path).
  int64_t max_params = 2'000'000'000;
};

void PrintUsage() {
  std::fprintf(stderr,
               "usage: afd_reference [--config tiny|full|step3|PATH] "
               "[--prompt-len N] [--decode-steps N] [--batch B] "
               "[--codec none|afd] [--partitions F] [--max-params N] "
               "[--dump FILE] [--kv-cache fp32|bf16|fp8] "
               "[--compare-kv-cache 0|1]\n");
}

bool ParsePositive(std::string_view text, int64_t* value) {
  char* end = nullptr;
  const std::string owned(text);
  const long long parsed = std::strtoll(owned.c_str(), &end, 10);
  if (owned.empty() || *end != '\0' || parsed <= 0) return false;
  *value = parsed;
  return true;
}

bool ParseFlags(int argc, char** argv, Flags* flags) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view name = argv[i];
    if (name == "--help" || name == "-h") return false;
    if (i + 1 >= argc) {
      std::fprintf(stderr, "missing value for %s\n", argv[i]);
      return false;
    }
    const std::string_view value = argv[++i];
    int64_t number = 0;
    const bool is_number = ParsePositive(value, &number);
    if (name == "--config") {
      flags->config = value;
    } else if (name == "--dump") {
      flags->dump = value;
    } else if (name == "--kv-cache" && afd::ParseKvCacheFormat(value, &flags->kv_format)) {
    } else if (name == "--compare-kv-cache" && (value == "0" || value == "1")) {
      flags->compare_kv = value == "1";
    } else if (name == "--codec" && (value == "none" || value == "afd")) {
      flags->codec = value == "none" ? afd::Codec::kNone : afd::Codec::kAfd;
    } else if (name == "--prompt-len" && is_number) {
      flags->prompt_len = static_cast<int>(number);
    } else if (name == "--decode-steps" && (is_number || value == "0")) {
      flags->decode_steps = static_cast<int>(number);
    } else if (name == "--batch" && is_number) {
      flags->batch = static_cast<int>(number);
    } else if (name == "--partitions" && is_number) {
      flags->partitions = static_cast<int>(number);
    } else if (name == "--max-params" && is_number) {
      flags->max_params = number;
    } else {
      std::fprintf(stderr, "bad flag or value: %s %s\n", argv[i - 1], argv[i]);
      return false;
    }
  }
  return true;
}

bool WriteDump(const Flags& flags, const afd::ModelConfig& config,
               const afd::GenerationResult& result,
               const std::vector<std::vector<float>>& layer_hidden) {
  std::FILE* f = std::fopen(flags.dump.c_str(), "wb");
  if (f == nullptr) return false;
  bool ok = std::fwrite("AFDREF01", 1, 8, f) == 8;
  for (int64_t v : {int64_t{flags.batch}, int64_t{flags.prompt_len}, int64_t{flags.decode_steps},
                    int64_t{config.num_layers}, config.hidden_size, config.vocab_size}) {
    ok = ok && std::fwrite(&v, sizeof(v), 1, f) == 1;
  }
  auto write = [&](const auto& v) {
    ok = ok && std::fwrite(v.data(), sizeof(v[0]), v.size(), f) == v.size();
  };
  for (const auto& tokens : result.tokens) write(tokens);
  for (const auto& logits : result.step_logits) write(logits);
  for (const auto& hidden : layer_hidden) write(hidden);
  return std::fclose(f) == 0 && ok;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) {
    PrintUsage();
    return 2;
  }
  std::string error;
  const auto config = afd::LoadModelConfig(flags.config, afd::BundledConfigDir(), &error);
  if (!config) {
    std::fprintf(stderr, "config: %s\n", error.c_str());
    return 1;
  }
  const int64_t params = config->ParameterCount();
  std::printf(
      "model %s: %d layers, hidden %lld, %d experts top-%d, "
      "%.3f B parameters\n",
      config->name.c_str(), config->num_layers, static_cast<long long>(config->hidden_size),
      config->num_experts, config->top_k, static_cast<double>(params) * 1e-9);
  if (params > flags.max_params) {
    std::fprintf(stderr,
                 "%lld parameters exceed --max-params %lld (fp32 host "
                 "weights); use the CUDA path or raise the limit\n",
                 static_cast<long long>(params), static_cast<long long>(flags.max_params));
    return 1;
  }
  const int64_t max_len = int64_t{flags.prompt_len} + flags.decode_steps;
  if (max_len > config->max_positions) {
    std::fprintf(stderr, "prompt + decode exceeds max_position_embedding\n");
    return 1;
  }
  if (flags.codec == afd::Codec::kAfd && flags.partitions > config->num_experts) {
    std::fprintf(stderr, "--partitions must not exceed the expert count\n");
    return 1;
  }

  const afd::ReferenceOptions options{flags.codec, flags.partitions, flags.batch, max_len,
                                      flags.kv_format};
  const std::vector<int32_t> flat =
      afd::GeneratePromptTokens(*config, flags.batch, flags.prompt_len);
  std::vector<std::vector<int32_t>> prompts(flags.batch);
  for (int s = 0; s < flags.batch; ++s) {
    prompts[s].assign(flat.begin() + int64_t{s} * flags.prompt_len,
                      flat.begin() + int64_t{s + 1} * flags.prompt_len);
  }
  if (flags.compare_kv) {
    const afd::KvCacheEffect e =
        afd::MeasureKvCacheEffect(*config, options, flags.kv_format, prompts, flags.decode_steps);
    std::printf(
        "kv cache %s vs fp32 (codec %s, batch %d, prompt %d, %d decode steps, %lld B/token/layer "
        "vs %lld): teacher forced: logits rel-L2 mean %.3g max %.3g, top-1 agreement %lld/%lld "
        "(%.2f%%); free running: %lld/%lld tokens identical, first divergence at step %s\n",
        afd::KvCacheFormatName(flags.kv_format), afd::CodecName(flags.codec).c_str(), flags.batch,
        flags.prompt_len, flags.decode_steps,
        static_cast<long long>(afd::KvCacheBytesPerToken(flags.kv_format, config->head_dim)),
        static_cast<long long>(
            afd::KvCacheBytesPerToken(afd::KvCacheFormat::kFp32, config->head_dim)),
        e.logits_rel_l2_mean, e.logits_rel_l2_max, static_cast<long long>(e.top1_agree),
        static_cast<long long>(e.tokens), 100.0 * e.top1_agree / e.tokens,
        static_cast<long long>(e.free_identical), static_cast<long long>(e.tokens),
        e.first_divergence_step < 0 ? "(none)" : std::to_string(e.first_divergence_step).c_str());
    return 0;
  }
  afd::ReferenceModel model(*config, options);
  // Per step: [layers][rows][hidden], filled by the observer.
  std::vector<std::vector<float>> layer_hidden;
  if (!flags.dump.empty()) {
    model.set_layer_observer([&](int layer, const afd::StepState& state) {
      if (layer == 0) layer_hidden.emplace_back();
      layer_hidden.back().insert(layer_hidden.back().end(), state.hidden.begin(),
                                 state.hidden.end());
    });
  }
  const afd::GenerationResult result = model.Generate(prompts, flags.decode_steps);
  if (!flags.dump.empty() && !WriteDump(flags, *config, result, layer_hidden)) {
    std::fprintf(stderr, "cannot write %s\n", flags.dump.c_str());
    return 1;
  }

  std::printf("codec %s, partitions %d, batch %d, prompt %d, decode steps %d, kv cache %s\n",
              afd::CodecName(flags.codec).c_str(), model.options().partitions, flags.batch,
              flags.prompt_len, flags.decode_steps, afd::KvCacheFormatName(flags.kv_format));
  for (int s = 0; s < flags.batch; ++s) {
    std::printf("seq %d:", s);
    for (const int32_t token : result.tokens[s]) std::printf(" %d", token);
    std::printf("\n");
  }
  const double prefill_tokens = double{1} * flags.batch * flags.prompt_len;
  const double decode_tokens = double{1} * flags.batch * flags.decode_steps;
  std::printf("prefill: %.3f s, %.1f tokens/s\n", result.prefill_seconds,
              prefill_tokens / result.prefill_seconds);
  if (flags.decode_steps > 0) {
    std::printf("decode: %.3f s, TPOT %.3f ms, %.1f tokens/s\n", result.decode_seconds,
                1e3 * result.decode_seconds / flags.decode_steps,
                decode_tokens / result.decode_seconds);
  }
  return 0;
}
