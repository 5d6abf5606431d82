#include "examples/afd_model/step5/step5_config.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "examples/afd_model/key_values.h"

namespace afd::step5 {
namespace {

bool Validate(const Step5Config& c, std::string* error) {
  const ModelConfig& m = c.model;
  auto fail = [error](std::string message) {
    *error = std::move(message);
    return false;
  };
  if (m.hidden_size <= 0 || m.num_layers <= 0 || m.num_heads <= 0 || m.head_dim <= 0 ||
      m.dense_intermediate <= 0 || m.num_experts <= 0 || m.top_k <= 0 ||
      m.expert_intermediate <= 0 || m.shared_intermediate <= 0 || m.vocab_size <= 0 ||
      m.max_positions <= 0 || m.fp8_group <= 0 || c.num_kv_groups <= 0 ||
      c.full_attention_every <= 0 || c.sliding_window <= 0 || c.index_heads <= 0 ||
      c.index_dim <= 0 || c.block_size <= 0 || c.topk_blocks <= 0) {
    return fail("every size must be positive");
  }
  if (m.num_heads % c.num_kv_groups != 0) {
    return fail("num_attention_heads must be a multiple of num_attention_groups");
  }
  if (c.index_heads % c.num_kv_groups != 0) {
    return fail("index_n_heads must be a multiple of num_attention_groups");
  }
  auto rotary_ok = [](int64_t rotary, int64_t width) {
    return rotary >= 0 && rotary <= width && rotary % 2 == 0;
  };
  if (!rotary_ok(c.full_rotary_dim, m.head_dim) || !rotary_ok(c.sliding_rotary_dim, m.head_dim)) {
    return fail("full_rotary_dim / sliding_rotary_dim must be even and <= head_dim");
  }
  if (!rotary_ok(c.index_rotary_dim, c.index_dim)) {
    return fail("index_rotary_dim must be even and <= index_head_dim");
  }
  if (m.hidden_size % m.fp8_group != 0) {
    return fail("hidden_size must be a multiple of fp8_group_size");
  }
  if (m.top_k > m.num_experts) return fail("moe_top_k > moe_num_experts");
  if (m.vocab_size > (int64_t{1} << 31) - 1) return fail("vocab_size too big");
  if (m.max_positions > (int64_t{1} << 31) - 1) return fail("max_position_embedding too big");
  return true;
}

// Attention parameters of one layer (norms included), and the indexer's.
int64_t AttentionParameters(const Step5Config& c) {
  const int64_t h = c.model.hidden_size;
  return h * (c.q_width() + 2 * c.kv_width() + c.model.num_heads) + c.q_width() * h +
         2 * c.model.head_dim + 2 * h;
}

int64_t IndexerParameters(const Step5Config& c) {
  const int64_t h = c.model.hidden_size;
  const int64_t p = c.index_dim;
  return h * (c.index_heads * p + 2 * p + c.index_heads) + 3 * p;
}

}  // namespace

int Step5Config::num_global_layers() const {
  int count = 0;
  for (const bool global : is_global_layer) count += global ? 1 : 0;
  return count;
}

namespace {

// Every parameter, or (`active_only`) those one token touches: top_k routed
// experts per MoE layer, no embedding table.
int64_t CountParameters(const Step5Config& c, bool active_only) {
  const ModelConfig& m = c.model;
  const int64_t h = m.hidden_size;
  const int64_t experts = active_only ? m.top_k : m.num_experts;
  int64_t total = (active_only ? 1 : 2) * m.vocab_size * h + h;
  for (int l = 0; l < m.num_layers; ++l) {
    total += AttentionParameters(c);
    if (c.is_global_layer[l]) total += IndexerParameters(c);
    if (m.is_moe_layer[l]) {
      total += m.num_experts * (h + 1) + 3 * h * m.shared_intermediate +
               experts * 3 * h * m.expert_intermediate;
    } else {
      total += 3 * h * m.dense_intermediate;
    }
  }
  return total;
}

}  // namespace

int64_t Step5Config::ParameterCount() const { return CountParameters(*this, false); }

int64_t Step5Config::ActiveParameterCount() const { return CountParameters(*this, true); }

std::optional<Step5Config> ParseStep5Config(std::string_view text, std::string* error) {
  std::string scratch;
  if (error == nullptr) error = &scratch;
  KeyValues kv;
  if (!kv.Parse(text, error)) return std::nullopt;

  Step5Config c;
  ModelConfig& m = c.model;
  if (const std::string* name = kv.Find("name")) m.name = *name;
  kv.Int("hidden_size", &m.hidden_size);
  kv.Int("num_hidden_layers", &m.num_layers);
  kv.Int("full_attention_every", &c.full_attention_every);
  kv.Int("num_attention_heads", &m.num_heads);
  kv.Int("num_attention_groups", &c.num_kv_groups);
  kv.Int("head_dim", &m.head_dim);
  kv.Int("sliding_window", &c.sliding_window);
  kv.Int("full_rotary_dim", &c.full_rotary_dim);
  kv.Float("full_rope_theta", &c.full_rope_theta);
  kv.Int("sliding_rotary_dim", &c.sliding_rotary_dim);
  kv.Float("sliding_rope_theta", &c.sliding_rope_theta);
  kv.Int("index_n_heads", &c.index_heads);
  kv.Int("index_head_dim", &c.index_dim);
  kv.Int("index_rotary_dim", &c.index_rotary_dim);
  kv.Int("index_block_size", &c.block_size);
  kv.Int("index_topk_blocks", &c.topk_blocks);
  kv.Float("index_norm_eps", &c.index_norm_eps);
  kv.Int("intermediate_size", &m.dense_intermediate);
  kv.Int("moe_num_experts", &m.num_experts);
  kv.Int("moe_top_k", &m.top_k);
  kv.Int("moe_intermediate_size", &m.expert_intermediate);
  kv.Int("share_expert_dim", &m.shared_intermediate);
  kv.Bool("norm_expert_weight", &c.norm_expert_weight);
  kv.Float("moe_router_scaling_factor", &c.router_scaling_factor);
  kv.Int("vocab_size", &m.vocab_size);
  kv.Float("rms_norm_eps", &m.rms_norm_eps);
  kv.Int("max_position_embedding", &m.max_positions);
  kv.Int("fp8_group_size", &m.fp8_group);
  kv.Unsigned("weight_seed", &m.weight_seed);
  const std::string* moe_layers = kv.Find("moe_layers_enum");
  if (std::string problem = kv.Problem(); !problem.empty()) {
    *error = std::move(problem);
    return std::nullopt;
  }
  m.q_rank = 0;
  if (!Validate(c, error)) return std::nullopt;
  if (!ParseLayerList(*moe_layers, m.num_layers, &m.is_moe_layer, error)) return std::nullopt;
  c.is_global_layer.resize(m.num_layers);
  for (int l = 0; l < m.num_layers; ++l) {
    c.is_global_layer[l] = l % c.full_attention_every == c.full_attention_every - 1;
  }
  return c;
}

std::optional<Step5Config> LoadStep5ConfigFile(const std::string& path, std::string* error) {
  return LoadConfigFile(path, error, &ParseStep5Config);
}

namespace {
constexpr BundledConfig kBundled[] = {
    {"tiny-step5", "tiny_step5.cfg"},
    {"full-width-step5", "full_width_step5.cfg"},
    {"step5", "step5.cfg"},
};
}  // namespace

bool IsStep5ConfigName(std::string_view name) { return IsBundledConfig(kBundled, name); }

std::optional<Step5Config> LoadStep5Config(const std::string& name_or_path,
                                           const std::string& config_dir, std::string* error) {
  return LoadStep5ConfigFile(ConfigPath(kBundled, name_or_path, config_dir), error);
}

}  // namespace afd::step5
