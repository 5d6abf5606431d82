#pragma once

// The compute of the disaggregated programs, behind one seam per side
// (docs/example.md, "Engines"). The programs (afd_attention_main.cc,
// afd_ffn_main.cc) own the mesh, the key plan, the waits, the sends and the
// wire checks; an engine owns the weights, the KV cache, the per-micro-batch
// state and the wire tensors, and enqueues the per-layer work of a
// micro-batch on that micro-batch's stream. Engines:
//  - "cpu": the CPU kernels (the model's AttentionModel / FfnSide) as host
//    functions on the backend's streams (cpu_mock, or cudaLaunchHostFunc on
//    CUDA); every model of the example (Step-3, Step-5);
//  - "cuda": the device engines (afd_engine_device.cc) over the CUDA
//    kernels on the CUDA backend's streams, activations, KV cache and wire
//    tensors in device memory (built with CUDA only);
//  - "cpu-device": the same device engines over the CPU kernels on cpu_mock,
//    so the orchestration of the CUDA path runs (and is checked) in CI;
//  - "emulated" (--emulate-compute PLAN.json): no model at all, each stage
//    and FFN batch a sleep from the planner's latency model
//    (emulated_compute.h), the bytes still real, so ratios like 6A1F run on
//    a small machine.
// The device engines implement Step-3's attention only.
// A new way to compute is a new engine; the pipeline does not change.

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/example_model.h"
#include "stepmesh/backend.h"

namespace afd::example {

// One micro-batch's pre-registered tensors on an attention instance. The A2F
// tensors are [slot rows, ...] (a step pushes a prefix); the header is
// host memory the pipeline writes before each send (WireHeader).
struct AttentionWire {
  std::unique_ptr<stepmesh::Memory> header;  // int32 [kWireHeaderInts], host pinned
  std::unique_ptr<stepmesh::Memory> codes, scales, topk_ids, topk_weights;
  std::vector<std::unique_ptr<stepmesh::Memory>> partials;  // bf16, one per FFN server
};

class AttentionEngine {
 public:
  virtual ~AttentionEngine() = default;
  virtual std::string name() const = 0;

  virtual AttentionWire& wire(int mb) = 0;
  virtual stepmesh::Stream& stream(int mb) = 0;

  // Enqueues micro-batch mb's stage (step, layer) on stream(mb), to run once
  // its previous layer's partials have landed (the caller waited for that
  // reply): at layer 0 the end of the previous step (its last F2A, LM head,
  // greedy tokens) and the embedding of this step's tokens, at other layers
  // the F2A reduction of layer - 1 into the residual stream; then the
  // attention, post-attention norm, router and A2F encode of `layer` into
  // wire(mb). Fills the stage's timing, the tokens, logits and (if asked)
  // the per-layer residuals of AttentionResults.
  virtual absl::Status EnqueueStage(int mb, int step, int layer) = 0;
  // Enqueues the end of the last step (after its last reply landed).
  virtual absl::Status EnqueueFinishStep(int mb, int step) = 0;
  // After every stream has drained: the first error a stage hit, with
  // anything still on the device copied into the results.
  virtual absl::Status Finish() = 0;
};

// One emulated attention stage's workload (--context-growth).
struct EmulatedLoad {
  double context = 0;  // mean KV tokens per request
  int batch = 0;       // virtual decode slots of the micro-batch
};

struct AttentionEngineParams {
  const RunShape* shape = nullptr;
  const ExampleModel* model = nullptr;  // its config is the run's ModelConfig
  int rank = 0;
  bool dump_layers = false;
  std::shared_ptr<stepmesh::Backend> backend;
  // This instance's prompts, request-major [requests][prompt_len].
  std::vector<std::vector<int32_t>> prompts;
  // FFN partitions whose partials each step reduces, per step of the
  // instance (--resize: the expert layout schedule over its span); empty:
  // shape->ffn at every step. The wire holds shape->ffn partial slots.
  std::vector<int> partitions_per_step;
  // Written by the stages; sized by the caller (tokens, logits, layer_hidden,
  // attention, step_end_ns).
  AttentionResults* results = nullptr;
  // The emulated engine with --context-growth: the mean context per request
  // and the virtual slots B of the instance's step `local` (`plan_batch`:
  // the plan's B), asked when the stage is enqueued (on the caller's
  // thread: --autoscale amends the schedule there). Empty: the seed's draws
  // at the plan's batch.
  std::function<EmulatedLoad(int local_step, int plan_batch)> emulated_load;
};

// One micro-batch's regions on an FFN instance: [workers, slot rows, ...]
// recv regions (slot w is attention instance w) and the reply region.
struct FfnWire {
  std::unique_ptr<stepmesh::Memory> header;  // int32 [workers, kWireHeaderInts], host pinned
  std::unique_ptr<stepmesh::Memory> codes, scales, topk_ids, topk_weights, reply;
};

// One micro-batch's wire tensors, all in pinned host memory (the engines
// whose stages are host functions: cpu, emulated).
absl::StatusOr<AttentionWire> HostAttentionWire(stepmesh::Backend& backend, const RunShape& shape,
                                                const ModelConfig& config);
absl::StatusOr<FfnWire> HostFfnWire(stepmesh::Backend& backend, const RunShape& shape,
                                    const ModelConfig& config);

struct WorkerRows {
  int worker = 0;
  int64_t rows = 0;
};

// Whether the rows of a batch sit back to back in the [workers, slot rows]
// recv regions: the workers are consecutive and every slot but the last is
// full (prefill with equal micro-batches), so the FFN can read them in place.
bool RowsContiguous(std::span<const WorkerRows> rows, int64_t slot_rows);

class FfnEngine {
 public:
  virtual ~FfnEngine() = default;
  virtual std::string name() const = 0;

  virtual FfnWire& wire(int mb) = 0;
  virtual stepmesh::Stream& stream() = 0;

  // Enqueues this partition's partial of `layer` for the rows the workers
  // sent in micro-batch mb's recv regions (slot w's first rows), written as
  // bf16 into their reply slots. All workers' rows go through the FFN at
  // once (one pass over the expert weights). `partitions`: the F this batch
  // is computed for (partition rank of F); a new F re-shards: the cpu and
  // emulated engines load the expert weights the rank owns under it at its
  // first batch (--resize), the device engines have only FfnEngineParams'.
  virtual absl::Status EnqueueForward(int mb, int layer, int partitions,
                                      std::span<const WorkerRows> rows) = 0;
  // After the stream drained: the first error a forward hit.
  virtual absl::Status Finish() = 0;
};

struct FfnEngineParams {
  const RunShape* shape = nullptr;
  const ModelConfig* config = nullptr;
  int rank = 0;        // partition rank of `partitions`
  int partitions = 0;  // the first F this rank serves; 0: shape->ffn
  std::shared_ptr<stepmesh::Backend> backend;
  // The emulated engine: the virtual slots per attention instance of a batch
  // of `workers` instances (--emulated-batch; `plan_batch`: the plan's B);
  // empty: the plan's batch.
  std::function<int(int workers, int plan_batch)> virtual_batch;
};

// The engine shape->ResolvedEngine() names ("cuda" is UNIMPLEMENTED in
// builds without CUDA; a device engine for a Step-5 model INVALID_ARGUMENT).
absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateAttentionEngine(AttentionEngineParams p);
absl::StatusOr<std::unique_ptr<FfnEngine>> CreateFfnEngine(FfnEngineParams p);

// Free memory of the GPU the cuda engine runs on (device 0); UNIMPLEMENTED
// without the CUDA engine, UNAVAILABLE without a GPU.
absl::StatusOr<int64_t> CudaDeviceFreeBytes();

class DeviceOps;

// `Engine` made from `args` and initialised (its Init()), as its interface
// `Base`: how every Create*Engine builds one.
template <typename Base, typename Engine, typename... Args>
absl::StatusOr<std::unique_ptr<Base>> MakeEngine(Args&&... args) {
  auto engine = std::make_unique<Engine>(std::forward<Args>(args)...);
  if (absl::Status s = engine->Init(); !s.ok()) return s;
  return std::unique_ptr<Base>(std::move(engine));
}

// The device engines over any DeviceOps (afd_engine_device.cc).
absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateDeviceAttentionEngine(
    AttentionEngineParams p, std::unique_ptr<DeviceOps> ops);
absl::StatusOr<std::unique_ptr<FfnEngine>> CreateDeviceFfnEngine(FfnEngineParams p,
                                                                 std::unique_ptr<DeviceOps> ops);

// The CPU engines (any backend whose streams run host functions).
absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateCpuAttentionEngine(AttentionEngineParams p);
absl::StatusOr<std::unique_ptr<FfnEngine>> CreateCpuFfnEngine(FfnEngineParams p);

// The emulated engines (afd_engine_emulated.cc, --emulate-compute PLAN.json):
// no model, sleeps from the plan's latency model on the same pipeline and
// wire (any backend whose streams run host functions).
absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateEmulatedAttentionEngine(
    AttentionEngineParams p);
absl::StatusOr<std::unique_ptr<FfnEngine>> CreateEmulatedFfnEngine(FfnEngineParams p);

}  // namespace afd::example
