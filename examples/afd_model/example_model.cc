#include "examples/afd_model/example_model.h"

#include <fstream>
#include <sstream>

#include "examples/afd_model/attention_side.h"
#include "examples/afd_model/step5/step5_attention_side.h"

namespace afd {
namespace {

// Step-3's AttentionSide behind the interface (its methods are not virtual).
class Step3Attention final : public AttentionModel {
 public:
  Step3Attention(const ModelConfig& config, int max_sequences, int64_t max_seq_len,
                 KvCacheFormat kv_format)
      : side_(config, max_sequences, max_seq_len, kv_format) {}

  StepStatePtr NewStepState() const override {
    return StepStatePtr(new StepState, [](StepState* s) { delete s; });
  }
  void ResetSequence(int sequence) override { side_.ResetSequence(sequence); }
  int64_t SequenceLength(int sequence) const override { return side_.SequenceLength(sequence); }
  bool BeginStep(std::span<const SequenceChunk> chunks, std::span<const int32_t> tokens,
                 StepState* state) override {
    return side_.BeginStep(chunks, tokens, state);
  }
  void Attention(int layer, StepState* state) override { side_.Attention(layer, state); }
  void PrepareFfnInput(int layer, StepState* state) const override {
    side_.PrepareFfnInput(layer, state);
  }
  void WriteA2F(const StepState& state, const A2FBuffers& out) const override {
    side_.WriteA2F(state, out);
  }
  void ReduceF2A(std::span<const uint16_t* const> partials, StepState* state) const override {
    side_.ReduceF2A(partials, state);
  }
  void AddFfnOutput(StepState* state) const override { side_.AddFfnOutput(state); }
  void LastTokenLogits(const StepState& state, std::vector<float>* final_hidden,
                       std::vector<float>* logits) const override {
    side_.LastTokenLogits(state, final_hidden, logits);
  }

 private:
  AttentionSide side_;
};

bool IsStep5File(const std::string& path) {
  std::ifstream file(path);
  std::stringstream contents;
  contents << file.rdbuf();
  return contents.str().find("index_topk_blocks") != std::string::npos;
}

}  // namespace

int64_t ExampleModel::ParameterCount() const {
  return step5 ? step5->ParameterCount() : config.ParameterCount();
}

std::unique_ptr<AttentionModel> ExampleModel::NewAttention(int max_sequences, int64_t max_seq_len,
                                                           KvCacheFormat kv_format,
                                                           std::string* error) const {
  if (step5) {
    if (kv_format != KvCacheFormat::kFp32) {
      if (error != nullptr) {
        *error = "the Step-5 model " + config.name + " keeps an fp32 KV cache, not " +
                 KvCacheFormatName(kv_format);
      }
      return nullptr;
    }
    return std::make_unique<step5::Step5AttentionSide>(*step5, max_sequences, max_seq_len);
  }
  return std::make_unique<Step3Attention>(config, max_sequences, max_seq_len, kv_format);
}

std::optional<ExampleModel> LoadExampleModel(const std::string& name_or_path,
                                             const std::string& config_dir, std::string* error) {
  ExampleModel model;
  const bool step3_name = IsStep3ConfigName(name_or_path);
  if (step5::IsStep5ConfigName(name_or_path) || (!step3_name && IsStep5File(name_or_path))) {
    auto config = step5::LoadStep5Config(name_or_path, config_dir, error);
    if (!config) return std::nullopt;
    model.family = ModelFamily::kStep5;
    model.config = config->model;
    model.step5 = std::move(config);
    return model;
  }
  if (!step3_name && !std::ifstream(name_or_path)) {
    if (error != nullptr) {
      *error = "unknown model '" + name_or_path +
               "': neither a bundled name (tiny, full, step3, wire, tiny-step5, "
               "full-width-step5, step5) nor a readable config file";
    }
    return std::nullopt;
  }
  auto config = LoadModelConfig(name_or_path, config_dir, error);
  if (!config) return std::nullopt;
  model.config = std::move(*config);
  return model;
}

}  // namespace afd
