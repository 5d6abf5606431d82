#include "examples/afd_model/config.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace afd {
namespace {

#ifndef AFD_MODEL_CONFIG_DIR
#define AFD_MODEL_CONFIG_DIR "examples/afd_model/configs"
#endif

std::string_view Trim(std::string_view s) {
  const auto first = s.find_first_not_of(" \t\r");
  if (first == std::string_view::npos) return {};
  const auto last = s.find_last_not_of(" \t\r");
  return s.substr(first, last - first + 1);
}

bool Fail(std::string* error, const std::string& message) {
  if (error != nullptr) *error = message;
  return false;
}

bool ParseInt(std::string_view text, int64_t* value) {
  const std::string owned(text);
  if (owned.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(owned.c_str(), &end, 0);
  if (errno != 0 || *end != '\0') return false;
  *value = parsed;
  return true;
}

bool ParseUnsigned(std::string_view text, uint64_t* value) {
  const std::string owned(text);
  if (owned.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const unsigned long long parsed = std::strtoull(owned.c_str(), &end, 0);
  if (errno != 0 || *end != '\0') return false;
  *value = parsed;
  return true;
}

bool ParseFloat(std::string_view text, float* value) {
  const std::string owned(text);
  if (owned.empty()) return false;
  char* end = nullptr;
  const float parsed = std::strtof(owned.c_str(), &end);
  if (*end != '\0' || !std::isfinite(parsed)) return false;
  *value = parsed;
  return true;
}

bool ParseLayerList(std::string_view text, int num_layers, std::vector<bool>* is_moe,
                    std::string* error) {
  is_moe->assign(num_layers, false);
  std::stringstream stream{std::string(text)};
  std::string item;
  while (std::getline(stream, item, ',')) {
    const std::string_view entry = Trim(item);
    if (entry.empty()) continue;
    int64_t first = 0;
    int64_t last = 0;
    const auto dash = entry.find('-');
    if (dash == std::string_view::npos) {
      if (!ParseInt(entry, &first)) return Fail(error, "bad layer id: " + item);
      last = first;
    } else if (!ParseInt(Trim(entry.substr(0, dash)), &first) ||
               !ParseInt(Trim(entry.substr(dash + 1)), &last)) {
      return Fail(error, "bad layer range: " + item);
    }
    if (first < 0 || last >= num_layers || first > last) {
      return Fail(error, "layer out of range: " + item);
    }
    for (int64_t l = first; l <= last; ++l) (*is_moe)[l] = true;
  }
  return true;
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
  std::map<std::string, std::string, std::less<>> values;
  std::stringstream stream{std::string(text)};
  std::string line;
  int line_number = 0;
  while (std::getline(stream, line)) {
    ++line_number;
    std::string_view content = line;
    if (const auto hash = content.find('#'); hash != std::string_view::npos) {
      content = content.substr(0, hash);
    }
    content = Trim(content);
    if (content.empty()) continue;
    const auto equals = content.find('=');
    if (equals == std::string_view::npos) {
      Fail(error, "line " + std::to_string(line_number) + ": expected key = value");
      return std::nullopt;
    }
    values[std::string(Trim(content.substr(0, equals)))] =
        std::string(Trim(content.substr(equals + 1)));
  }

  ModelConfig config;
  std::string missing;
  auto find = [&](const char* key) -> const std::string* {
    const auto it = values.find(key);
    if (it == values.end()) {
      missing += std::string(missing.empty() ? "" : ", ") + key;
      return nullptr;
    }
    return &it->second;
  };
  bool ok = true;
  auto read_int = [&](const char* key, auto* field) {
    const std::string* text_value = find(key);
    int64_t parsed = 0;
    if (text_value == nullptr) return;
    if (!ParseInt(*text_value, &parsed)) {
      ok = Fail(error, std::string("bad integer for ") + key);
      return;
    }
    *field = static_cast<std::remove_pointer_t<decltype(field)>>(parsed);
  };
  auto read_float = [&](const char* key, float* field) {
    const std::string* text_value = find(key);
    if (text_value != nullptr && !ParseFloat(*text_value, field)) {
      ok = Fail(error, std::string("bad number for ") + key);
    }
  };

  if (const std::string* name = find("name")) config.name = *name;
  read_int("hidden_size", &config.hidden_size);
  read_int("num_hidden_layers", &config.num_layers);
  read_int("share_q_dim", &config.q_rank);
  read_int("num_attention_heads", &config.num_heads);
  read_int("head_dim", &config.head_dim);
  read_int("intermediate_size", &config.dense_intermediate);
  read_int("moe_num_experts", &config.num_experts);
  read_int("moe_top_k", &config.top_k);
  read_int("moe_intermediate_size", &config.expert_intermediate);
  read_int("share_expert_dim", &config.shared_intermediate);
  read_int("vocab_size", &config.vocab_size);
  read_float("rms_norm_eps", &config.rms_norm_eps);
  read_float("rope_theta", &config.rope_theta);
  read_int("max_position_embedding", &config.max_positions);
  read_int("fp8_group_size", &config.fp8_group);
  if (const std::string* seed = find("weight_seed");
      seed != nullptr && !ParseUnsigned(*seed, &config.weight_seed)) {
    ok = Fail(error, "bad weight_seed");
  }
  const std::string* moe_layers = find("moe_layers_enum");
  if (!missing.empty()) {
    Fail(error, "missing keys: " + missing);
    return std::nullopt;
  }
  if (!ok) return std::nullopt;
  if (!Validate(config, error)) return std::nullopt;
  if (!ParseLayerList(*moe_layers, config.num_layers, &config.is_moe_layer, error)) {
    return std::nullopt;
  }
  return config;
}

std::optional<ModelConfig> LoadModelConfigFile(const std::string& path, std::string* error) {
  std::ifstream file(path);
  if (!file) {
    Fail(error, "cannot open " + path);
    return std::nullopt;
  }
  std::stringstream contents;
  contents << file.rdbuf();
  std::string parse_error;
  auto config = ParseModelConfig(contents.str(), &parse_error);
  if (!config) Fail(error, path + ": " + parse_error);
  return config;
}

namespace {

constexpr std::pair<const char*, const char*> kBundled[] = {{"tiny", "tiny.cfg"},
                                                            {"full", "full_width.cfg"},
                                                            {"step3", "step3.cfg"},
                                                            {"wire", "step3_wire.cfg"}};

}  // namespace

bool IsStep3ConfigName(std::string_view name) {
  for (const auto& [alias, file] : kBundled) {
    if (name == alias) return true;
  }
  return false;
}

std::optional<ModelConfig> LoadModelConfig(const std::string& name_or_path,
                                           const std::string& config_dir, std::string* error) {
  for (const auto& [alias, file] : kBundled) {
    if (name_or_path == alias) {
      return LoadModelConfigFile(config_dir + "/" + file, error);
    }
  }
  return LoadModelConfigFile(name_or_path, error);
}

// The source tree's configs, where the build put them; a binary carried to
// another machine (the GPU checks) finds them relative to the repository root.
std::string BundledConfigDir() {
  if (std::filesystem::is_directory(AFD_MODEL_CONFIG_DIR)) return AFD_MODEL_CONFIG_DIR;
  return "examples/afd_model/configs";
}

}  // namespace afd
