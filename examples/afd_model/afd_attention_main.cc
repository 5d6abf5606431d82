// afd_attention: one attention instance of a disaggregated Step-3 run (a
// stepmesh worker). Owns the embedding, MFA attention + KV cache, the norms,
// the router, FP8 quantisation of the A2F activations, the reduction of the
// FFN partials, the residual stream and the LM head; the FFN lives on the
// afd_ffn servers. Normally started by afd_launch.
//
//   afd_attention --scheduler HOST:PORT --rank A --results FILE [--dump-layers]
//                 [run flags: --config --attention --ffn --requests --prompt-len
//                  --decode-steps --micro-batches --transport --backend
//                  --poll-mode --timeout-ms] [--device N]
//
// Pipeline: the instance's requests are split into micro-batches, each with
// its own pre-registered wire tensors, StepState and backend stream. The main
// thread only enqueues: micro-batch m's attention for layer l runs on m's
// stream, an event is recorded after it, and PushPull is gated on that event
// (the send thread waits, not the caller). The main thread then moves on to
// micro-batch m+1, whose attention overlaps m's A2F / FFN / F2A, and only
// blocks on m's reply right before enqueueing m's next layer.

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/attention_side.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/emulated_compute.h"
#include "examples/afd_model/kernels/cpu_kernels.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/wire.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {
namespace {

using stepmesh::DType;
using stepmesh::Shape;

struct MicroBatch {
  int index = 0;
  int begin = 0;  // requests [begin, end) of this instance
  int end = 0;
  int count() const { return end - begin; }

  StepState state;
  std::vector<SequenceChunk> chunks;
  std::vector<int32_t> inputs;
  std::vector<int32_t> next_tokens;  // greedy tokens of the last finished step

  // Pre-registered wire tensors (backend memory: pinned host on CUDA).
  std::unique_ptr<stepmesh::Memory> codes, scales, topk_ids, topk_weights;
  std::vector<std::unique_ptr<stepmesh::Memory>> partials;  // per FFN server
  std::vector<const uint16_t*> partial_ptrs;

  std::unique_ptr<stepmesh::Stream> stream;
  std::unique_ptr<stepmesh::Event> ready;  // the attention of the current layer is done
  stepmesh::RequestHandle handle;
  bool in_flight = false;
  size_t in_flight_stage = 0;  // StageIndex of the request in flight
  int in_flight_step = 0, in_flight_layer = 0;
};

class AttentionInstance {
 public:
  AttentionInstance(const RunShape& shape, const ModelConfig& config, int rank, bool dump_layers)
      : shape_(shape),
        config_(config),
        rank_(rank),
        dump_layers_(dump_layers),
        side_(config, shape.requests, int64_t{shape.prompt_len} + shape.decode_steps) {}

  // Joins the mesh and registers every micro-batch's tensors.
  absl::Status Init(const std::string& scheduler, int device);
  absl::Status Run();
  const AttentionResults& results() const { return results_; }
  absl::Status Finish() {
    if (absl::Status s = worker_->Barrier(); !s.ok()) return s;
    return worker_->Shutdown();
  }

 private:
  // Host-side work of (step, layer) for a micro-batch; runs on its stream.
  void Stage(int step, int layer, MicroBatch& mb);
  void BeginStep(int step, MicroBatch& mb);
  void FinishStep(int step, MicroBatch& mb);
  void DumpLayer(int step, int layer, const MicroBatch& mb);
  absl::Status WaitReply(MicroBatch& mb);
  absl::Status Launch(int step, int layer, MicroBatch& mb);
  void Fail(absl::Status s) {
    absl::MutexLock lock(&error_mu_);
    if (error_.ok()) error_ = std::move(s);
  }
  absl::Status Error() {
    absl::MutexLock lock(&error_mu_);
    return error_;
  }

  const RunShape shape_;
  const ModelConfig config_;
  const int rank_;
  const bool dump_layers_;
  AttentionSide side_;
  std::unique_ptr<EmulatedAttention> emulated_;  // --emulate-compute
  std::vector<std::vector<int32_t>> prompts_;  // this instance's requests
  std::shared_ptr<stepmesh::Backend> backend_;
  AttentionResults results_;
  absl::Mutex error_mu_;
  absl::Status error_ ABSL_GUARDED_BY(error_mu_);
  // The worker reads the registered memory the micro-batches own, so it is
  // declared last and destroyed first; the streams drain on destruction and
  // their queued stages touch side_/results_, declared earlier.
  std::vector<std::unique_ptr<MicroBatch>> micro_batches_;
  std::unique_ptr<stepmesh::AFTensorWorker> worker_;
};

absl::Status AttentionInstance::Init(const std::string& scheduler, int device) {
  const int64_t h = config_.hidden_size;
  const int64_t slot = shape_.SlotRows();
  const A2FSizes sizes{slot, h, config_.top_k, config_.fp8_group};

  const std::vector<int32_t> all =
      GeneratePromptTokens(config_, shape_.attention * shape_.requests, shape_.prompt_len);
  for (int r = 0; r < shape_.requests; ++r) {
    const int64_t g = int64_t{rank_} * shape_.requests + r;
    prompts_.emplace_back(all.begin() + g * shape_.prompt_len,
                          all.begin() + (g + 1) * shape_.prompt_len);
  }

  absl::StatusOr<std::unique_ptr<stepmesh::Backend>> backend =
      stepmesh::CreateBackend(shape_.backend, device);
  if (!backend.ok()) return backend.status();
  backend_ = std::move(*backend);

  if (!shape_.emulate_compute.empty()) {
    STEPMESH_ASSIGN_OR_RETURN(const auto plan, LoadEmulationPlan(shape_.emulate_compute));
    emulated_ = std::make_unique<EmulatedAttention>(plan, rank_, shape_.micro_batches);
  }

  auto alloc = [&](size_t bytes) -> absl::StatusOr<std::unique_ptr<stepmesh::Memory>> {
    // Pinned host memory: the model kernels are CPU kernels, and on CUDA the
    // NIC/copy engines still get page-locked buffers.
    return backend_->Allocate(bytes, stepmesh::MemoryKind::kHostPinned);
  };
  for (int m = 0; m < shape_.micro_batches; ++m) {
    auto mb = std::make_unique<MicroBatch>();
    mb->index = m;
    mb->begin = shape_.MicroBatchBegin(m);
    mb->end = shape_.MicroBatchEnd(m);
    mb->next_tokens.resize(mb->count());
    STEPMESH_ASSIGN_OR_RETURN(mb->codes, alloc(sizes.codes_bytes()));
    STEPMESH_ASSIGN_OR_RETURN(mb->scales, alloc(sizes.scales_bytes()));
    STEPMESH_ASSIGN_OR_RETURN(mb->topk_ids, alloc(sizes.topk_ids_bytes()));
    STEPMESH_ASSIGN_OR_RETURN(mb->topk_weights, alloc(sizes.topk_weights_bytes()));
    for (int s = 0; s < shape_.ffn; ++s) {
      STEPMESH_ASSIGN_OR_RETURN(auto p, alloc(F2APartialBytes(slot, h)));
      mb->partial_ptrs.push_back(static_cast<const uint16_t*>(p->data()));
      mb->partials.push_back(std::move(p));
    }
    STEPMESH_ASSIGN_OR_RETURN(mb->stream, backend_->CreateStream());
    STEPMESH_ASSIGN_OR_RETURN(mb->ready, backend_->CreateEvent());
    micro_batches_.push_back(std::move(mb));
  }

  STEPMESH_ASSIGN_OR_RETURN(stepmesh::MeshOptions options,
                            MeshOptionsFor(shape_, stepmesh::Role::kWorker, rank_, scheduler));
  options.device = device;
  STEPMESH_ASSIGN_OR_RETURN(worker_, stepmesh::AFTensorWorker::Create(options, backend_));

  const int64_t groups = h / config_.fp8_group;
  for (auto& mb : micro_batches_) {
    const int m = mb->index;
    STEPMESH_RETURN_IF_ERROR(worker_->RegisterPushTensor(
        PushKey(m, A2FTensor::kCodes), mb->codes->View(DType::kFloat8E4M3, Shape{slot, h})));
    STEPMESH_RETURN_IF_ERROR(worker_->RegisterPushTensor(
        PushKey(m, A2FTensor::kScales), mb->scales->View(DType::kFloat32, Shape{slot, groups})));
    STEPMESH_RETURN_IF_ERROR(worker_->RegisterPushTensor(
        PushKey(m, A2FTensor::kTopkIds),
        mb->topk_ids->View(DType::kInt32, Shape{slot, config_.top_k})));
    STEPMESH_RETURN_IF_ERROR(worker_->RegisterPushTensor(
        PushKey(m, A2FTensor::kTopkWeights),
        mb->topk_weights->View(DType::kFloat32, Shape{slot, config_.top_k})));
    for (int s = 0; s < shape_.ffn; ++s) {
      STEPMESH_RETURN_IF_ERROR(worker_->RegisterPullTensor(
          PullKey(m), s, mb->partials[s]->View(DType::kBFloat16, Shape{slot, h})));
    }
  }

  results_.instance = rank_;
  results_.requests = shape_.requests;
  results_.steps = shape_.steps();
  results_.layers = config_.num_layers;
  results_.micro_batches = shape_.micro_batches;
  results_.servers = shape_.ffn;
  results_.hidden = h;
  results_.vocab = config_.vocab_size;
  results_.step_end_ns.assign(size_t(shape_.steps()) * shape_.micro_batches, 0);
  results_.tokens.assign(size_t(shape_.requests) * shape_.steps(), -1);
  results_.logits.assign(size_t(shape_.steps()) * shape_.requests * config_.vocab_size, 0.0f);
  if (dump_layers_) {
    const size_t rows = size_t(shape_.requests) * (shape_.prompt_len + shape_.decode_steps);
    results_.layer_hidden.assign(rows * config_.num_layers * h, 0.0f);
  }
  const size_t stages = size_t(shape_.steps()) * config_.num_layers * shape_.micro_batches;
  results_.attention.assign(stages, {});
  results_.traces.assign(stages * shape_.ffn, {});
  return absl::OkStatus();
}

void AttentionInstance::BeginStep(int step, MicroBatch& mb) {
  mb.chunks.clear();
  mb.inputs.clear();
  for (int i = 0; i < mb.count(); ++i) {
    const int r = mb.begin + i;
    if (step == 0) {
      mb.chunks.push_back({r, shape_.prompt_len});
      mb.inputs.insert(mb.inputs.end(), prompts_[r].begin(), prompts_[r].end());
    } else {
      mb.chunks.push_back({r, 1});
      mb.inputs.push_back(mb.next_tokens[i]);
    }
  }
  if (!side_.BeginStep(mb.chunks, mb.inputs, &mb.state)) {
    Fail(absl::InternalError(absl::StrCat("BeginStep failed for micro-batch ", mb.index,
                                          " step ", step, " (KV cache overflow?)")));
  }
}

void AttentionInstance::DumpLayer(int step, int layer, const MicroBatch& mb) {
  if (!dump_layers_) return;
  // [step][layer][rows of the step][H]: step 0 has requests * prompt_len
  // rows, each later step one row per request.
  const int64_t h = config_.hidden_size;
  const int64_t per_request = shape_.TokensPerRequest(step);
  const int64_t step_rows = per_request * shape_.requests;
  const int64_t rows_before =
      step == 0 ? 0
                : int64_t{shape_.prompt_len} * shape_.requests * config_.num_layers +
                      int64_t{step - 1} * shape_.requests * config_.num_layers;
  const int64_t row = rows_before + layer * step_rows + mb.begin * per_request;
  std::copy(mb.state.hidden.begin(), mb.state.hidden.end(),
            results_.layer_hidden.begin() + row * h);
}

void AttentionInstance::FinishStep(int step, MicroBatch& mb) {
  if (emulated_) {  // no model: only the step's end counts
    results_.step_end_ns[size_t(step) * shape_.micro_batches + mb.index] =
        stepmesh::MonotonicNowNs();
    return;
  }
  side_.ApplyF2A(mb.partial_ptrs, &mb.state);
  DumpLayer(step, config_.num_layers - 1, mb);
  std::vector<float> logits;
  side_.LastTokenLogits(mb.state, nullptr, &logits);
  const int64_t v = config_.vocab_size;
  cpu::ArgmaxRows(logits.data(), mb.count(), v, mb.next_tokens.data());
  for (int i = 0; i < mb.count(); ++i) {
    const int r = mb.begin + i;
    results_.tokens[size_t(r) * shape_.steps() + step] = mb.next_tokens[i];
    std::copy(logits.begin() + i * v, logits.begin() + (i + 1) * v,
              results_.logits.begin() + (size_t(step) * shape_.requests + r) * v);
  }
  // Each micro-batch writes its own slot (streams run concurrently); the
  // launcher takes the maximum.
  results_.step_end_ns[size_t(step) * shape_.micro_batches + mb.index] = stepmesh::MonotonicNowNs();
}

void AttentionInstance::Stage(int step, int layer, MicroBatch& mb) {
  StageTiming& t = results_.attention[results_.StageIndex(step, layer, mb.index)];
  t.begin_ns = stepmesh::MonotonicNowNs();
  if (emulated_) {  // sleeps instead of the kernels; the A2F bytes still go out
    if (layer == 0 && step > 0) FinishStep(step - 1, mb);
    emulated_->RunStage(step, layer, mb.index, &t);
    return;
  }
  if (layer == 0) {
    if (step > 0) FinishStep(step - 1, mb);
    BeginStep(step, mb);
  } else {
    side_.ApplyF2A(mb.partial_ptrs, &mb.state);
    DumpLayer(step, layer - 1, mb);
  }
  side_.Attention(layer, &mb.state);
  t.rows = mb.state.num_tokens();
  t.kv_tokens = 0;
  for (const SequenceChunk& c : mb.chunks) t.kv_tokens += side_.SequenceLength(c.sequence);
  side_.PrepareFfnInput(layer, &mb.state);
  side_.WriteA2F(mb.state, {static_cast<uint8_t*>(mb.codes->data()),
                            static_cast<float*>(mb.scales->data()),
                            static_cast<int32_t*>(mb.topk_ids->data()),
                            static_cast<float*>(mb.topk_weights->data())});
  t.end_ns = stepmesh::MonotonicNowNs();
}

absl::Status AttentionInstance::WaitReply(MicroBatch& mb) {
  if (!mb.in_flight) return absl::OkStatus();
  mb.in_flight = false;
  const absl::Status s = worker_->Wait(mb.handle, shape_.timeout);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("attention ", rank_, ": step ", mb.in_flight_step,
                                               " layer ", mb.in_flight_layer, " micro-batch ",
                                               mb.index, ": FFN reply: ", s.message()));
  }
  absl::StatusOr<stepmesh::TraceRecord> trace = worker_->FetchTrace(mb.handle);
  if (trace.ok()) {
    for (const auto& per : trace->servers) {
      if (per.server >= 0 && per.server < shape_.ffn) {
        results_.traces[mb.in_flight_stage * shape_.ffn + per.server] = per.stamps;
      }
    }
  }
  return Error();
}

absl::Status AttentionInstance::Launch(int step, int layer, MicroBatch& mb) {
  STEPMESH_RETURN_IF_ERROR(mb.stream->LaunchHostFunc([this, step, layer, &mb] {
    Stage(step, layer, mb);
  }));
  STEPMESH_RETURN_IF_ERROR(mb.ready->Record(*mb.stream));
  const int64_t n = int64_t{mb.count()} * shape_.TokensPerRequest(step);
  const A2FSizes sizes{n, config_.hidden_size, config_.top_k, config_.fp8_group};
  const int m = mb.index;
  // Only the rows of this step travel: a prefix of each registered tensor.
  const stepmesh::Push pushes[kA2FTensors] = {
      {PushKey(m, A2FTensor::kCodes), sizes.codes_bytes()},
      {PushKey(m, A2FTensor::kScales), sizes.scales_bytes()},
      {PushKey(m, A2FTensor::kTopkIds), sizes.topk_ids_bytes()},
      {PushKey(m, A2FTensor::kTopkWeights), sizes.topk_weights_bytes()},
  };
  std::vector<stepmesh::Pull> pulls;
  for (int s = 0; s < shape_.ffn; ++s) pulls.push_back({PullKey(m), s});
  absl::StatusOr<stepmesh::RequestHandle> handle =
      worker_->PushPull(pushes, pulls, stepmesh::SendOptions{.ready = mb.ready.get()});
  if (!handle.ok()) {
    return absl::Status(handle.status().code(),
                        absl::StrCat("attention ", rank_, ": PushPull step ", step, " layer ",
                                     layer, ": ", handle.status().message()));
  }
  mb.handle = *handle;
  mb.in_flight = true;
  mb.in_flight_stage = results_.StageIndex(step, layer, m);
  mb.in_flight_step = step;
  mb.in_flight_layer = layer;
  return absl::OkStatus();
}

absl::Status AttentionInstance::Run() {
  STEPMESH_RETURN_IF_ERROR(worker_->Barrier());
  results_.start_ns = stepmesh::MonotonicNowNs();
  for (int step = 0; step < shape_.steps(); ++step) {
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      for (auto& mb : micro_batches_) {
        // The previous layer's partials must have landed before this
        // micro-batch's stage reduces them.
        STEPMESH_RETURN_IF_ERROR(WaitReply(*mb));
        STEPMESH_RETURN_IF_ERROR(Launch(step, layer, *mb));
      }
    }
  }
  for (auto& mb : micro_batches_) {
    STEPMESH_RETURN_IF_ERROR(WaitReply(*mb));
    MicroBatch* p = mb.get();
    STEPMESH_RETURN_IF_ERROR(
        mb->stream->LaunchHostFunc([this, p] { FinishStep(shape_.steps() - 1, *p); }));
  }
  for (auto& mb : micro_batches_) STEPMESH_RETURN_IF_ERROR(mb->stream->Synchronize(shape_.timeout));
  return Error();
}

int Main(int argc, char** argv) {
  absl::StatusOr<Flags> flags = Flags::Parse(argc, argv, {"dump-layers"});
  if (!flags.ok()) {
    std::fprintf(stderr, "afd_attention: %s\n", flags.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<RunShape> shape = ParseRunFlags(*flags);
  const std::string scheduler = flags->Str("scheduler", "");
  const std::string results_path = flags->Str("results", "");
  const bool dump_layers = flags->Bool("dump-layers");
  absl::StatusOr<int64_t> rank = flags->Int("rank", -1);
  absl::StatusOr<int64_t> device = flags->Int("device", 0);
  absl::Status st = shape.ok() ? flags->CheckAllUsed() : shape.status();
  if (st.ok() && (!rank.ok() || !device.ok())) st = !rank.ok() ? rank.status() : device.status();
  if (st.ok() && (scheduler.empty() || *rank < 0 || *rank >= shape->attention)) {
    st = absl::InvalidArgumentError("need --scheduler and --rank in [0, --attention)");
  }
  if (!st.ok()) {
    std::fprintf(stderr, "afd_attention: %s\n", st.ToString().c_str());
    return 2;
  }
  std::string error;
  const std::optional<ModelConfig> config =
      LoadModelConfig(shape->config, BundledConfigDir(), &error);
  if (!config) {
    std::fprintf(stderr, "afd_attention: config: %s\n", error.c_str());
    return 2;
  }
  if (int64_t{shape->prompt_len} + shape->decode_steps > config->max_positions) {
    std::fprintf(stderr, "afd_attention: prompt + decode exceeds max_position_embedding\n");
    return 2;
  }

  const int a = static_cast<int>(*rank);
  AttentionInstance instance(*shape, *config, a, dump_layers);
  st = instance.Init(scheduler, static_cast<int>(*device));
  if (st.ok()) st = instance.Run();
  if (st.ok() && !results_path.empty()) st = WriteResults(results_path, instance.results());
  if (st.ok()) st = instance.Finish();
  if (!st.ok()) {
    std::fprintf(stderr, "afd_attention[%d]: error: %s\n", a, st.ToString().c_str());
    return 1;
  }
  std::printf("afd_attention[%d]: %d requests, %d steps done\n", a, shape->requests,
              shape->steps());
  return 0;
}

}  // namespace
}  // namespace afd::example

int main(int argc, char** argv) { return afd::example::Main(argc, argv); }
