// afd_launch's command line (afd_launch_main.cc): the flags, the help text,
// and the checks that run before any process starts.

#ifndef STEPMESH_EXAMPLES_AFD_MODEL_LAUNCH_FLAGS_H_
#define STEPMESH_EXAMPLES_AFD_MODEL_LAUNCH_FLAGS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/example_model.h"
#include "examples/afd_model/placement.h"
#include "src/tools/planner/autoscale.h"
#include "src/tools/planner/plan.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {

struct LaunchFlags {
  RunShape shape;
  int64_t deadline_s = 300;
  int64_t progress_s = 10;
  std::string chrome_trace;
  std::string work_dir;
  std::string scheduler_binary;
  bool reference = true;
  bool layer_check = true;
  int64_t kill_ffn_after_ms = -1;
  int kill_ffn = -1;
  bool expect_failure = false;
  std::string inject_wrong_layer;  // "STEP:LAYER" for attention 0's header
  int64_t metrics_port = 0;        // attention a serves on it + a, FFN p on it + X + p
  std::string metrics_file;        // each process writes PREFIX.worker<a> / PREFIX.server<p>
  Placement placement;             // --hosts: one emulated host per instance
  int lost_attention = -1;         // --lost-attention: cut off by the caller's network fault
  // --autoscale AS.json: the launcher decides the resizes (docs/elastic.md).
  std::string autoscale;
  std::optional<stepmesh::planner::AutoscalePlan> autoscale_plan;
};

// What the command line asks for: --help, or a run.
struct LaunchRequest {
  bool help = false;
  // --keep-work-dir or --work-dir: the work directory stays after success.
  bool keep_work_dir = false;
  LaunchFlags flags;
};

// Parses and cross-checks the flags (no file or process is touched except
// --autoscale's file and --hosts' namespaces). An error is an argument error
// (UsageError).
absl::StatusOr<LaunchRequest> ParseLaunchFlags(int argc, char** argv);

// Everything that can be checked before a process starts: the config, the
// run against the model, memory, the backend and transport, the programs.
// Fills `model` and (--emulate-compute) `emulation`.
absl::Status Preflight(const LaunchFlags& f, ExampleModel* model,
                       std::optional<stepmesh::planner::Plan>* emulation);

// --help's text, after the usage line.
void PrintHelp();

// An argument error: the message, the usage line, exit 2. Never a
// "reference check" line: nothing ran, so nothing was checked.
int UsageError(absl::string_view message);

}  // namespace afd::example

#endif  // STEPMESH_EXAMPLES_AFD_MODEL_LAUNCH_FLAGS_H_
