// The "cpu" engines: the CPU kernels (the model's AttentionModel, FfnSide)
// run as host functions on the backend's streams. On cpu_mock a stream is a
// thread; on CUDA, cudaLaunchHostFunc, with the wire tensors in pinned host
// memory.

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "examples/afd_model/afd_engine.h"
#include "examples/afd_model/attention_model.h"
#include "examples/afd_model/ffn_side.h"
#include "examples/afd_model/kernels/cpu_kernels.h"
#include "examples/afd_model/wire.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {
namespace {

// The first error any stream callback hit (callbacks cannot return one).
class FirstError {
 public:
  void Set(absl::Status s) {
    absl::MutexLock lock(&mu_);
    if (status_.ok()) status_ = std::move(s);
  }
  absl::Status Get() {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

KvCacheFormat KvFormat(const RunShape& shape) {
  KvCacheFormat format = KvCacheFormat::kFp32;
  ParseKvCacheFormat(shape.kv_cache, &format);  // validated with the run shape
  return format;
}

class CpuAttentionEngine final : public AttentionEngine {
 public:
  explicit CpuAttentionEngine(AttentionEngineParams p)
      : p_(std::move(p)), shape_(*p_.shape), config_(p_.model->config) {}

  absl::Status Init() {
    std::string error;
    side_ =
        p_.model->NewAttention(shape_.requests, int64_t{shape_.prompt_len} + shape_.decode_steps,
                               KvFormat(shape_), &error);
    if (side_ == nullptr) return absl::InvalidArgumentError(error);
    for (int m = 0; m < shape_.micro_batches; ++m) {
      auto mb = std::make_unique<MicroBatch>();
      mb->index = m;
      mb->begin = shape_.MicroBatchBegin(m);
      mb->end = shape_.MicroBatchEnd(m);
      mb->next_tokens.resize(mb->count());
      mb->state = side_->NewStepState();
      // Pinned host memory: the CPU kernels read and write it, and on CUDA
      // the copy engines still get page-locked buffers.
      STEPMESH_ASSIGN_OR_RETURN(mb->wire, HostAttentionWire(*p_.backend, shape_, config_));
      for (const auto& partial : mb->wire.partials) {
        mb->partial_ptrs.push_back(static_cast<const uint16_t*>(partial->data()));
      }
      STEPMESH_ASSIGN_OR_RETURN(mb->stream, p_.backend->CreateStream());
      micro_batches_.push_back(std::move(mb));
    }
    return absl::OkStatus();
  }

  std::string name() const override { return "cpu"; }
  AttentionWire& wire(int mb) override { return micro_batches_[mb]->wire; }
  stepmesh::Stream& stream(int mb) override { return *micro_batches_[mb]->stream; }

  absl::Status EnqueueStage(int m, int step, int layer) override {
    MicroBatch* mb = micro_batches_[m].get();
    return mb->stream->LaunchHostFunc([this, mb, step, layer] { Stage(step, layer, *mb); });
  }

  absl::Status EnqueueFinishStep(int m, int step) override {
    MicroBatch* mb = micro_batches_[m].get();
    return mb->stream->LaunchHostFunc([this, mb, step] { FinishStep(step, *mb); });
  }

  absl::Status Finish() override {
    // [prefill history, prefill attended, decode history, decode attended]
    std::vector<int64_t>& blocks = p_.results->selection_blocks;
    blocks.assign(kSelectionBlockCounts, 0);
    for (const auto& mb : micro_batches_) {
      blocks[0] += mb->prefill_selection.history_blocks;
      blocks[1] += mb->prefill_selection.attended_blocks;
      blocks[2] += mb->decode_selection.history_blocks;
      blocks[3] += mb->decode_selection.attended_blocks;
    }
    return error_.Get();
  }

 private:
  struct MicroBatch {
    int index = 0;
    int begin = 0;  // requests [begin, end) of this instance
    int end = 0;
    int count() const { return end - begin; }
    StepStatePtr state{nullptr, nullptr};                // made by the model (NewStepState)
    SelectionStats prefill_selection, decode_selection;  // sparse models only
    std::vector<SequenceChunk> chunks;
    std::vector<int32_t> inputs;
    std::vector<int32_t> next_tokens;  // greedy tokens of the last finished step
    AttentionWire wire;
    std::vector<const uint16_t*> partial_ptrs;
    std::unique_ptr<stepmesh::Stream> stream;
  };

  void BeginStep(int step, MicroBatch& mb) {
    mb.chunks.clear();
    mb.inputs.clear();
    for (int i = 0; i < mb.count(); ++i) {
      const int r = mb.begin + i;
      if (step == 0) {
        mb.chunks.push_back({r, shape_.prompt_len});
        mb.inputs.insert(mb.inputs.end(), p_.prompts[r].begin(), p_.prompts[r].end());
      } else {
        mb.chunks.push_back({r, 1});
        mb.inputs.push_back(mb.next_tokens[i]);
      }
    }
    if (!side_->BeginStep(mb.chunks, mb.inputs, mb.state.get())) {
      error_.Set(absl::InternalError(absl::StrCat("BeginStep failed for micro-batch ", mb.index,
                                                  " step ", step, " (KV cache overflow?)")));
    }
  }

  void DumpLayer(int step, int layer, const MicroBatch& mb) {
    if (!p_.dump_layers) return;
    const int64_t row = LayerDumpRow(shape_, config_, step, layer, mb.begin);
    std::copy(mb.state->hidden.begin(), mb.state->hidden.end(),
              p_.results->layer_hidden.begin() + row * config_.hidden_size);
  }

  // The partials of `step`'s FFN: the first F(step) slots.
  std::span<const uint16_t* const> Partials(int step, const MicroBatch& mb) const {
    const size_t f = p_.partitions_per_step.empty() ? mb.partial_ptrs.size()
                                                    : size_t(p_.partitions_per_step[step]);
    return std::span<const uint16_t* const>(mb.partial_ptrs).first(f);
  }

  void FinishStep(int step, MicroBatch& mb) {
    side_->ApplyF2A(Partials(step, mb), mb.state.get());
    DumpLayer(step, config_.num_layers - 1, mb);
    const SelectionStats selection = side_->TakeSelectionStats(mb.state.get());
    SelectionStats& sum = step == 0 ? mb.prefill_selection : mb.decode_selection;
    sum.history_blocks += selection.history_blocks;
    sum.attended_blocks += selection.attended_blocks;
    std::vector<float> logits;
    side_->LastTokenLogits(*mb.state, nullptr, &logits);
    const int64_t v = config_.vocab_size;
    cpu::ArgmaxRows(logits.data(), mb.count(), v, mb.next_tokens.data());
    AttentionResults& res = *p_.results;
    for (int i = 0; i < mb.count(); ++i) {
      const int r = mb.begin + i;
      res.tokens[size_t(r) * shape_.steps() + step] = mb.next_tokens[i];
      std::copy(logits.begin() + i * v, logits.begin() + (i + 1) * v,
                res.logits.begin() + (size_t(step) * shape_.requests + r) * v);
    }
    // Each micro-batch writes its own slot (streams run concurrently); the
    // launcher takes the maximum.
    res.step_end_ns[size_t(step) * shape_.micro_batches + mb.index] = stepmesh::MonotonicNowNs();
  }

  void Stage(int step, int layer, MicroBatch& mb) {
    StageTiming& t = p_.results->attention[p_.results->StageIndex(step, layer, mb.index)];
    t.begin_ns = stepmesh::MonotonicNowNs();
    if (layer == 0) {
      if (step > 0) FinishStep(step - 1, mb);
      BeginStep(step, mb);
    } else {
      side_->ApplyF2A(Partials(step, mb), mb.state.get());
      DumpLayer(step, layer - 1, mb);
    }
    side_->Attention(layer, mb.state.get());
    // What the stage computed, for latency models (the trace's args).
    t.rows = mb.state->num_tokens();
    t.kv_tokens = 0;
    for (const SequenceChunk& c : mb.chunks) t.kv_tokens += side_->SequenceLength(c.sequence);
    side_->PrepareFfnInput(layer, mb.state.get());
    AttentionWire& w = mb.wire;
    side_->WriteA2F(
        *mb.state,
        {static_cast<uint8_t*>(w.codes->data()), static_cast<float*>(w.scales->data()),
         static_cast<int32_t*>(w.topk_ids->data()), static_cast<float*>(w.topk_weights->data())});
    t.end_ns = stepmesh::MonotonicNowNs();
  }

  const AttentionEngineParams p_;
  const RunShape& shape_;
  const ModelConfig& config_;
  std::unique_ptr<AttentionModel> side_;  // the model's attention side
  FirstError error_;
  // Declared last, destroyed first: a stream drains on destruction and its
  // queued stages touch side_.
  std::vector<std::unique_ptr<MicroBatch>> micro_batches_;
};

class CpuFfnEngine final : public FfnEngine {
 public:
  explicit CpuFfnEngine(FfnEngineParams p)
      : p_(std::move(p)), shape_(*p_.shape), config_(*p_.config) {}

  absl::Status Init() {
    Layout(p_.partitions > 0 ? p_.partitions : shape_.ffn);
    STEPMESH_ASSIGN_OR_RETURN(stream_, p_.backend->CreateStream());
    regions_.resize(shape_.micro_batches);
    for (Regions& r : regions_) {
      STEPMESH_ASSIGN_OR_RETURN(r.wire, HostFfnWire(*p_.backend, shape_, config_));
    }
    return absl::OkStatus();
  }

  std::string name() const override { return "cpu"; }
  FfnWire& wire(int mb) override { return regions_[mb].wire; }
  stepmesh::Stream& stream() override { return *stream_; }

  absl::Status EnqueueForward(int mb, int layer, int partitions,
                              std::span<const WorkerRows> rows) override {
    if (partitions < 1 || p_.rank >= partitions) {
      return absl::InvalidArgumentError(
          absl::StrCat("ffn ", p_.rank, ": no partition ", p_.rank, " of ", partitions));
    }
    // A map lookup only when F changes (a resize), not per batch.
    if (partitions != current_partitions_) {
      current_ = Layout(partitions);
      current_partitions_ = partitions;
    }
    const FfnSide* ffn = current_;
    std::vector<WorkerRows> copy(rows.begin(), rows.end());
    return stream_->LaunchHostFunc([this, mb, layer, ffn, copy = std::move(copy)] {
      Compute(*ffn, regions_[mb], layer, copy);
    });
  }

  absl::Status Finish() override { return absl::OkStatus(); }

 private:
  struct Regions {
    FfnWire wire;
    // Compaction buffers for batches whose rows are not contiguous (decode:
    // each slot is mostly empty). Per micro-batch because batches of
    // different micro-batches may be queued on the stream at once.
    std::vector<uint8_t> codes_stage;
    std::vector<float> scales_stage, topk_weights_stage;
    std::vector<int32_t> topk_ids_stage;
    std::vector<uint16_t> partial_stage;
  };

  // This rank's partition of F: its weights generated at the first batch
  // under F (a re-shard), kept while batches of the previous layout may
  // still be queued (micro-batches cross a resize step one by one). Only
  // the main thread inserts; queued Computes hold their FfnSide by pointer
  // (map nodes never move).
  const FfnSide* Layout(int partitions) {
    auto it = layouts_.find(partitions);
    if (it == layouts_.end()) {
      it = layouts_.try_emplace(partitions, config_, FfnPartition{p_.rank, partitions}).first;
    }
    return &it->second;
  }

  void Compute(const FfnSide& ffn_, Regions& r, int layer, const std::vector<WorkerRows>& rows) {
    const int64_t slot = shape_.SlotRows();
    const int64_t h = config_.hidden_size;
    const int64_t k = config_.top_k;
    const int64_t groups = h / config_.fp8_group;
    auto* codes = static_cast<uint8_t*>(r.wire.codes->data());
    auto* scales = static_cast<float*>(r.wire.scales->data());
    auto* ids = static_cast<int32_t*>(r.wire.topk_ids->data());
    auto* weights = static_cast<float*>(r.wire.topk_weights->data());
    auto* reply = static_cast<uint16_t*>(r.wire.reply->data());
    int64_t n = 0;
    for (const WorkerRows& wr : rows) n += wr.rows;
    if (RowsContiguous(rows, slot)) {
      // Zero-copy: the rows already sit back to back in the recv regions.
      const int64_t base = int64_t{rows.front().worker} * slot;
      ffn_.Forward(
          layer,
          A2FView{n, codes + base * h, scales + base * groups, ids + base * k, weights + base * k},
          reply + base * h, &workspace_);
      return;
    }
    r.codes_stage.resize(n * h);
    r.scales_stage.resize(n * groups);
    r.topk_ids_stage.resize(n * k);
    r.topk_weights_stage.resize(n * k);
    r.partial_stage.resize(n * h);
    int64_t at = 0;
    for (const WorkerRows& wr : rows) {
      const int64_t src = int64_t{wr.worker} * slot;
      std::memcpy(&r.codes_stage[at * h], codes + src * h, wr.rows * h);
      std::memcpy(&r.scales_stage[at * groups], scales + src * groups, wr.rows * groups * 4);
      std::memcpy(&r.topk_ids_stage[at * k], ids + src * k, wr.rows * k * 4);
      std::memcpy(&r.topk_weights_stage[at * k], weights + src * k, wr.rows * k * 4);
      at += wr.rows;
    }
    ffn_.Forward(layer,
                 A2FView{n, r.codes_stage.data(), r.scales_stage.data(), r.topk_ids_stage.data(),
                         r.topk_weights_stage.data()},
                 r.partial_stage.data(), &workspace_);
    at = 0;
    for (const WorkerRows& wr : rows) {
      std::memcpy(reply + int64_t{wr.worker} * slot * h, &r.partial_stage[at * h],
                  wr.rows * h * sizeof(uint16_t));
      at += wr.rows;
    }
  }

  const FfnEngineParams p_;
  const RunShape& shape_;
  const ModelConfig& config_;
  std::map<int, FfnSide> layouts_;    // by partition count F
  const FfnSide* current_ = nullptr;  // the layout of the last batch
  int current_partitions_ = 0;
  FfnWorkspace workspace_;  // one stream runs every Compute, so one suffices
  std::vector<Regions> regions_;
  // Declared last, destroyed first: it drains queued Computes that touch the
  // members above.
  std::unique_ptr<stepmesh::Stream> stream_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateCpuAttentionEngine(AttentionEngineParams p) {
  return MakeEngine<AttentionEngine, CpuAttentionEngine>(std::move(p));
}

absl::StatusOr<std::unique_ptr<FfnEngine>> CreateCpuFfnEngine(FfnEngineParams p) {
  return MakeEngine<FfnEngine, CpuFfnEngine>(std::move(p));
}

}  // namespace afd::example
