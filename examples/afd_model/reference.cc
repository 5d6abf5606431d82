#include "examples/afd_model/reference.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "examples/afd_model/kernels/cpu_kernels.h"

namespace afd {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

std::string CodecName(Codec codec) { return codec == Codec::kNone ? "none" : "afd"; }

ReferenceModel::ReferenceModel(const ModelConfig& config, const ReferenceOptions& options)
    : config_(config),
      options_(options),
      attention_(config, options.max_sequences, options.max_seq_len, options.kv_format) {
  if (options_.codec == Codec::kNone) {
    options_.partitions = 1;
    options_.partitions_per_step.clear();
  }
  std::vector<int> counts = options_.partitions_per_step;
  counts.push_back(options_.partitions);
  for (int f : counts) {
    std::vector<FfnSide>& layout = layouts_[f];
    if (!layout.empty()) continue;
    layout.reserve(f);
    for (int p = 0; p < f; ++p) layout.emplace_back(config, FfnPartition{p, f});
  }
  partitions_now_ = options_.partitions;
}

void ReferenceModel::ComputeFfnOutput(int layer, StepState* state) {
  attention_.PrepareFfnInput(layer, state);
  const int64_t n = state->num_tokens();
  if (options_.codec == Codec::kNone) {
    layouts_.at(1)[0].ForwardFp32(layer, n, state->normed.data(), state->topk_ids.data(),
                                  state->topk_weights.data(), state->ffn_output.data(),
                                  &ffn_workspace_);
    return;
  }
  const A2FSizes sizes{n, config_.hidden_size, config_.top_k, config_.fp8_group};
  const A2FBuffers a2f = a2f_.Resize(sizes);
  attention_.WriteA2F(*state, a2f);
  std::vector<const uint16_t*> partials;
  std::vector<FfnSide>& layout = layouts_.at(partitions_now_);
  f2a_partials_.resize(std::max(f2a_partials_.size(), layout.size()));
  for (size_t p = 0; p < layout.size(); ++p) {
    f2a_partials_[p].resize(n * config_.hidden_size);
    layout[p].Forward(layer, AsView(a2f, n), f2a_partials_[p].data(), &ffn_workspace_);
    partials.push_back(f2a_partials_[p].data());
  }
  attention_.ReduceF2A(partials, state);
}

bool ReferenceModel::RunStep(std::span<const SequenceChunk> chunks, std::span<const int32_t> tokens,
                             StepState* state) {
  if (!attention_.BeginStep(chunks, tokens, state)) return false;
  for (int l = 0; l < config_.num_layers; ++l) {
    attention_.Attention(l, state);
    ComputeFfnOutput(l, state);
    attention_.AddFfnOutput(state);
    if (observer_) observer_(l, *state);
  }
  return true;
}

GenerationResult ReferenceModel::Generate(const std::vector<std::vector<int32_t>>& prompts,
                                          int decode_steps,
                                          const std::vector<std::vector<int32_t>>* forced_tokens) {
  const int batch = static_cast<int>(prompts.size());
  GenerationResult result;
  result.tokens.resize(batch);
  StepState state;
  std::vector<SequenceChunk> chunks;
  std::vector<int32_t> inputs;
  for (int s = 0; s < batch; ++s) {
    attention_.ResetSequence(s);
    chunks.push_back({s, static_cast<int32_t>(prompts[s].size())});
    inputs.insert(inputs.end(), prompts[s].begin(), prompts[s].end());
  }

  std::vector<int32_t> next(batch);
  auto finish_step = [&] {
    std::vector<float> hidden;
    std::vector<float> logits;
    attention_.LastTokenLogits(state, &hidden, &logits);
    cpu::ArgmaxRows(logits.data(), batch, config_.vocab_size, next.data());
    for (int s = 0; s < batch; ++s) result.tokens[s].push_back(next[s]);
    result.step_final_hidden.push_back(std::move(hidden));
    result.step_logits.push_back(std::move(logits));
  };

  // The expert layout of each step (prefill = step 0).
  auto layout_of = [&](int step) {
    const auto& per_step = options_.partitions_per_step;
    partitions_now_ =
        step < static_cast<int>(per_step.size()) ? per_step[step] : options_.partitions;
  };
  auto start = std::chrono::steady_clock::now();
  layout_of(0);
  if (!RunStep(chunks, inputs, &state)) return result;
  finish_step();
  result.prefill_seconds = SecondsSince(start);

  start = std::chrono::steady_clock::now();
  for (int step = 0; step < decode_steps; ++step) {
    inputs.resize(batch);
    for (int s = 0; s < batch; ++s) {
      chunks[s].num_tokens = 1;
      inputs[s] = forced_tokens != nullptr ? (*forced_tokens)[s][step] : next[s];
    }
    layout_of(step + 1);
    if (!RunStep(chunks, inputs, &state)) break;
    finish_step();
  }
  result.decode_seconds = SecondsSince(start);
  return result;
}

KvCacheEffect MeasureKvCacheEffect(const ModelConfig& config, ReferenceOptions options,
                                   KvCacheFormat format,
                                   const std::vector<std::vector<int32_t>>& prompts,
                                   int decode_steps) {
  options.kv_format = KvCacheFormat::kFp32;
  const GenerationResult exact = ReferenceModel(config, options).Generate(prompts, decode_steps);
  options.kv_format = format;
  const GenerationResult forced =
      ReferenceModel(config, options).Generate(prompts, decode_steps, &exact.tokens);
  const GenerationResult free = ReferenceModel(config, options).Generate(prompts, decode_steps);

  KvCacheEffect e;
  e.steps = static_cast<int>(exact.step_logits.size());
  const int64_t v = config.vocab_size;
  const int batch = static_cast<int>(prompts.size());
  double sum = 0.0;
  std::vector<int32_t> top1(batch);
  for (int step = 0; step < e.steps; ++step) {
    cpu::ArgmaxRows(forced.step_logits[step].data(), batch, v, top1.data());
    for (int s = 0; s < batch; ++s) {
      const double rel = RelativeL2({forced.step_logits[step].data() + s * v, size_t(v)},
                                    {exact.step_logits[step].data() + s * v, size_t(v)});
      sum += rel;
      e.logits_rel_l2_max = std::max(e.logits_rel_l2_max, rel);
      e.top1_agree += top1[s] == exact.tokens[s][step] ? 1 : 0;
      const bool same = free.tokens[s][step] == exact.tokens[s][step];
      e.free_identical += same ? 1 : 0;
      if (!same && (e.first_divergence_step < 0 || step < e.first_divergence_step)) {
        e.first_divergence_step = step;
      }
    }
  }
  e.tokens = int64_t{batch} * e.steps;
  e.logits_rel_l2_mean = e.tokens == 0 ? 0.0 : sum / e.tokens;
  return e;
}

double RelativeL2(std::span<const float> a, std::span<const float> b) {
  double diff = 0.0;
  double norm = 0.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    diff += d * d;
    norm += static_cast<double>(b[i]) * b[i];
  }
  if (norm == 0.0) return diff == 0.0 ? 0.0 : INFINITY;
  return std::sqrt(diff / norm);
}

}  // namespace afd
