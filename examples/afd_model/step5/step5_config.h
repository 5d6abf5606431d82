#pragma once

// Configuration of the Step-5-Preview variant of the example model
// (docs/model.md, "Step-5-Preview") and its key=value loader.
//
// The FFN half (dense FFN, routed experts, shared expert), the embedding, the
// LM head and the wire shapes are the Step-3 example's, so they live in an
// embedded ModelConfig that FfnSide, GenerateFfnLayerWeights and the wire
// code read unchanged. Everything that differs (GQA with sliding and global
// sparse layers, the block indexer, the sigmoid router) is added here.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "examples/afd_model/config.h"

namespace afd::step5 {

struct Step5Config {
  // hidden_size, num_layers, is_moe_layer, num_heads, head_dim, FFN widths,
  // experts, top_k, vocab, eps, max_positions, fp8_group, weight_seed.
  // q_rank is 0 (no low-rank query) and rope_theta is unused.
  ModelConfig model;

  int64_t num_kv_groups = 0;          // num_attention_groups
  int full_attention_every = 4;       // layer i global iff i % n == n - 1
  std::vector<bool> is_global_layer;  // one flag per layer
  int64_t sliding_window = 0;         // positions, the current one included
  int64_t full_rotary_dim = 0;        // partial RoPE of global layers
  float full_rope_theta = 1e7f;
  int64_t sliding_rotary_dim = 0;
  float sliding_rope_theta = 1e4f;

  int64_t index_heads = 0;       // index_n_heads, all groups together
  int64_t index_dim = 0;         // proxy width P (index_head_dim)
  int64_t index_rotary_dim = 0;  // rotated prefix of the proxy
  int64_t block_size = 8;        // tokens per summarised block
  int64_t topk_blocks = 0;       // history budget K (blocks)
  float index_norm_eps = 1e-6f;

  bool norm_expert_weight = true;
  float router_scaling_factor = 1.0f;

  int64_t heads_per_group() const { return model.num_heads / num_kv_groups; }
  int64_t index_heads_per_group() const { return index_heads / num_kv_groups; }
  int64_t q_width() const { return model.num_heads * model.head_dim; }
  int64_t kv_width() const { return num_kv_groups * model.head_dim; }
  int num_global_layers() const;
  int num_sliding_layers() const { return model.num_layers - num_global_layers(); }

  // Parameters held by the model (embedding and untied LM head included).
  int64_t ParameterCount() const;
  // Parameters one token touches: attention, dense FFNs, the shared expert,
  // top_k routed experts per MoE layer, routers, the LM head row block (all
  // of it) but not the embedding table.
  int64_t ActiveParameterCount() const;
};

// Parses "key = value" lines ('#' starts a comment); every key of
// configs/tiny_step5.cfg is required. On failure returns nullopt and, if
// `error` is non-null, says which key or line was wrong.
std::optional<Step5Config> ParseStep5Config(std::string_view text, std::string* error);

std::optional<Step5Config> LoadStep5ConfigFile(const std::string& path, std::string* error);

// `name_or_path` is "tiny-step5", "full-width-step5", "step5" (files in
// `config_dir`) or a path to a config file.
std::optional<Step5Config> LoadStep5Config(const std::string& name_or_path,
                                           const std::string& config_dir, std::string* error);

// True for the bundled Step-5 names above (the launcher's model switch).
bool IsStep5ConfigName(std::string_view name);

}  // namespace afd::step5
