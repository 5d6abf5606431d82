#pragma once
// stepmesh_plan --watch (docs/planning.md, "--watch and autoscale"): scrape
// a running mesh's metrics endpoints, turn them into the shape it runs and
// the workload it serves, and feed an AutoscaleController; one line per
// observation, and a recommendation line when the best integer ratio
// changes.

#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/tools/planner/autoscale.h"
#include "src/tools/planner/http_get.h"

namespace stepmesh::planner {

// One scrape of every endpoint, summarised.
struct MeshSample {
  // The shape: endpoints of each role, or (when more) the peers of that role
  // that the other role's endpoints count as present (losses not outnumbering
  // rejoins).
  int attention = 0;
  int ffn = 0;
  ObservedWorkload workload;  // over every attention endpoint
  double requests = 0;        // afd_workload_requests, summed
  double decode_tokens = 0;   // afd_workload_decode_tokens_total, summed
};

// `scraped`: (URL, Prometheus text) of each endpoint. Needs at least one
// attention endpoint serving the afd_workload_* series (the AFD example's
// attention processes, examples/afd_model/workload_metrics.h); errors name
// the URL.
absl::StatusOr<MeshSample> SummariseScrape(
    const std::vector<std::pair<std::string, std::string>>& scraped);

struct WatchOptions {
  std::vector<HttpUrl> urls;
  absl::Duration interval = absl::Seconds(1);
  int count = 0;                                   // observations to make (0: no limit)
  absl::Duration duration = absl::ZeroDuration();  // stop after this (zero: no limit)
  absl::Duration scrape_timeout = absl::Seconds(2);
  // The running shape when the metrics cannot tell it (e.g. only attention
  // endpoints given and the FFN count wanted from elsewhere); else from them.
  std::optional<std::pair<int, int>> shape;
  // Stop at the first failed scrape after a successful observation (the mesh
  // finished or went away) instead of retrying until the bound.
  bool until_gone = false;
};

struct WatchSummary {
  int observations = 0;  // successful
  int failures = 0;      // scrapes that failed (printed to `err`)
  int changes = 0;       // recommendation lines printed
};

// Needs count > 0 or a positive duration (the watch is bounded). Returns an
// error when no observation succeeded.
absl::StatusOr<WatchSummary> RunWatch(const AutoscalePlan& plan, const WatchOptions& options,
                                      std::FILE* out, std::FILE* err);

}  // namespace stepmesh::planner
