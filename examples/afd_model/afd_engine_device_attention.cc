// The device engines (this file: attention; afd_engine_device_ffn.cc: FFN): the attention and FFN
// compute as kernels enqueued on the micro-batches' streams (DeviceOps), with every activation, the
// KV cache and the wire tensors (except the host-side header) in the backend's device memory.
// Nothing in a stage waits for the device: the per-step index tables (positions, cache rows, decode
// lengths, last rows) are built once at start, the next step's tokens go from the argmax straight
// into the embedding on the device, and results reach the host through copies into pinned staging
// followed by a host function, in stream order.
//
// With CudaOps this is --engine cuda; with CpuOps (--engine cpu-device) the
// same orchestration runs on cpu_mock in CI, bitwise equal to the reference.

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "examples/afd_model/afd_engine.h"
#include "examples/afd_model/attention_side.h"
#include "examples/afd_model/device_engine_support.h"
#include "examples/afd_model/device_ops.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/wire.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {
namespace {

using device_engine::Arena;
using device_engine::GammaSpec;
using device_engine::KvFormatOf;
using device_engine::LinearSpec;
using stepmesh::MemoryKind;

class DeviceAttentionEngine final : public AttentionEngine {
 public:
  DeviceAttentionEngine(AttentionEngineParams p, std::unique_ptr<DeviceOps> ops)
      : p_(std::move(p)),
        shape_(*p_.shape),
        config_(p_.model->config),
        ops_(std::move(ops)),
        arena_(*p_.backend),
        max_len_(int64_t{shape_.prompt_len} + shape_.decode_steps) {}

  absl::Status Init();

  std::string name() const override { return absl::StrCat("device (", ops_->name(), " ops)"); }
  AttentionWire& wire(int mb) override { return micro_batches_[mb]->wire; }
  stepmesh::Stream& stream(int mb) override { return *micro_batches_[mb]->stream; }
  absl::Status EnqueueStage(int mb, int step, int layer) override;
  absl::Status EnqueueFinishStep(int mb, int step) override;
  absl::Status Finish() override { return absl::OkStatus(); }

 private:
  struct LayerWeights {
    const float* input_norm = nullptr;
    const float* inter_norm = nullptr;
    const float* post_norm = nullptr;
    DeviceWeight q_proj, k_proj, v_proj, wq, o_proj, router;
  };
  // Per step, the device index tables of a micro-batch (built at start).
  struct StepTables {
    int64_t rows = 0;
    const int32_t* positions = nullptr;   // [rows]
    const int32_t* cache_rows = nullptr;  // [rows]: row in a layer's cache
    const int32_t* kv_lens = nullptr;     // [count] (decode steps)
    const int32_t* last_rows = nullptr;   // [count]: each request's last row
  };
  struct MicroBatch {
    int index = 0;
    int begin = 0;
    int count = 0;
    std::unique_ptr<stepmesh::Stream> stream;
    OpsStream ops_stream;
    AttentionWire wire;
    const uint16_t* const* partial_table = nullptr;  // device array of F pointers
    std::vector<StepTables> steps;
    const int32_t* prompt_tokens = nullptr;  // [count * prompt_len]
    int32_t* next_tokens = nullptr;          // [count] the argmax of the last step
    // Activations [slot rows, ...].
    float *hidden, *attn_in, *cq, *k, *v, *q, *heads_out, *tmp, *normed, *router_logits, *ffn_out;
    float *last, *last_normed, *logits;  // [count, ...]
    Scratch scratch;
    // Pinned host staging of what the results need.
    float* host_logits = nullptr;  // [count, V]
    int32_t* host_tokens = nullptr;
    float* host_hidden = nullptr;  // [slot rows, H] (layer dumps)
  };

  absl::Status GenerateWeights();
  absl::Status InitMicroBatch(int m);
  // ApplyF2A of the partials in the wire into the residual stream.
  absl::Status EnqueueApplyF2A(MicroBatch& mb, int step);
  absl::Status EnqueueDump(MicroBatch& mb, int step, int layer);
  absl::Status EnqueueAttention(MicroBatch& mb, int step, int layer);
  absl::Status EnqueueFfnInput(MicroBatch& mb, int step, int layer);
  absl::Status EnqueueLogits(MicroBatch& mb, int step);
  int64_t Rows(const MicroBatch& mb, int step) const {
    return int64_t{mb.count} * shape_.TokensPerRequest(step);
  }
  float* CacheK(int layer, int request) const {
    return k_cache_ + ((int64_t{layer} * shape_.requests + request) * max_len_) * config_.head_dim;
  }
  float* CacheV(int layer, int request) const {
    return v_cache_ + ((int64_t{layer} * shape_.requests + request) * max_len_) * config_.head_dim;
  }

  const AttentionEngineParams p_;
  const RunShape& shape_;
  const ModelConfig& config_;
  std::unique_ptr<DeviceOps> ops_;
  Arena arena_;
  const int64_t max_len_;
  const float* embedding_ = nullptr;
  const float* final_norm_ = nullptr;
  DeviceWeight lm_head_;
  std::vector<LayerWeights> layers_;
  // [layers][requests][max_len][d] each.
  float* k_cache_ = nullptr;
  float* v_cache_ = nullptr;
  // Declared last, destroyed first: the streams drain on destruction and
  // their host functions touch the results and the staging.
  std::vector<std::unique_ptr<MicroBatch>> micro_batches_;
};

absl::Status DeviceAttentionEngine::GenerateWeights() {
  const int64_t h = config_.hidden_size;
  const int64_t q = config_.q_rank;
  const int64_t d = config_.head_dim;
  const int64_t width = config_.attention_width();
  const uint64_t seed = config_.weight_seed;
  auto linear = [&](const std::string& name, int64_t rows,
                    int64_t cols) -> absl::StatusOr<DeviceWeight> {
    const ElementRange all{0, rows * cols};
    return ops_->LinearWeight(LinearSpec(name, cols), seed, {&all, 1}, rows, cols);
  };
  STEPMESH_ASSIGN_OR_RETURN(
      embedding_, ops_->Fp32Tensor({"model.embed_tokens.weight", WeightKind::kEmbedding, h}, seed,
                                   config_.vocab_size * h));
  STEPMESH_ASSIGN_OR_RETURN(final_norm_, ops_->Fp32Tensor(GammaSpec("model.norm.weight"), seed, h));
  STEPMESH_ASSIGN_OR_RETURN(lm_head_, linear("lm_head.weight", config_.vocab_size, h));
  layers_.resize(config_.num_layers);
  for (int l = 0; l < config_.num_layers; ++l) {
    LayerWeights& w = layers_[l];
    auto name = [l](std::string_view suffix) { return LayerTensorName(l, suffix); };
    STEPMESH_ASSIGN_OR_RETURN(w.input_norm,
                              ops_->Fp32Tensor(GammaSpec(name("input_layernorm.weight")), seed, h));
    STEPMESH_ASSIGN_OR_RETURN(w.q_proj, linear(name("self_attn.q_proj.weight"), q, h));
    STEPMESH_ASSIGN_OR_RETURN(w.k_proj, linear(name("self_attn.k_proj.weight"), d, h));
    STEPMESH_ASSIGN_OR_RETURN(w.v_proj, linear(name("self_attn.v_proj.weight"), d, h));
    STEPMESH_ASSIGN_OR_RETURN(
        w.inter_norm, ops_->Fp32Tensor(GammaSpec(name("self_attn.inter_norm.weight")), seed, q));
    STEPMESH_ASSIGN_OR_RETURN(w.wq, linear(name("self_attn.wq.weight"), width, q));
    STEPMESH_ASSIGN_OR_RETURN(w.o_proj, linear(name("self_attn.o_proj.weight"), h, width));
    STEPMESH_ASSIGN_OR_RETURN(
        w.post_norm, ops_->Fp32Tensor(GammaSpec(name("post_attention_layernorm.weight")), seed, h));
    if (config_.is_moe_layer[l]) {
      const ElementRange all{0, int64_t{config_.num_experts} * h};
      STEPMESH_ASSIGN_OR_RETURN(
          w.router, ops_->LinearWeight({name("moe.gate.weight"), WeightKind::kRouter, h}, seed,
                                       {&all, 1}, config_.num_experts, h));
    }
  }
  return absl::OkStatus();
}

absl::Status DeviceAttentionEngine::InitMicroBatch(int m) {
  auto mb = std::make_unique<MicroBatch>();
  mb->index = m;
  mb->begin = shape_.MicroBatchBegin(m);
  mb->count = shape_.MicroBatchEnd(m) - mb->begin;
  const int64_t h = config_.hidden_size;
  const int64_t slot = shape_.SlotRows();
  const int64_t width = config_.attention_width();
  const int64_t d = config_.head_dim;
  const int64_t v = config_.vocab_size;
  const int64_t count = mb->count;
  STEPMESH_ASSIGN_OR_RETURN(mb->stream, p_.backend->CreateStream());
  STEPMESH_ASSIGN_OR_RETURN(mb->ops_stream, ops_->Bind(*mb->stream));

  // The wire: device tensors the kernels write and the transport reads
  // (GPUDirect where it can, staged otherwise); the header in host memory.
  const A2FSizes sizes{slot, h, config_.top_k, config_.fp8_group};
  AttentionWire& w = mb->wire;
  auto alloc = [&](size_t bytes, MemoryKind kind) { return p_.backend->Allocate(bytes, kind); };
  STEPMESH_ASSIGN_OR_RETURN(w.header,
                            alloc(sizeof(int32_t) * kWireHeaderInts, MemoryKind::kHostPinned));
  STEPMESH_ASSIGN_OR_RETURN(w.codes, alloc(sizes.codes_bytes(), MemoryKind::kDevice));
  STEPMESH_ASSIGN_OR_RETURN(w.scales, alloc(sizes.scales_bytes(), MemoryKind::kDevice));
  STEPMESH_ASSIGN_OR_RETURN(w.topk_ids, alloc(sizes.topk_ids_bytes(), MemoryKind::kDevice));
  STEPMESH_ASSIGN_OR_RETURN(w.topk_weights, alloc(sizes.topk_weights_bytes(), MemoryKind::kDevice));
  std::vector<const uint16_t*> partials;
  for (int s = 0; s < shape_.ffn; ++s) {
    STEPMESH_ASSIGN_OR_RETURN(auto partial, alloc(F2APartialBytes(slot, h), MemoryKind::kDevice));
    partials.push_back(static_cast<const uint16_t*>(partial->data()));
    w.partials.push_back(std::move(partial));
  }
  STEPMESH_ASSIGN_OR_RETURN(mb->partial_table, ops_->PointerTable(partials));

  // Index tables of every step.
  std::vector<int32_t> prompt_tokens;
  for (int i = 0; i < count; ++i) {
    const auto& prompt = p_.prompts[mb->begin + i];
    prompt_tokens.insert(prompt_tokens.end(), prompt.begin(), prompt.end());
  }
  STEPMESH_ASSIGN_OR_RETURN(mb->prompt_tokens, arena_.Upload(prompt_tokens));
  for (int step = 0; step < shape_.steps(); ++step) {
    const int64_t per = shape_.TokensPerRequest(step);
    std::vector<int32_t> positions, cache_rows, kv_lens, last_rows;
    for (int i = 0; i < count; ++i) {
      const int64_t first = step == 0 ? 0 : shape_.prompt_len + step - 1;
      for (int64_t t = 0; t < per; ++t) {
        positions.push_back(static_cast<int32_t>(first + t));
        cache_rows.push_back(static_cast<int32_t>((mb->begin + i) * max_len_ + first + t));
      }
      kv_lens.push_back(static_cast<int32_t>(first + per));
      last_rows.push_back(static_cast<int32_t>(i * per + per - 1));
    }
    StepTables t;
    t.rows = count * per;
    STEPMESH_ASSIGN_OR_RETURN(t.positions, arena_.Upload(positions));
    STEPMESH_ASSIGN_OR_RETURN(t.cache_rows, arena_.Upload(cache_rows));
    STEPMESH_ASSIGN_OR_RETURN(t.kv_lens, arena_.Upload(kv_lens));
    STEPMESH_ASSIGN_OR_RETURN(t.last_rows, arena_.Upload(last_rows));
    mb->steps.push_back(t);
  }

  STEPMESH_ASSIGN_OR_RETURN(mb->next_tokens, arena_.Take<int32_t>(count));
  for (float** a : {&mb->hidden, &mb->attn_in, &mb->tmp, &mb->normed, &mb->ffn_out}) {
    STEPMESH_ASSIGN_OR_RETURN(*a, arena_.Take<float>(slot * h));
  }
  STEPMESH_ASSIGN_OR_RETURN(mb->cq, arena_.Take<float>(slot * config_.q_rank));
  STEPMESH_ASSIGN_OR_RETURN(mb->k, arena_.Take<float>(slot * d));
  STEPMESH_ASSIGN_OR_RETURN(mb->v, arena_.Take<float>(slot * d));
  STEPMESH_ASSIGN_OR_RETURN(mb->q, arena_.Take<float>(slot * width));
  STEPMESH_ASSIGN_OR_RETURN(mb->heads_out, arena_.Take<float>(slot * width));
  STEPMESH_ASSIGN_OR_RETURN(mb->router_logits, arena_.Take<float>(slot * config_.num_experts));
  STEPMESH_ASSIGN_OR_RETURN(mb->last, arena_.Take<float>(count * h));
  STEPMESH_ASSIGN_OR_RETURN(mb->last_normed, arena_.Take<float>(count * h));
  STEPMESH_ASSIGN_OR_RETURN(mb->logits, arena_.Take<float>(count * v));
  size_t scratch = 0;
  for (auto [in, out] : {std::pair{h, config_.q_rank},
                         {config_.q_rank, width},
                         {width, h},
                         {h, int64_t{config_.num_experts}},
                         {h, v}}) {
    scratch = std::max(scratch, ops_->LinearScratchBytes(slot, in, out));
  }
  scratch = std::max(scratch, ops_->DecodeScratchBytes(count, config_.num_heads, d, max_len_));
  mb->scratch.bytes = scratch;
  STEPMESH_ASSIGN_OR_RETURN(mb->scratch.data, arena_.Take<unsigned char>(scratch));
  STEPMESH_ASSIGN_OR_RETURN(mb->host_logits,
                            arena_.Take<float>(count * v, MemoryKind::kHostPinned));
  STEPMESH_ASSIGN_OR_RETURN(mb->host_tokens, arena_.Take<int32_t>(count, MemoryKind::kHostPinned));
  if (p_.dump_layers) {
    STEPMESH_ASSIGN_OR_RETURN(mb->host_hidden,
                              arena_.Take<float>(slot * h, MemoryKind::kHostPinned));
  }
  micro_batches_.push_back(std::move(mb));
  return absl::OkStatus();
}

absl::Status DeviceAttentionEngine::Init() {
  if (KvFormatOf(shape_) != KvCacheFormat::kFp32) {
    return absl::UnimplementedError(
        absl::StrCat("the device engine keeps an fp32 KV cache; --kv-cache ", shape_.kv_cache,
                     " is implemented by the cpu engine only"));
  }
  if (config_.num_heads > 64) {
    return absl::InvalidArgumentError("the device engine's decode attention takes <= 64 heads");
  }
  STEPMESH_RETURN_IF_ERROR(GenerateWeights());
  const int64_t cache = int64_t{config_.num_layers} * shape_.requests * max_len_ * config_.head_dim;
  STEPMESH_ASSIGN_OR_RETURN(k_cache_, arena_.Take<float>(cache));
  STEPMESH_ASSIGN_OR_RETURN(v_cache_, arena_.Take<float>(cache));
  for (int m = 0; m < shape_.micro_batches; ++m) STEPMESH_RETURN_IF_ERROR(InitMicroBatch(m));
  return absl::OkStatus();
}

absl::Status DeviceAttentionEngine::EnqueueApplyF2A(MicroBatch& mb, int step) {
  const int64_t count = Rows(mb, step) * config_.hidden_size;
  const OpsStream& s = mb.ops_stream;
  STEPMESH_RETURN_IF_ERROR(
      ops_->SumBf16Partials(s, mb.partial_table, shape_.ffn, count, mb.ffn_out));
  return ops_->AddInPlace(s, mb.ffn_out, count, mb.hidden);
}

absl::Status DeviceAttentionEngine::EnqueueDump(MicroBatch& mb, int step, int layer) {
  if (!p_.dump_layers) return absl::OkStatus();
  const int64_t floats = Rows(mb, step) * config_.hidden_size;
  STEPMESH_RETURN_IF_ERROR(mb.stream->CopyAsync(mb.host_hidden, mb.hidden, sizeof(float) * floats));
  float* dst = p_.results->layer_hidden.data() +
               LayerDumpRow(shape_, config_, step, layer, mb.begin) * config_.hidden_size;
  const float* src = mb.host_hidden;
  return mb.stream->LaunchHostFunc([dst, src, floats] { std::copy(src, src + floats, dst); });
}

absl::Status DeviceAttentionEngine::EnqueueAttention(MicroBatch& mb, int step, int layer) {
  const LayerWeights& w = layers_[layer];
  const OpsStream& s = mb.ops_stream;
  const StepTables& t = mb.steps[step];
  const int64_t n = t.rows;
  const int64_t h = config_.hidden_size;
  const int64_t d = config_.head_dim;
  const int64_t heads = config_.num_heads;
  const float eps = config_.rms_norm_eps;
  STEPMESH_RETURN_IF_ERROR(ops_->RmsNorm(s, mb.hidden, w.input_norm, n, h, eps, mb.attn_in));
  STEPMESH_RETURN_IF_ERROR(ops_->Linear(s, mb.attn_in, n, w.q_proj, mb.cq, mb.scratch));
  STEPMESH_RETURN_IF_ERROR(ops_->Linear(s, mb.attn_in, n, w.k_proj, mb.k, mb.scratch));
  STEPMESH_RETURN_IF_ERROR(ops_->Linear(s, mb.attn_in, n, w.v_proj, mb.v, mb.scratch));
  STEPMESH_RETURN_IF_ERROR(ops_->RmsNorm(s, mb.cq, w.inter_norm, n, config_.q_rank, eps, mb.cq));
  STEPMESH_RETURN_IF_ERROR(ops_->Linear(s, mb.cq, n, w.wq, mb.q, mb.scratch));
  STEPMESH_RETURN_IF_ERROR(ops_->RopeNeox(s, mb.q, n, heads, d, t.positions, config_.rope_theta));
  STEPMESH_RETURN_IF_ERROR(ops_->RopeNeox(s, mb.k, n, 1, d, t.positions, config_.rope_theta));
  // This step's K (rotated) and V (not) into the layer's cache.
  STEPMESH_RETURN_IF_ERROR(ops_->ScatterRows(s, mb.k, n, d, t.cache_rows, CacheK(layer, 0)));
  STEPMESH_RETURN_IF_ERROR(ops_->ScatterRows(s, mb.v, n, d, t.cache_rows, CacheV(layer, 0)));
  const float scale = config_.attention_scale();
  if (step == 0) {
    // Prefill: each request's prompt attends causally to itself.
    const int64_t len = shape_.prompt_len;
    for (int i = 0; i < mb.count; ++i) {
      const int request = mb.begin + i;
      STEPMESH_RETURN_IF_ERROR(ops_->MqaAttention(s, mb.q + i * len * heads * d, len, heads, d,
                                                  CacheK(layer, request), CacheV(layer, request),
                                                  len, t.positions + i * len, scale,
                                                  mb.heads_out + i * len * heads * d));
    }
  } else {
    // Decode: one query per request over its whole cache, all requests of
    // the micro-batch in one launch (their caches are max_len rows apart).
    STEPMESH_RETURN_IF_ERROR(ops_->MqaDecodeAttention(
        s, mb.q, mb.count, heads, d, CacheK(layer, mb.begin), CacheV(layer, mb.begin), max_len_,
        t.kv_lens, max_len_, scale, mb.heads_out, mb.scratch));
  }
  STEPMESH_RETURN_IF_ERROR(ops_->Linear(s, mb.heads_out, n, w.o_proj, mb.tmp, mb.scratch));
  return ops_->AddInPlace(s, mb.tmp, n * h, mb.hidden);
}

absl::Status DeviceAttentionEngine::EnqueueFfnInput(MicroBatch& mb, int step, int layer) {
  const LayerWeights& w = layers_[layer];
  const OpsStream& s = mb.ops_stream;
  const int64_t n = Rows(mb, step);
  const int64_t h = config_.hidden_size;
  const int k = config_.top_k;
  auto* ids = static_cast<int32_t*>(mb.wire.topk_ids->data());
  auto* weights = static_cast<float*>(mb.wire.topk_weights->data());
  STEPMESH_RETURN_IF_ERROR(
      ops_->RmsNorm(s, mb.hidden, w.post_norm, n, h, config_.rms_norm_eps, mb.normed));
  if (config_.is_moe_layer[layer]) {
    // The router sees the unquantised y, on the attention side.
    STEPMESH_RETURN_IF_ERROR(ops_->Linear(s, mb.normed, n, w.router, mb.router_logits, mb.scratch));
    STEPMESH_RETURN_IF_ERROR(
        ops_->RouterSoftmaxTopK(s, mb.router_logits, n, config_.num_experts, k, ids, weights));
  } else {
    // Dense layers carry no routing: ids -1 (all bits set), weights 0.
    STEPMESH_RETURN_IF_ERROR(ops_->Memset(s, ids, 0xFF, sizeof(int32_t) * n * k));
    STEPMESH_RETURN_IF_ERROR(ops_->Memset(s, weights, 0, sizeof(float) * n * k));
  }
  return ops_->QuantizeFp8(s, mb.normed, n, h, config_.fp8_group,
                           static_cast<uint8_t*>(mb.wire.codes->data()),
                           static_cast<float*>(mb.wire.scales->data()));
}

absl::Status DeviceAttentionEngine::EnqueueLogits(MicroBatch& mb, int step) {
  const OpsStream& s = mb.ops_stream;
  const int64_t h = config_.hidden_size;
  const int64_t v = config_.vocab_size;
  const int64_t count = mb.count;
  STEPMESH_RETURN_IF_ERROR(
      ops_->EmbeddingLookup(s, mb.hidden, mb.steps[step].last_rows, count, h, mb.last));
  STEPMESH_RETURN_IF_ERROR(
      ops_->RmsNorm(s, mb.last, final_norm_, count, h, config_.rms_norm_eps, mb.last_normed));
  STEPMESH_RETURN_IF_ERROR(ops_->Linear(s, mb.last_normed, count, lm_head_, mb.logits, mb.scratch));
  STEPMESH_RETURN_IF_ERROR(ops_->ArgmaxRows(s, mb.logits, count, v, mb.next_tokens));
  STEPMESH_RETURN_IF_ERROR(
      mb.stream->CopyAsync(mb.host_logits, mb.logits, sizeof(float) * count * v));
  STEPMESH_RETURN_IF_ERROR(
      mb.stream->CopyAsync(mb.host_tokens, mb.next_tokens, sizeof(int32_t) * count));
  // Into the results once the copies landed (stream order, no host wait).
  MicroBatch* m = &mb;
  AttentionResults* res = p_.results;
  const RunShape* shape = &shape_;
  return mb.stream->LaunchHostFunc([m, res, shape, step, v] {
    for (int i = 0; i < m->count; ++i) {
      const int r = m->begin + i;
      res->tokens[size_t(r) * shape->steps() + step] = m->host_tokens[i];
      std::copy(m->host_logits + i * v, m->host_logits + (i + 1) * v,
                res->logits.begin() + (size_t(step) * shape->requests + r) * v);
    }
    res->step_end_ns[size_t(step) * shape->micro_batches + m->index] = stepmesh::MonotonicNowNs();
  });
}

absl::Status DeviceAttentionEngine::EnqueueStage(int m, int step, int layer) {
  MicroBatch& mb = *micro_batches_[m];
  StageTiming* timing = &p_.results->attention[p_.results->StageIndex(step, layer, m)];
  STEPMESH_RETURN_IF_ERROR(
      mb.stream->LaunchHostFunc([timing] { timing->begin_ns = stepmesh::MonotonicNowNs(); }));
  if (layer == 0) {
    if (step > 0) STEPMESH_RETURN_IF_ERROR(EnqueueFinishStep(m, step - 1));
    const int32_t* tokens = step == 0 ? mb.prompt_tokens : mb.next_tokens;
    STEPMESH_RETURN_IF_ERROR(ops_->EmbeddingLookup(
        mb.ops_stream, embedding_, tokens, mb.steps[step].rows, config_.hidden_size, mb.hidden));
  } else {
    STEPMESH_RETURN_IF_ERROR(EnqueueApplyF2A(mb, step));
    STEPMESH_RETURN_IF_ERROR(EnqueueDump(mb, step, layer - 1));
  }
  STEPMESH_RETURN_IF_ERROR(EnqueueAttention(mb, step, layer));
  STEPMESH_RETURN_IF_ERROR(EnqueueFfnInput(mb, step, layer));
  // What the stage computed, for latency models (the trace's args): every
  // sequence of the micro-batch holds prompt + step tokens after it.
  const int64_t rows = mb.steps[step].rows;
  const int64_t kv_tokens = int64_t{mb.count} * (shape_.prompt_len + step);
  return mb.stream->LaunchHostFunc([timing, rows, kv_tokens] {
    timing->end_ns = stepmesh::MonotonicNowNs();
    timing->rows = rows;
    timing->kv_tokens = kv_tokens;
  });
}

absl::Status DeviceAttentionEngine::EnqueueFinishStep(int m, int step) {
  MicroBatch& mb = *micro_batches_[m];
  STEPMESH_RETURN_IF_ERROR(EnqueueApplyF2A(mb, step));
  STEPMESH_RETURN_IF_ERROR(EnqueueDump(mb, step, config_.num_layers - 1));
  return EnqueueLogits(mb, step);
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateDeviceAttentionEngine(
    AttentionEngineParams p, std::unique_ptr<DeviceOps> ops) {
  return MakeEngine<AttentionEngine, DeviceAttentionEngine>(std::move(p), std::move(ops));
}

}  // namespace afd::example
