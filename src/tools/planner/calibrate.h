#pragma once
// Calibration: the six coefficients fitted by least squares from what the
// repository's own tools measure.
//
//   stepmesh_perf --json        one row per message size: push and pull bytes
//                               per server and the round trip's latency
//                               -> round trip = a * bytes + b
//   afd_launch --chrome-trace   one event per attention stage (args: step,
//                               rows, kv_tokens) and per FFN batch (args:
//                               rows) -> t_A(kv_tokens), t_F(rows)
//
// The round trip is split into the two directions by their bytes (the F2A
// direction carries BF16, twice the FP8 of A2F): with N = rows x FFN
// instances, t_C(N) = a*N*f2a + b/2 and A2F = a*N*a2f + b/2.

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "src/tools/planner/fit.h"
#include "src/tools/planner/json.h"
#include "src/tools/planner/plan.h"

namespace stepmesh::planner {

struct Samples {
  std::vector<double> x, y;
  std::vector<std::string> sources;  // files they came from
};

struct CalibrationSamples {
  Samples round_trip;  // x: bytes per round trip (push + pull, all servers), y: us
  Samples attention;   // x: KV tokens of the micro-batch, y: us
  Samples ffn;         // x: rows of the batch, y: us
};

// stepmesh_perf --json: the "stepmesh" method's latency statistic `stat`
// ("p50_us" or "mean_us") of every size.
absl::Status AddPerfSamples(const Json& doc, const std::string& source, const std::string& stat,
                            CalibrationSamples* out);

// afd_launch --chrome-trace: decode-step attention stages (step >= 1) and
// every FFN batch. An FFN batch that waited behind the previous one on the
// same FFN instance is counted from the previous one's end, so the sample
// is the batch's own compute, not its queueing.
absl::Status AddTraceSamples(const Json& doc, const std::string& source, CalibrationSamples* out);

struct Calibration {
  std::optional<LinearFit> round_trip, attention, ffn;
};

// Fits what has samples (at least two distinct x each), leaving out gross
// outliers (FitLineRobust).
absl::StatusOr<Calibration> Fit(const CalibrationSamples& samples);

// Writes the fitted coefficients into the plan (the comm fit needs the
// plan's bytes per row: model.hidden or wire.*_bytes_per_row).
absl::Status ApplyCalibration(const Calibration& cal, Plan* plan);

}  // namespace stepmesh::planner
