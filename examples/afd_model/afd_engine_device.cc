// The device engines: the attention and FFN compute as kernels enqueued on
// the micro-batches' streams (DeviceOps), with every activation, the KV
// cache and the wire tensors (except the host-side header) in the backend's
// device memory. Nothing in a stage waits for the device: the per-step index
// tables (positions, cache rows, decode lengths, last rows) are built once
// at start, the next step's tokens go from the argmax straight into the
// embedding on the device, and results reach the host through copies into
// pinned staging followed by a host function, in stream order.
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
#include "examples/afd_model/device_ops.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/wire.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {
namespace {

using stepmesh::Memory;
using stepmesh::MemoryKind;

TensorSpec LinearSpec(std::string name, int64_t fan_in) {
  return {std::move(name), WeightKind::kLinear, fan_in};
}
TensorSpec GammaSpec(std::string name) { return {std::move(name), WeightKind::kNormGamma, 1}; }

// Owns device allocations; hands out typed pointers.
class Arena {
 public:
  explicit Arena(stepmesh::Backend& backend) : backend_(backend) {}
  template <typename T>
  absl::StatusOr<T*> Take(int64_t count, MemoryKind kind = MemoryKind::kDevice) {
    STEPMESH_ASSIGN_OR_RETURN(
        std::unique_ptr<Memory> m,
        backend_.Allocate(std::max<size_t>(sizeof(T) * static_cast<size_t>(count), 16), kind));
    T* p = static_cast<T*>(m->data());
    memory_.push_back(std::move(m));
    return p;
  }
  // Host data to a new device array (start-up only: a synchronous copy).
  template <typename T>
  absl::StatusOr<T*> Upload(const std::vector<T>& values) {
    STEPMESH_ASSIGN_OR_RETURN(T * p, Take<T>(static_cast<int64_t>(values.size())));
    if (!values.empty()) {
      STEPMESH_RETURN_IF_ERROR(backend_.Copy(p, values.data(), sizeof(T) * values.size()));
    }
    return p;
  }

 private:
  stepmesh::Backend& backend_;
  std::vector<std::unique_ptr<Memory>> memory_;
};

KvCacheFormat KvFormatOf(const RunShape& shape) {
  KvCacheFormat format = KvCacheFormat::kFp32;
  ParseKvCacheFormat(shape.kv_cache, &format);
  return format;
}

// ------------------------------------------------------------- attention

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

// ------------------------------------------------------------- FFN

class DeviceFfnEngine final : public FfnEngine {
 public:
  DeviceFfnEngine(FfnEngineParams p, std::unique_ptr<DeviceOps> ops)
      : p_(std::move(p)),
        shape_(*p_.shape),
        config_(*p_.config),
        partition_{p_.rank, shape_.ffn},
        ops_(std::move(ops)),
        arena_(*p_.backend) {}

  absl::Status Init();
  std::string name() const override { return absl::StrCat("device (", ops_->name(), " ops)"); }
  FfnWire& wire(int mb) override { return wires_[mb]; }
  stepmesh::Stream& stream() override { return *stream_; }
  absl::Status EnqueueForward(int mb, int layer, int partitions,
                              std::span<const WorkerRows> rows) override;
  absl::Status Finish() override { return absl::OkStatus(); }

 private:
  struct Mlp {  // a column slice of a SwiGLU; inter 0 when empty
    int64_t inter = 0;
    DeviceWeight gate, up, down;
  };
  struct LayerWeights {
    bool is_moe = false;
    Mlp mlp;  // dense FFN or shared expert slice
    int64_t slots = 0;
    const int32_t* expert_to_slot = nullptr;
    DeviceWeight gate, up, down;  // stacked [slots * I, H] / [slots * H, I]
  };

  absl::StatusOr<Mlp> SliceMlp(const std::string& prefix, int64_t inter);
  absl::Status GenerateWeights();

  const FfnEngineParams p_;
  const RunShape& shape_;
  const ModelConfig& config_;
  const FfnPartition partition_;
  std::unique_ptr<DeviceOps> ops_;
  Arena arena_;
  std::vector<LayerWeights> layers_;
  std::vector<FfnWire> wires_;
  // One stream runs every forward in order, so one set of these suffices.
  float* x_ = nullptr;        // [W * slot, H] dequantised input
  float* partial_ = nullptr;  // [W * slot, H] fp32 partial
  uint8_t* codes_stage_ = nullptr;
  float* scales_stage_ = nullptr;
  int32_t* ids_stage_ = nullptr;
  float* weights_stage_ = nullptr;
  uint16_t* partial_stage_ = nullptr;
  Scratch scratch_;
  OpsStream ops_stream_;
  // Destroyed first: it drains queued work that reads the buffers above.
  std::unique_ptr<stepmesh::Stream> stream_;
};

absl::StatusOr<DeviceFfnEngine::Mlp> DeviceFfnEngine::SliceMlp(const std::string& prefix,
                                                               int64_t inter) {
  const int64_t h = config_.hidden_size;
  const uint64_t seed = config_.weight_seed;
  const int64_t c0 = partition_.ColumnBegin(inter);
  const int64_t c1 = partition_.ColumnEnd(inter);
  Mlp mlp;
  mlp.inter = c1 - c0;
  if (mlp.inter == 0) return mlp;
  // gate/up [inter, H]: rows c0..c1 are contiguous; down [H, inter]: one
  // range of columns per row.
  const ElementRange rows{c0 * h, mlp.inter * h};
  STEPMESH_ASSIGN_OR_RETURN(mlp.gate, ops_->LinearWeight(LinearSpec(prefix + "gate_proj.weight", h),
                                                         seed, {&rows, 1}, mlp.inter, h));
  STEPMESH_ASSIGN_OR_RETURN(mlp.up, ops_->LinearWeight(LinearSpec(prefix + "up_proj.weight", h),
                                                       seed, {&rows, 1}, mlp.inter, h));
  std::vector<ElementRange> columns;
  for (int64_t r = 0; r < h; ++r) columns.push_back({r * inter + c0, mlp.inter});
  STEPMESH_ASSIGN_OR_RETURN(
      mlp.down, ops_->LinearWeight(LinearSpec(prefix + "down_proj.weight", inter), seed, columns, h,
                                   mlp.inter));
  return mlp;
}

absl::Status DeviceFfnEngine::GenerateWeights() {
  const int64_t h = config_.hidden_size;
  const uint64_t seed = config_.weight_seed;
  layers_.resize(config_.num_layers);
  for (int l = 0; l < config_.num_layers; ++l) {
    LayerWeights& w = layers_[l];
    w.is_moe = config_.is_moe_layer[l];
    if (!w.is_moe) {
      STEPMESH_ASSIGN_OR_RETURN(w.mlp,
                                SliceMlp(LayerTensorName(l, "mlp."), config_.dense_intermediate));
      continue;
    }
    STEPMESH_ASSIGN_OR_RETURN(
        w.mlp, SliceMlp(LayerTensorName(l, "share_expert."), config_.shared_intermediate));
    std::vector<int32_t> to_slot(config_.num_experts, -1);
    std::vector<ElementRange> blocks;
    const int64_t inter = config_.expert_intermediate;
    const int64_t matrix = inter * h;
    for (int e = 0; e < config_.num_experts; ++e) {
      if (!partition_.OwnsExpert(e)) continue;
      to_slot[e] = static_cast<int32_t>(w.slots++);
      // Experts are stacked [E, ...]: expert e starts at e * matrix.
      blocks.push_back({e * matrix, matrix});
    }
    STEPMESH_ASSIGN_OR_RETURN(w.expert_to_slot, ops_->Int32Table(to_slot));
    if (w.slots == 0) continue;
    STEPMESH_ASSIGN_OR_RETURN(
        w.gate, ops_->LinearWeight(LinearSpec(LayerTensorName(l, "moe.gate_proj.weight"), h), seed,
                                   blocks, w.slots * inter, h));
    STEPMESH_ASSIGN_OR_RETURN(
        w.up, ops_->LinearWeight(LinearSpec(LayerTensorName(l, "moe.up_proj.weight"), h), seed,
                                 blocks, w.slots * inter, h));
    STEPMESH_ASSIGN_OR_RETURN(
        w.down, ops_->LinearWeight(LinearSpec(LayerTensorName(l, "moe.down_proj.weight"), inter),
                                   seed, blocks, w.slots * h, inter));
  }
  return absl::OkStatus();
}

absl::Status DeviceFfnEngine::Init() {
  STEPMESH_ASSIGN_OR_RETURN(stream_, p_.backend->CreateStream());
  STEPMESH_ASSIGN_OR_RETURN(ops_stream_, ops_->Bind(*stream_));
  STEPMESH_RETURN_IF_ERROR(GenerateWeights());
  const int64_t w = shape_.attention;
  const int64_t slot = shape_.SlotRows();
  const int64_t rows = w * slot;
  const int64_t h = config_.hidden_size;
  const int64_t k = config_.top_k;
  const A2FSizes sizes{rows, h, k, config_.fp8_group};
  for (int m = 0; m < shape_.micro_batches; ++m) {
    FfnWire& wire = wires_.emplace_back();
    auto alloc = [&](size_t bytes, MemoryKind kind) { return p_.backend->Allocate(bytes, kind); };
    STEPMESH_ASSIGN_OR_RETURN(
        wire.header, alloc(sizeof(int32_t) * w * kWireHeaderInts, MemoryKind::kHostPinned));
    STEPMESH_ASSIGN_OR_RETURN(wire.codes, alloc(sizes.codes_bytes(), MemoryKind::kDevice));
    STEPMESH_ASSIGN_OR_RETURN(wire.scales, alloc(sizes.scales_bytes(), MemoryKind::kDevice));
    STEPMESH_ASSIGN_OR_RETURN(wire.topk_ids, alloc(sizes.topk_ids_bytes(), MemoryKind::kDevice));
    STEPMESH_ASSIGN_OR_RETURN(wire.topk_weights,
                              alloc(sizes.topk_weights_bytes(), MemoryKind::kDevice));
    STEPMESH_ASSIGN_OR_RETURN(wire.reply, alloc(F2APartialBytes(rows, h), MemoryKind::kDevice));
  }
  STEPMESH_ASSIGN_OR_RETURN(x_, arena_.Take<float>(rows * h));
  STEPMESH_ASSIGN_OR_RETURN(partial_, arena_.Take<float>(rows * h));
  STEPMESH_ASSIGN_OR_RETURN(codes_stage_, arena_.Take<uint8_t>(rows * h));
  STEPMESH_ASSIGN_OR_RETURN(scales_stage_, arena_.Take<float>(rows * (h / config_.fp8_group)));
  STEPMESH_ASSIGN_OR_RETURN(ids_stage_, arena_.Take<int32_t>(rows * k));
  STEPMESH_ASSIGN_OR_RETURN(weights_stage_, arena_.Take<float>(rows * k));
  STEPMESH_ASSIGN_OR_RETURN(partial_stage_, arena_.Take<uint16_t>(rows * h));
  size_t scratch = 0;
  for (const LayerWeights& l : layers_) {
    scratch = std::max(scratch, ops_->SwiGluScratchBytes(rows, h, l.mlp.inter));
    if (l.slots > 0) {
      scratch =
          std::max(scratch, ops_->GroupedExpertScratchBytes(rows, config_.top_k, h,
                                                            config_.expert_intermediate, l.slots));
    }
  }
  scratch_.bytes = scratch;
  STEPMESH_ASSIGN_OR_RETURN(scratch_.data, arena_.Take<unsigned char>(scratch));
  return absl::OkStatus();
}

absl::Status DeviceFfnEngine::EnqueueForward(int m, int layer, int partitions,
                                             std::span<const WorkerRows> rows) {
  if (partitions != partition_.count) {
    // The device weights are generated once, for one layout (RunShape::Validate
    // keeps --resize off the device engines).
    return absl::InvalidArgumentError(
        absl::StrCat("ffn ", p_.rank, ": the ", name(), " engine holds partition ",
                     partition_.index, " of ", partition_.count, ", not of ", partitions));
  }
  const int64_t slot = shape_.SlotRows();
  const int64_t h = config_.hidden_size;
  const int64_t k = config_.top_k;
  const int64_t groups = h / config_.fp8_group;
  const FfnWire& wire = wires_[m];
  auto* codes = static_cast<uint8_t*>(wire.codes->data());
  auto* scales = static_cast<float*>(wire.scales->data());
  auto* ids = static_cast<int32_t*>(wire.topk_ids->data());
  auto* weights = static_cast<float*>(wire.topk_weights->data());
  auto* reply = static_cast<uint16_t*>(wire.reply->data());
  stepmesh::Stream& st = *stream_;
  const OpsStream& s = ops_stream_;
  int64_t n = 0;
  for (const WorkerRows& wr : rows) n += wr.rows;
  const bool contiguous = RowsContiguous(rows, slot);
  const int64_t base = contiguous ? int64_t{rows.front().worker} * slot : 0;
  if (!contiguous) {
    // Gather each worker's rows into one block (device-to-device copies).
    int64_t at = 0;
    for (const WorkerRows& wr : rows) {
      const int64_t src = int64_t{wr.worker} * slot;
      STEPMESH_RETURN_IF_ERROR(st.CopyAsync(codes_stage_ + at * h, codes + src * h, wr.rows * h));
      STEPMESH_RETURN_IF_ERROR(st.CopyAsync(scales_stage_ + at * groups, scales + src * groups,
                                            sizeof(float) * wr.rows * groups));
      STEPMESH_RETURN_IF_ERROR(
          st.CopyAsync(ids_stage_ + at * k, ids + src * k, sizeof(int32_t) * wr.rows * k));
      STEPMESH_RETURN_IF_ERROR(
          st.CopyAsync(weights_stage_ + at * k, weights + src * k, sizeof(float) * wr.rows * k));
      at += wr.rows;
    }
  }
  const uint8_t* in_codes = contiguous ? codes + base * h : codes_stage_;
  const float* in_scales = contiguous ? scales + base * groups : scales_stage_;
  const int32_t* in_ids = contiguous ? ids + base * k : ids_stage_;
  const float* in_weights = contiguous ? weights + base * k : weights_stage_;
  uint16_t* out = contiguous ? reply + base * h : partial_stage_;

  const LayerWeights& w = layers_[layer];
  STEPMESH_RETURN_IF_ERROR(
      ops_->DequantizeFp8(s, in_codes, in_scales, n, h, config_.fp8_group, x_));
  if (w.mlp.inter > 0) {
    STEPMESH_RETURN_IF_ERROR(
        ops_->SwiGlu(s, x_, n, h, w.mlp.gate, w.mlp.up, w.mlp.down, partial_, scratch_));
  } else {
    STEPMESH_RETURN_IF_ERROR(ops_->Memset(s, partial_, 0, sizeof(float) * n * h));
  }
  if (w.is_moe && w.slots > 0) {
    STEPMESH_RETURN_IF_ERROR(ops_->GroupedExpertSwiGlu(
        s, x_, n, h, in_ids, in_weights, config_.top_k, w.expert_to_slot, config_.num_experts,
        w.slots, w.gate, w.up, w.down, config_.expert_intermediate, partial_, scratch_));
  }
  STEPMESH_RETURN_IF_ERROR(ops_->EncodeBf16(s, partial_, n * h, out));
  if (!contiguous) {
    int64_t at = 0;
    for (const WorkerRows& wr : rows) {
      STEPMESH_RETURN_IF_ERROR(st.CopyAsync(reply + int64_t{wr.worker} * slot * h,
                                            partial_stage_ + at * h,
                                            sizeof(uint16_t) * wr.rows * h));
      at += wr.rows;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateDeviceAttentionEngine(
    AttentionEngineParams p, std::unique_ptr<DeviceOps> ops) {
  return MakeEngine<AttentionEngine, DeviceAttentionEngine>(std::move(p), std::move(ops));
}

absl::StatusOr<std::unique_ptr<FfnEngine>> CreateDeviceFfnEngine(FfnEngineParams p,
                                                                 std::unique_ptr<DeviceOps> ops) {
  return MakeEngine<FfnEngine, DeviceFfnEngine>(std::move(p), std::move(ops));
}

}  // namespace afd::example
