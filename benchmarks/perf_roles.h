#pragma once
// The participants of stepmesh_perf: a server answering the lock-stepped plan
// (and serving the baselines), and a worker measuring it. The launcher
// (stepmesh_perf.cc) runs them as processes or threads, or a role alone.

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "benchmarks/perf_flags.h"
#include "benchmarks/perf_report.h"

namespace stepmesh::bench {

// Server f.rank until every worker is done with the plan.
absl::Status RunServerRole(const Flags& f);

// Worker f.rank through the plan; worker 0's results per size (the other
// workers' are discarded).
absl::StatusOr<std::vector<SizeResult>> RunWorkerRole(const Flags& f);

}  // namespace stepmesh::bench
