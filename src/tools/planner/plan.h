#pragma once
// What the A/F-ratio planner reasons about (docs/planning.md): the linear
// latency model of one layer and one micro-batch, the decode workload, the
// bytes each token puts on the wire, and the JSON file that carries them
// (stepmesh_plan's input, and afd_launch --emulate-compute's).
//
// The model is the one of "Theoretically Optimal Attention/FFN Ratios in
// Disaggregated LLM Serving" (arXiv 2601.21351, the seed
// shared/seeds/002_*.txt): for an rA-1F bundle whose attention instances each
// hold B decode slots per micro-batch,
//   t_A = alpha_A * T + beta_A   T: KV tokens the micro-batch attends over
//   t_C = alpha_C * B + beta_C   one micro-batch's transfer
//   t_F = alpha_F * r*B + beta_F the FFN's batch of r micro-batches
// Every time is in microseconds.

#include <string>

#include "absl/status/statusor.h"
#include "src/tools/planner/json.h"

namespace stepmesh::planner {

// t = alpha * x + beta (microseconds).
struct Linear {
  double alpha = 0.0;
  double beta = 0.0;
  double At(double x) const { return alpha * x + beta; }
};

struct Coefficients {
  // x = KV tokens of one micro-batch of one attention instance (effective
  // tokens when the attention is sparse, see ContextModel).
  Linear attention;
  // x = rows of one micro-batch of one attention instance times the FFN
  // instances it exchanges them with (each gets every row and returns a
  // partial for each); the slower direction of the exchange (F2A: BF16 back
  // is twice the FP8 out). The seed's t_C: one pipeline stage.
  Linear comm;
  // x = rows of one FFN batch (that micro-batch of every attention instance
  // the FFN serves); the whole FFN. y FFN instances that split the FFN (the
  // example: expert e on instance e % y) take (alpha*x + beta)/y each.
  Linear ffn;
  // The other direction (A2F) as a fraction of t_C, for the simulator, which
  // gives each attention instance an outgoing and an incoming channel.
  double a2f_fraction = 0.5;
};

enum class PrefillDistribution { kFixed, kUniform, kExponential };
const char* PrefillDistributionName(PrefillDistribution d);

// Attention work of one request as a function of its context length c, in
// "effective tokens". Dense attention reads the whole cache: g(c) = c.
// Sparse attention in the Step-5 style (docs/planning.md): a fraction
// `global_fraction` of the layers select at most `budget` tokens plus an
// indexer pass over c*index_ratio token-equivalents; the other layers see a
// sliding window; averaged over layers:
//   g(c) = gf*(min(c, budget) + c*index_ratio) + (1-gf)*min(c, window)
struct ContextModel {
  bool sparse = false;
  double window = 512;
  double budget = 4104;
  double global_fraction = 0.25;
  double index_ratio = 32.0 / 3072.0;
  double EffectiveTokens(double context) const;
};

struct Workload {
  double mu_p = 0;  // mean prefill (prompt) length
  double mu_d = 0;  // mean decode length: a request's cache grows by a geometric number of tokens
  PrefillDistribution prefill = PrefillDistribution::kExponential;
  int batch = 1;          // B: decode slots per micro-batch per attention instance
  int micro_batches = 0;  // m in flight per attention instance; 0: enough to fill the pipeline
  int layers = 1;         // L: converts a layer's cycle into tokens/s
  int ffn_instances = 1;  // y: instances the FFN is split over
  double tpot_ms = 0;     // a TPOT target (the Step-3 paper's 50 ms); 0: none
  ContextModel context;

  // Probability that a request ends after a decode step: the seed's
  // geometric D with E[D] = (1-p)/p = mu_d.
  double EndProbability() const { return 1.0 / (1.0 + mu_d); }
};

// t_C of one micro-batch: comm evaluated at B * y rows.
double CommTime(const Coefficients& c, const Workload& w);

// Bytes one token row puts on the wire, for the communication bound.
struct WireModel {
  double a2f_bytes_per_row = 0;  // to each FFN instance
  double f2a_bytes_per_row = 0;  // from each FFN instance
  double ffn_link_gbps = 0;      // one FFN instance's scale-out bandwidth; 0: not modelled
};

// What an instance is made of, for throughput per GPU (the seed's optimum
// counts instances; with unequal instances the best ratio per GPU can
// differ, and the report gives both).
struct Hardware {
  int gpus_per_attention_instance = 1;
  int gpus_per_ffn_instance = 1;
};

// Settings only afd_launch --emulate-compute reads.
struct EmulationSettings {
  double time_scale = 1.0;  // every emulated compute time is multiplied by this
  uint64_t seed = 1;
};

struct Plan {
  std::string name;
  bool has_coefficients = false;  // false: they must come from calibration
  Coefficients coefficients;
  Workload workload;
  WireModel wire;
  Hardware hardware;
  EmulationSettings emulation;
  // For bytes per row when "wire" gives none: hidden size, top-k, FP8 group.
  int hidden = 0;
  int top_k = 0;
  int fp8_group = 128;
};

// Reads a plan file. Every key is checked: an unknown key or a value of the
// wrong type or range is an error naming it (e.g. "workload.batch").
absl::StatusOr<Plan> ParsePlan(const Json& doc);
absl::StatusOr<Plan> LoadPlan(const std::string& path);
absl::Status ValidatePlan(const Plan& plan);

// The plan as a plan file (stepmesh_plan --write-plan: calibrated
// coefficients for afd_launch --emulate-compute or a later run).
std::string PlanToJson(const Plan& plan);

absl::StatusOr<std::string> ReadTextFile(const std::string& path);

}  // namespace stepmesh::planner
