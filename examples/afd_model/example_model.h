#pragma once

// The model-selection point of the example (docs/example.md, "Models"): a
// config name or file picks the model family, and everything downstream
// (the attention instance, the FFN instance, the references, the report)
// gets what it needs from here:
//  - `config`: the ModelConfig the FFN side, the wire shapes, the vocabulary
//    and the layer count come from, for every family;
//  - NewAttention(): the family's attention side behind AttentionModel.
//
// Families: Step-3 ("tiny", "full", "step3"; MFA) and Step-5-Preview
// ("tiny-step5", "full-width-step5", "step5"; sliding + global sparse).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "examples/afd_model/attention_model.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/step5/step5_config.h"

namespace afd {

enum class ModelFamily { kStep3, kStep5 };

struct ExampleModel {
  ModelFamily family = ModelFamily::kStep3;
  ModelConfig config;                       // for Step-5: Step5Config::model
  std::optional<step5::Step5Config> step5;  // Step-5 only

  const char* FamilyName() const { return family == ModelFamily::kStep5 ? "step5" : "step3"; }
  // Parameters of the whole model (attention, indexer, FFN, embedding, LM head).
  int64_t ParameterCount() const;
  // The attention side with KV caches for max_sequences x max_seq_len in
  // `kv_format`. Step-5 keeps fp32 caches only: for another format returns
  // null and says why in `error`.
  std::unique_ptr<AttentionModel> NewAttention(int max_sequences, int64_t max_seq_len,
                                               KvCacheFormat kv_format = KvCacheFormat::kFp32,
                                               std::string* error = nullptr) const;
};

// A bundled name (above) or a path to a config file; a file with the key
// index_topk_blocks is a Step-5 config. On failure returns nullopt and says
// why in `error`.
std::optional<ExampleModel> LoadExampleModel(const std::string& name_or_path,
                                             const std::string& config_dir, std::string* error);

}  // namespace afd
