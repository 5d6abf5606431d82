#pragma once

// Model configuration of the Step-3 example and its key=value loader.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace afd {

struct ModelConfig {
  std::string name;
  int64_t hidden_size = 0;
  int num_layers = 0;
  std::vector<bool> is_moe_layer;  // one flag per layer
  int64_t q_rank = 0;              // share_q_dim
  int64_t num_heads = 0;
  int64_t head_dim = 0;
  int64_t dense_intermediate = 0;  // intermediate_size
  int num_experts = 0;
  int top_k = 0;
  int64_t expert_intermediate = 0;  // moe_intermediate_size
  int64_t shared_intermediate = 0;  // share_expert_dim
  int64_t vocab_size = 0;
  float rms_norm_eps = 1e-5f;
  float rope_theta = 500000.0f;
  int64_t max_positions = 0;
  int64_t fp8_group = 128;
  uint64_t weight_seed = 0x5354455033ull;  // "STEP3"

  int64_t fp8_groups_per_token() const { return hidden_size / fp8_group; }
  int64_t attention_width() const { return num_heads * head_dim; }
  float attention_scale() const;
  // Parameters held by the model (embedding and untied LM head included).
  int64_t ParameterCount() const;
};

// Parses "key = value" lines; '#' starts a comment. Every key in
// configs/tiny.cfg is required. moe_layers_enum is a comma separated list of
// layer ids or inclusive ranges "a-b". On failure returns nullopt and, if
// `error` is non-null, says why.
std::optional<ModelConfig> ParseModelConfig(std::string_view text, std::string* error);

// Loads a config file.
std::optional<ModelConfig> LoadModelConfigFile(const std::string& path, std::string* error);

// `name_or_path` is "tiny", "full", "step3", "wire" (files in `config_dir`)
// or a path to a config file.
std::optional<ModelConfig> LoadModelConfig(const std::string& name_or_path,
                                           const std::string& config_dir, std::string* error);

// True for the bundled names above.
bool IsStep3ConfigName(std::string_view name);

// Directory of the bundled configs, fixed at build time.
std::string BundledConfigDir();

}  // namespace afd
