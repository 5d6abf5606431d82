#pragma once
// Reading the Prometheus text exposition format (0.0.4) that
// stepmesh::PrometheusText and the AFD example's workload series write
// (docs/metrics.md), for stepmesh_plan --watch. Samples only: HELP and TYPE
// lines are skipped; errors name the line.

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace stepmesh::planner {

struct PromSample {
  std::string name;
  std::vector<std::pair<std::string, std::string>> labels;  // in the text's order
  double value = 0;
  // The value of label `key`; nullptr when the sample has none.
  const std::string* Label(absl::string_view key) const;
};

absl::StatusOr<std::vector<PromSample>> ParsePrometheusText(absl::string_view text);

}  // namespace stepmesh::planner
