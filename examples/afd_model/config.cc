#include "examples/afd_model/config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "examples/afd_model/key_values.h"

namespace afd {
namespace {

#ifndef AFD_MODEL_CONFIG_DIR
#define AFD_MODEL_CONFIG_DIR "examples/afd_model/configs"
#endif

bool Fail(std::string* error, const std::string& message) {
  if (error != nullptr) *error = message;
  return false;
}

bool Validate(const ModelConfig& c, std::string* error) {
  if (c.hidden_size <= 0 || c.num_layers <= 0 || c.q_rank <= 0 || c.num_heads <= 0 ||
      c.head_dim <= 0 || c.dense_intermediate <= 0 || c.num_experts <= 0 || c.top_k <= 0 ||
      c.expert_intermediate <= 0 || c.shared_intermediate <= 0 || c.vocab_size <= 0 ||
      c.max_positions <= 0 || c.fp8_group <= 0) {
    return Fail(error, "every size must be positive");
  }
  if (c.head_dim % 2 != 0) return Fail(error, "head_dim must be even (RoPE)");
  if (c.hidden_size % c.fp8_group != 0) {
    return Fail(error, "hidden_size must be a multiple of fp8_group_size");
  }
  if (c.top_k > c.num_experts) return Fail(error, "moe_top_k > moe_num_experts");
  if (c.vocab_size > (int64_t{1} << 31) - 1) return Fail(error, "vocab too big");
  return true;
}

}  // namespace

float ModelConfig::attention_scale() const {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

int64_t ModelConfig::ParameterCount() const {
  const int64_t h = hidden_size;
  const int64_t attention = h * (q_rank + 2 * head_dim) + q_rank + q_rank * attention_width() +
                            attention_width() * h + 2 * h;
  int64_t total = 2 * vocab_size * h + h;
  for (int l = 0; l < num_layers; ++l) {
    total += attention;
    if (is_moe_layer[l]) {
      total += num_experts * h + 3 * h * shared_intermediate +
               int64_t{num_experts} * 3 * h * expert_intermediate;
    } else {
      total += 3 * h * dense_intermediate;
    }
  }
  return total;
}

std::optional<ModelConfig> ParseModelConfig(std::string_view text, std::string* error) {
  std::string scratch;
  if (error == nullptr) error = &scratch;
  KeyValues kv;
  if (!kv.Parse(text, error)) return std::nullopt;

  ModelConfig config;
  if (const std::string* name = kv.Find("name")) config.name = *name;
  kv.Int("hidden_size", &config.hidden_size);
  kv.Int("num_hidden_layers", &config.num_layers);
  kv.Int("share_q_dim", &config.q_rank);
  kv.Int("num_attention_heads", &config.num_heads);
  kv.Int("head_dim", &config.head_dim);
  kv.Int("intermediate_size", &config.dense_intermediate);
  kv.Int("moe_num_experts", &config.num_experts);
  kv.Int("moe_top_k", &config.top_k);
  kv.Int("moe_intermediate_size", &config.expert_intermediate);
  kv.Int("share_expert_dim", &config.shared_intermediate);
  kv.Int("vocab_size", &config.vocab_size);
  kv.Float("rms_norm_eps", &config.rms_norm_eps);
  kv.Float("rope_theta", &config.rope_theta);
  kv.Int("max_position_embedding", &config.max_positions);
  kv.Int("fp8_group_size", &config.fp8_group);
  kv.Unsigned("weight_seed", &config.weight_seed);
  const std::string* moe_layers = kv.Find("moe_layers_enum");
  if (std::string problem = kv.Problem(); !problem.empty()) {
    *error = std::move(problem);
    return std::nullopt;
  }
  if (!Validate(config, error)) return std::nullopt;
  if (!ParseLayerList(*moe_layers, config.num_layers, &config.is_moe_layer, error)) {
    return std::nullopt;
  }
  return config;
}

std::optional<ModelConfig> LoadModelConfigFile(const std::string& path, std::string* error) {
  return LoadConfigFile(path, error, &ParseModelConfig);
}

namespace {

constexpr BundledConfig kBundled[] = {{"tiny", "tiny.cfg"},
                                      {"full", "full_width.cfg"},
                                      {"step3", "step3.cfg"},
                                      {"wire", "step3_wire.cfg"}};

}  // namespace

bool IsStep3ConfigName(std::string_view name) { return IsBundledConfig(kBundled, name); }

std::optional<ModelConfig> LoadModelConfig(const std::string& name_or_path,
                                           const std::string& config_dir, std::string* error) {
  return LoadModelConfigFile(ConfigPath(kBundled, name_or_path, config_dir), error);
}

// The source tree's configs, where the build put them; a binary carried to
// another machine (the GPU checks) finds them relative to the repository root.
std::string BundledConfigDir() {
  if (std::filesystem::is_directory(AFD_MODEL_CONFIG_DIR)) return AFD_MODEL_CONFIG_DIR;
  return "examples/afd_model/configs";
}

}  // namespace afd
