// afd_launch: runs a disaggregated decode of the example model (Step-3 or
// Step-5-Preview, --model) on this host and checks it.
//
//   afd_launch --attention X --ffn Y [--requests R] [--prompt-len 32]
//              [--decode-steps 16] [--micro-batches 3] [--model tiny]
//              [--transport tcp|rdma|libfabric] [--backend cpu_mock|cuda]
//              [--poll-mode adaptive|spin|blocking] [--timeout-ms 30000]
//              [--deadline-s 300] [--chrome-trace FILE] [--work-dir DIR]
//              [--scheduler-binary PATH] [--no-reference] [--no-layer-check]
//              [--kill-ffn-after-ms N [--kill-ffn P] --expect-failure]
//              [--emulate-compute PLAN.json]
//              [--metrics-port P] [--metrics-file PREFIX]
//              [--hosts NS,... --host-addrs A,...] [--lost-attention A]
//              [--resize STEP:xAyF ...]
//              [--autoscale AS.json [--autoscale-every K] --context-growth FROM:TO]
//
// Starts the stepmesh scheduler (in this process on a free 127.0.0.1 port,
// or the stepmesh_scheduler program), X afd_attention and Y afd_ffn
// processes from this program's directory, waits for them under a deadline,
// prints the report and runs Gate A against the monolithic AFD-emulation
// reference. The last line is "reference check: PASS (...)" or
// "reference check: FAIL (...)" and the exit status follows it; any process
// failing fails the run. Children are killed by PID on every failure path and
// get PR_SET_PDEATHSIG, so none outlives the launcher.
//
// --kill-ffn-after-ms N kills FFN P (default the last) N ms after the start;
// with --expect-failure the run passes when every attention instance exits
// with an error naming that server within the mesh timeout ("failure check:
// PASS (...)").
//
// --emulate-compute PLAN.json selects the emulated engine (afd_engine.h):
// sleeps from the planner's latency model (emulated_compute.h) instead of the
// model's kernels; the bytes still move. The reference check is skipped; an
// "emulated compute:" line gives the decode throughput in the plan's virtual
// tokens.
//
// --hosts places every instance on its own emulated host (a network
// namespace; placement.h, scripts/cluster.sh).
//
// --resize STEP:xAyF (repeatable) changes the shape while decoding
// (resize_plan.h, elastic_sync.h, docs/elastic.md): the launcher starts the
// joiners of a change as the run approaches it, and the report gets one
// "resize at step S: xAyF -> x'Ay'F (epoch E, T ms)" line per change.
//
// --autoscale AS.json (with --emulate-compute) decides those changes while
// the run decodes, from the workload the attention processes report at its
// checkpoints, and tells every process over an inherited pipe
// (autoscale_channel.h); the report compares each shape's measured
// throughput per instance with the planner's (autoscale_report.h).
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "examples/afd_model/example_model.h"
#include "examples/afd_model/launch_child.h"
#include "examples/afd_model/launch_flags.h"
#include "examples/afd_model/launcher.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {
namespace {

volatile sig_atomic_t g_interrupted = 0;
void OnSignal(int) { g_interrupted = 1; }

int Main(int argc, char** argv) {
  absl::StatusOr<LaunchRequest> request = ParseLaunchFlags(argc, argv);
  if (!request.ok()) return UsageError(request.status().message());
  if (request->help) {
    PrintHelp();
    return 0;
  }
  LaunchFlags f = std::move(request->flags);
  const bool keep_work_dir = request->keep_work_dir;
  ExampleModel model;
  std::optional<stepmesh::planner::Plan> emulation;
  if (absl::Status s = Preflight(f, &model, &emulation); !s.ok()) return UsageError(s.message());
  if (f.kill_ffn < 0) f.kill_ffn = f.shape.ffn - 1;

  if (f.work_dir.empty()) {
    char tmpl[] = "/tmp/afd_launch.XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return ReferenceCheckFail("mkdtemp failed");
    f.work_dir = tmpl;
  } else if (::mkdir(f.work_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return UsageError(absl::StrCat("--work-dir ", f.work_dir, ": ", std::strerror(errno)));
  }
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  // --autoscale: a child that died closes its pipe; the write fails (EPIPE)
  // instead of killing the launcher.
  ::signal(SIGPIPE, SIG_IGN);

  // Before any thread starts: the threads the scheduler creates inherit it.
  if (absl::Status s = f.placement.EnterSchedulerHost(); !s.ok())
    return ReferenceCheckFail(s.message());
  const std::string work_dir = f.work_dir;
  const int rc =
      Launcher(std::move(f), std::move(model), std::move(emulation), &g_interrupted).Run();
  if (!keep_work_dir && rc == 0) RemoveWorkDir(work_dir);
  return rc;
}
}  // namespace
}  // namespace afd::example

int main(int argc, char** argv) { return afd::example::Main(argc, argv); }
