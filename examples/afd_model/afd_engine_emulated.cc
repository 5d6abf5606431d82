// The "emulated" engines (--emulate-compute PLAN.json): the model is not run
// at all. Each attention stage and each FFN batch is a sleep from the
// planner's latency model (emulated_compute.h) on the micro-batch's stream,
// and the wire tensors are the cpu engine's (pinned host memory, the
// example's shapes), so the pipeline, the headers and the bytes on the wire
// are exactly those of a real run. Tokens and logits stay unset: the
// launcher skips the reference check and prints the emulated throughput.

#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "examples/afd_model/afd_engine.h"
#include "examples/afd_model/emulated_compute.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {
namespace {

class EmulatedAttentionEngine final : public AttentionEngine {
 public:
  explicit EmulatedAttentionEngine(AttentionEngineParams p) : p_(std::move(p)), shape_(*p_.shape) {}

  absl::Status Init() {
    STEPMESH_ASSIGN_OR_RETURN(const stepmesh::planner::Plan plan,
                              LoadEmulationPlan(shape_.emulate_compute));
    emulated_ = std::make_unique<EmulatedAttention>(plan, p_.rank, shape_.micro_batches);
    plan_batch_ = plan.workload.batch;
    for (int m = 0; m < shape_.micro_batches; ++m) {
      auto mb = std::make_unique<MicroBatch>();
      STEPMESH_ASSIGN_OR_RETURN(mb->wire, HostAttentionWire(*p_.backend, shape_, p_.model->config));
      STEPMESH_ASSIGN_OR_RETURN(mb->stream, p_.backend->CreateStream());
      micro_batches_.push_back(std::move(mb));
    }
    return absl::OkStatus();
  }

  std::string name() const override { return "emulated"; }
  AttentionWire& wire(int mb) override { return micro_batches_[mb]->wire; }
  stepmesh::Stream& stream(int mb) override { return *micro_batches_[mb]->stream; }

  absl::Status EnqueueStage(int m, int step, int layer) override {
    if (p_.emulated_load) {
      // Asked here, on the caller's thread, not on the stream's.
      const EmulatedLoad load = p_.emulated_load(step, plan_batch_);
      return micro_batches_[m]->stream->LaunchHostFunc([this, m, step, layer, load] {
        StageTiming& t = p_.results->attention[p_.results->StageIndex(step, layer, m)];
        if (layer == 0 && step > 0) FinishStep(m, step - 1);
        emulated_->RunMeanStage(load.context, load.batch, &t);
      });
    }
    return micro_batches_[m]->stream->LaunchHostFunc([this, m, step, layer] {
      StageTiming& t = p_.results->attention[p_.results->StageIndex(step, layer, m)];
      if (layer == 0 && step > 0) FinishStep(m, step - 1);
      emulated_->RunStage(step, layer, m, &t);
    });
  }

  absl::Status EnqueueFinishStep(int m, int step) override {
    return micro_batches_[m]->stream->LaunchHostFunc([this, m, step] { FinishStep(m, step); });
  }

  absl::Status Finish() override { return absl::OkStatus(); }

 private:
  struct MicroBatch {
    AttentionWire wire;
    std::unique_ptr<stepmesh::Stream> stream;
  };

  // No model: only the step's end counts (the throughput window).
  void FinishStep(int m, int step) {
    p_.results->step_end_ns[size_t(step) * shape_.micro_batches + m] = stepmesh::MonotonicNowNs();
  }

  const AttentionEngineParams p_;
  const RunShape& shape_;
  std::unique_ptr<EmulatedAttention> emulated_;
  int plan_batch_ = 0;
  // Declared last, destroyed first: a stream drains on destruction and its
  // queued stages use emulated_.
  std::vector<std::unique_ptr<MicroBatch>> micro_batches_;
};

class EmulatedFfnEngine final : public FfnEngine {
 public:
  explicit EmulatedFfnEngine(FfnEngineParams p) : p_(std::move(p)), shape_(*p_.shape) {}

  absl::Status Init() {
    STEPMESH_ASSIGN_OR_RETURN(const stepmesh::planner::Plan plan,
                              LoadEmulationPlan(shape_.emulate_compute));
    emulated_ = std::make_unique<EmulatedFfn>(plan);
    plan_batch_ = plan.workload.batch;
    for (int m = 0; m < shape_.micro_batches; ++m) {
      STEPMESH_ASSIGN_OR_RETURN(FfnWire wire, HostFfnWire(*p_.backend, shape_, *p_.config));
      wires_.push_back(std::move(wire));
    }
    STEPMESH_ASSIGN_OR_RETURN(stream_, p_.backend->CreateStream());
    return absl::OkStatus();
  }

  std::string name() const override { return "emulated"; }
  FfnWire& wire(int mb) override { return wires_[mb]; }
  stepmesh::Stream& stream() override { return *stream_; }

  // A batch holding micro-batch mb of rows.size() attention instances: one
  // sleep (the plan's FFN time for that many instances' virtual slots); the
  // reply region goes back as it is.
  absl::Status EnqueueForward(int mb, int layer, int partitions,
                              std::span<const WorkerRows> rows) override {
    const int workers = static_cast<int>(rows.size());
    const int slots = p_.virtual_batch ? p_.virtual_batch(workers, plan_batch_) : plan_batch_;
    return stream_->LaunchHostFunc(
        [this, workers, partitions, slots] { emulated_->RunBatch(workers, partitions, slots); });
  }

  absl::Status Finish() override { return absl::OkStatus(); }

 private:
  const FfnEngineParams p_;
  const RunShape& shape_;
  std::unique_ptr<EmulatedFfn> emulated_;
  int plan_batch_ = 0;
  std::vector<FfnWire> wires_;
  // Declared last, destroyed first: it drains queued batches that use emulated_.
  std::unique_ptr<stepmesh::Stream> stream_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateEmulatedAttentionEngine(
    AttentionEngineParams p) {
  return MakeEngine<AttentionEngine, EmulatedAttentionEngine>(std::move(p));
}

absl::StatusOr<std::unique_ptr<FfnEngine>> CreateEmulatedFfnEngine(FfnEngineParams p) {
  return MakeEngine<FfnEngine, EmulatedFfnEngine>(std::move(p));
}

}  // namespace afd::example
