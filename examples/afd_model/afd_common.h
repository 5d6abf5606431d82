#pragma once

// Shared by the disaggregated programs (afd_attention, afd_ffn, afd_launch):
// command-line flags, the key plan of a micro-batch, how an attention
// instance splits its requests into micro-batches, and the results file an
// attention instance writes for the launcher.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/example_model.h"
#include "examples/afd_model/resize_plan.h"
#include "stepmesh/options.h"
#include "stepmesh/trace.h"
#include "stepmesh/worker.h"

namespace afd::example {

// "--name value" pairs (and bare "--name" switches, value "true"). Every
// program parses into this and then reads typed values, so a typo in a flag
// name is reported instead of silently ignored. A flag given twice: Int, Str
// and Bool read the last value (a later flag overrides a default put
// before it), All every value in order (repeatable flags: --resize).
class Flags {
 public:
  static absl::StatusOr<Flags> Parse(int argc, char** argv,
                                     const std::vector<std::string>& switches);
  absl::StatusOr<int64_t> Int(absl::string_view name, int64_t fallback);
  std::string Str(absl::string_view name, absl::string_view fallback);
  bool Bool(absl::string_view name);
  std::vector<std::string> All(absl::string_view name);
  // Fails on any flag not read through Int/Str/Bool.
  absl::Status CheckAllUsed() const;

 private:
  std::map<std::string, std::vector<std::string>> values_;
  std::map<std::string, bool> used_;
};

// What every process of a run agrees on; the launcher passes it down as flags
// (AppendRunFlags / ParseRunFlags) so the shapes and key plans line up.
struct RunShape {
  std::string config = "tiny";
  int attention = 1;  // attention instances = stepmesh workers
  int ffn = 1;        // FFN instances = stepmesh servers = partitions
  int requests = 6;   // per attention instance
  int prompt_len = 32;
  int decode_steps = 16;
  int micro_batches = 3;  // pipeline stages per attention instance
  std::string transport = "tcp";
  std::string backend = "cpu_mock";
  std::string poll_mode = "adaptive";
  // The compute engine (afd_engine.h): "auto" is "cuda" on the cuda backend,
  // "cpu" otherwise; "cpu" runs the CPU kernels on any backend; "cpu-device"
  // the device engines over the CPU kernels (cpu_mock).
  std::string engine = "auto";
  std::string kv_cache = "fp32";  // fp32, bf16 or fp8 (KvCacheFormat)
  absl::Duration timeout = absl::Seconds(30);
  // --emulate-compute PLAN.json selects the "emulated" engine: sleeps from
  // the plan's latency model instead of the model's kernels
  // (emulated_compute.h); --engine stays auto.
  std::string emulate_compute;
  // --resize STEP:xAyF, in order (resize_plan.h): attention and ffn above
  // are the start shape. Validate checks the schedule.
  std::vector<std::string> resize;
  // afd_launch --autoscale (docs/elastic.md, "Autoscale"): the schedule
  // above grows while the run decodes, amended at decision checkpoints
  // (autoscale_channel.h). max_attention: the attention capacity the mesh
  // and every region are sized for (0: the schedule's); decision_every: a
  // checkpoint every K global steps (0: none).
  int max_attention = 0;
  int decision_every = 0;
  // --context-growth FROM:TO (emulated engine): the mean context per request
  // grows linearly from FROM tokens at step 0 to TO at the last step, and
  // each attention stage takes the planner's mean KV load at that context
  // (planner::MeanKvTokens) instead of the seed's draws. Empty: the draws.
  std::string context_growth;
  // --emulated-batch per_instance|global (emulated engine, with
  // --context-growth): the virtual decode slots B of an attention instance
  // at a step. per_instance: the plan's batch; global: the plan's batch
  // times the start's attention instances, split over the step's (the
  // autoscale file's batch_policy).
  std::string emulated_batch = "per_instance";

  // The shape schedule (never failing after Validate).
  ResizeSchedule Schedule() const;
  // What attention instance `rank` of an elastic run runs: its own steps
  // (its span of the schedule: decode_steps = span - 1, its step 0 the
  // prefill of the requests that arrive with it), attention and ffn the
  // capacity (prompts are drawn for every rank; regions sized for every
  // peer). Without --resize, this shape.
  RunShape ForAttention(int rank) const;
  // An FFN instance's: the capacity, the run's steps.
  RunShape ForFfn() const;
  // Elastic: --resize or --autoscale (a capacity above the start).
  bool elastic() const { return !resize.empty() || max_attention > 0; }
  // The most instances of each side the run may have (max_attention counts).
  MeshShape Capacity() const;
  // --context-growth: the mean context per request at global step `step`
  // (0 without it).
  double ContextAt(int step) const;
  // The emulated virtual slots per micro-batch of an attention instance at
  // a step run by `attention` instances (`plan_batch`: the plan's B). On
  // the run's shape (its `attention` is the start's), not ForAttention's.
  int VirtualBatch(int plan_batch, int instances) const;

  int steps() const { return decode_steps + 1; }  // prefill + decode
  // Requests [begin, end) of micro-batch m (sizes differ by at most one).
  int MicroBatchBegin(int m) const { return m * requests / micro_batches; }
  int MicroBatchEnd(int m) const { return (m + 1) * requests / micro_batches; }
  // Rows of the largest micro-batch step (a prefill): the slot size of every
  // pre-registered wire tensor.
  int64_t SlotRows() const {
    return int64_t{(requests + micro_batches - 1) / micro_batches} * prompt_len;
  }
  // Tokens fed per request in a step.
  int64_t TokensPerRequest(int step) const { return step == 0 ? prompt_len : 1; }
  absl::Status Validate() const;
  // The engine that runs: "emulated" with --emulate-compute, else the one
  // "auto" stands for.
  std::string ResolvedEngine() const {
    if (!emulate_compute.empty()) return "emulated";
    return engine != "auto" ? engine : backend == "cuda" ? "cuda" : "cpu";
  }
};

// "FROM:TO" of --context-growth; false unless both are in [1, 2^24].
bool ParseContextGrowth(absl::string_view text, int* from, int* to);

// Element row (of `hidden` floats) where instance rows of (step, layer)
// start in AttentionResults::layer_hidden, for the micro-batch whose first
// request is `first_request`.
int64_t LayerDumpRow(const RunShape& shape, const ModelConfig& config, int step, int layer,
                     int first_request);

absl::StatusOr<RunShape> ParseRunFlags(Flags& flags);

// The checks of a run shape against its model that need the config: FFN
// partitions vs experts and FFN widths, positions vs max_position_embedding,
// and what a model family runs on (Step-5: the cpu engine, an fp32 KV
// cache). Every program applies them; the launcher before it starts anything.
absl::Status ValidateRunForModel(const RunShape& shape, const ExampleModel& model);

// Memory a run needs, from the config alone (weights, KV cache, wire
// regions, results, a margin for activations): host memory of each attention
// instance, each FFN instance and the launcher's monolithic reference (every
// weight in fp32, every request's KV cache), which runs after the children
// have exited; with the cuda engine the device memory of all children.
struct HostMemoryEstimate {
  int64_t attention_instance = 0;
  int64_t ffn_instance = 0;
  int64_t reference = 0;
  // The cuda engine: device memory of every process together (they share
  // one GPU); 0 for the CPU engines.
  int64_t device_total = 0;
  int64_t children(const RunShape& s) const {
    return s.attention * attention_instance + s.ffn * ffn_instance;
  }
};
HostMemoryEstimate EstimateHostMemory(const RunShape& shape, const ModelConfig& config);

// Progress of an attention instance, for the launcher's progress lines: a
// fixed-size record rewritten in place (one pwrite per layer).
class ProgressWriter {
 public:
  ProgressWriter() = default;
  ~ProgressWriter();
  ProgressWriter(const ProgressWriter&) = delete;
  ProgressWriter& operator=(const ProgressWriter&) = delete;
  absl::Status Open(const std::string& path);
  void Update(int step, int layer);

 private:
  int fd_ = -1;
};
struct Progress {
  int step = -1;
  int layer = -1;
};
// {-1, -1} when the file is missing or not written yet.
Progress ReadProgress(const std::string& path);
void AppendRunFlags(const RunShape& shape, std::vector<std::string>* argv);

// MeshOptions of a participant from the run shape.
absl::StatusOr<stepmesh::MeshOptions> MeshOptionsFor(const RunShape& shape, stepmesh::Role role,
                                                     int rank, const std::string& scheduler);

// Key plan: micro-batch m pushes codes, scales, topk ids, topk weights and
// the header (in this order; the codes key is the batch's group) and pulls
// one partial from every FFN server.
enum class A2FTensor : int { kCodes = 0, kScales = 1, kTopkIds = 2, kTopkWeights = 3, kHeader = 4 };
inline constexpr int kA2FTensors = 5;
inline stepmesh::Key PushKey(int micro_batch, A2FTensor t) {
  return 1000 + 16 * micro_batch + static_cast<int>(t);
}
inline stepmesh::Key PullKey(int micro_batch) { return 1000 + 16 * micro_batch + 8; }
// The micro-batch a group key names, or -1.
int MicroBatchOfGroup(stepmesh::Key group, int micro_batches);

// The stage (SendOptions::stage) of a request: servers batch the requests of
// one (step, layer, micro-batch) together, whichever workers sent them, so
// an attention instance that joins at a step (--resize) lands in that step's
// batches, and a batch names its step, layer and micro-batch. Global steps.
struct StageId {
  int step = 0;
  int layer = 0;
  int micro_batch = 0;
};
uint32_t StageOf(const RunShape& shape, int layers, StageId id);
// The stage a batch's group names; false when it is none of the run's.
bool DecodeStage(const RunShape& shape, int layers, stepmesh::Key group, StageId* id);

// The A2F header: what a push is, so the FFN checks it instead of trusting
// its own count of batches (a frame for the wrong layer or step is an error,
// not silently wrong numbers). int32 [kWireHeaderInts]:
//   magic, step, layer, micro_batch, rows, instance, flags, hidden.
inline constexpr int kWireHeaderInts = 8;
inline constexpr int32_t kWireHeaderMagic = 0x31444641;  // "AFD1" little-endian
struct WireHeader {
  int32_t step = 0;
  int32_t layer = 0;
  int32_t micro_batch = 0;
  int32_t rows = 0;
  int32_t instance = 0;  // the attention instance that sent it
  int32_t flags = 0;     // kMoeLayer
  int32_t hidden = 0;
  static constexpr int32_t kMoeLayer = 1;
};
void WriteWireHeader(const WireHeader& h, int32_t* out);
// `got` is what attention instance expected.instance sent; `ffn` names the
// checking FFN instance in the error.
absl::Status CheckWireHeader(const int32_t* got, const WireHeader& expected, int ffn);

// The results of one attention instance, written to a file for the launcher.
inline constexpr int kSelectionBlockCounts = 4;
struct StageTiming {
  uint64_t begin_ns = 0;  // attention compute of (step, layer, micro-batch)
  uint64_t end_ns = 0;
  // What the stage computed, for calibrating latency models (stepmesh_plan
  // --calibrate-trace): its token rows and the KV tokens it attended over
  // (the cache lengths of its sequences after the step's tokens).
  int64_t rows = 0;
  int64_t kv_tokens = 0;
};
struct AttentionResults {
  int32_t instance = 0;
  int32_t requests = 0;
  int32_t steps = 0;
  int32_t layers = 0;
  int32_t micro_batches = 0;
  int32_t servers = 0;
  int64_t hidden = 0;
  int64_t vocab = 0;
  uint64_t start_ns = 0;              // after the start barrier
  std::vector<uint64_t> step_end_ns;  // [step][micro-batch]: logits of the step done
  std::vector<int32_t> tokens;        // [request][step]
  std::vector<float> logits;          // [step][request][vocab]
  // [step][layer][rows of the step, request-major][hidden]: the residual
  // stream after each layer (empty when not dumped).
  std::vector<float> layer_hidden;
  std::vector<StageTiming> attention;  // [step][layer][micro-batch]
  // [step][layer][micro-batch][server]
  std::vector<stepmesh::TraceStamps> traces;
  // Sparse models: history blocks [prefill possible, prefill attended,
  // decode possible, decode attended] over (token, KV group) pairs of the
  // global layers; zeros for dense models. kSelectionBlockCounts entries.
  std::vector<int64_t> selection_blocks;

  size_t StageIndex(int step, int layer, int mb) const {
    return (static_cast<size_t>(step) * layers + layer) * micro_batches + mb;
  }
};

// Attention instance `instance`'s results for a run of `shape` (its own
// span of steps under --resize: RunShape::ForAttention) over `config`: the
// header, and step_end_ns, attention, traces and selection_blocks sized and
// zeroed; tokens, logits and layer_hidden empty (attention_results.cc).
AttentionResults SizedResults(int instance, const RunShape& shape, const ModelConfig& config);

// What the launcher expects of instance `instance`'s results file; every
// header field and vector length is checked against it before any element is
// read, so a short, stale or foreign file is a clear error, not an
// out-of-bounds read.
struct ExpectedResults {
  int instance = 0;
  const RunShape* shape = nullptr;
  int layers = 0;
  int64_t hidden = 0;
  int64_t vocab = 0;
  bool layers_dumped = false;  // --dump-layers was passed
};

absl::Status WriteResults(const std::string& path, const AttentionResults& r);
absl::StatusOr<AttentionResults> ReadResults(const std::string& path,
                                             const ExpectedResults& expected);
// The checks ReadResults applies, for results from elsewhere.
absl::Status ValidateResults(const AttentionResults& r, const ExpectedResults& expected);

}  // namespace afd::example
