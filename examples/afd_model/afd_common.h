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
#include "stepmesh/options.h"
#include "stepmesh/trace.h"
#include "stepmesh/worker.h"

namespace afd::example {

// "--name value" pairs (and bare "--name" switches, value "true"). Every
// program parses into this and then reads typed values, so a typo in a flag
// name is reported instead of silently ignored.
class Flags {
 public:
  static absl::StatusOr<Flags> Parse(int argc, char** argv,
                                     const std::vector<std::string>& switches);
  absl::StatusOr<int64_t> Int(absl::string_view name, int64_t fallback);
  std::string Str(absl::string_view name, absl::string_view fallback);
  bool Bool(absl::string_view name);
  // Fails on any flag not read through Int/Str/Bool.
  absl::Status CheckAllUsed() const;

 private:
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> used_;
};

// What every process of a run agrees on; the launcher passes it down as flags
// (AppendRunFlags / ParseRunFlags) so the shapes and key plans line up.
struct RunShape {
  std::string config = "tiny";
  int attention = 1;      // attention instances = stepmesh workers
  int ffn = 1;            // FFN instances = stepmesh servers = partitions
  int requests = 6;       // per attention instance
  int prompt_len = 32;
  int decode_steps = 16;
  int micro_batches = 3;  // pipeline stages per attention instance
  std::string transport = "tcp";
  std::string backend = "cpu_mock";
  std::string poll_mode = "adaptive";
  absl::Duration timeout = absl::Seconds(30);
  // --emulate-compute PLAN.json: sleeps from a latency model instead of the
  // model's kernels (emulated_compute.h).
  std::string emulate_compute;

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
};

absl::StatusOr<RunShape> ParseRunFlags(Flags& flags);
void AppendRunFlags(const RunShape& shape, std::vector<std::string>* argv);

// MeshOptions of a participant from the run shape.
absl::StatusOr<stepmesh::MeshOptions> MeshOptionsFor(const RunShape& shape,
                                                     stepmesh::Role role,
                                                     int rank,
                                                     const std::string& scheduler);

// Key plan: micro-batch m pushes codes, scales, topk ids and topk weights (in
// this order; the codes key is the batch's group) and pulls one partial from
// every FFN server.
enum class A2FTensor : int { kCodes = 0, kScales = 1, kTopkIds = 2, kTopkWeights = 3 };
inline constexpr int kA2FTensors = 4;
inline stepmesh::Key PushKey(int micro_batch, A2FTensor t) {
  return 1000 + 16 * micro_batch + static_cast<int>(t);
}
inline stepmesh::Key PullKey(int micro_batch) { return 1000 + 16 * micro_batch + 8; }
// The micro-batch a group key names, or -1.
int MicroBatchOfGroup(stepmesh::Key group, int micro_batches);

// The results of one attention instance, written to a file for the launcher.
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
  uint64_t start_ns = 0;  // after the start barrier
  std::vector<uint64_t> step_end_ns;  // [step][micro-batch]: logits of the step done
  std::vector<int32_t> tokens;        // [request][step]
  std::vector<float> logits;          // [step][request][vocab]
  // [step][layer][rows of the step, request-major][hidden]: the residual
  // stream after each layer (empty when not dumped).
  std::vector<float> layer_hidden;
  std::vector<StageTiming> attention;  // [step][layer][micro-batch]
  // [step][layer][micro-batch][server]
  std::vector<stepmesh::TraceStamps> traces;

  size_t StageIndex(int step, int layer, int mb) const {
    return (static_cast<size_t>(step) * layers + layer) * micro_batches + mb;
  }
};

absl::Status WriteResults(const std::string& path, const AttentionResults& r);
absl::StatusOr<AttentionResults> ReadResults(const std::string& path);

}  // namespace afd::example
