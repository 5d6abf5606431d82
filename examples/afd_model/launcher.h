// afd_launch's run (afd_launch_main.cc): the scheduler, the attention and
// FFN children, the wait under a deadline (with the kill test, --resize
// joiners and --autoscale steps), then the failure checks or the report and
// Gate A. launcher.cc starts and waits; launcher_checks.cc checks and
// reports.

#ifndef STEPMESH_EXAMPLES_AFD_MODEL_LAUNCHER_H_
#define STEPMESH_EXAMPLES_AFD_MODEL_LAUNCHER_H_

#include <signal.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/autoscale_launch.h"
#include "examples/afd_model/example_model.h"
#include "examples/afd_model/launch_child.h"
#include "examples/afd_model/launch_flags.h"
#include "examples/afd_model/resize_launch.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {

// Prints "reference check: FAIL (line)" and returns 1.
int ReferenceCheckFail(absl::string_view line);

class Launcher {
 public:
  // `interrupted`: set by the launcher's SIGINT/SIGTERM handler; the run
  // then kills every child and fails.
  Launcher(LaunchFlags flags, ExampleModel model, std::optional<stepmesh::planner::Plan> emulation,
           const volatile sig_atomic_t* interrupted)
      : f_(std::move(flags)),
        model_(std::move(model)),
        config_(model_.config),
        emulation_(std::move(emulation)),
        interrupted_(interrupted),
        joins_(f_.shape.Schedule()) {
    if (f_.autoscale_plan)
      autoscale_ = std::make_unique<AutoscaleLoop>(*f_.autoscale_plan, f_.shape);
  }
  int Run();

 private:
  absl::Status StartScheduler();
  absl::Status StartChildren();
  absl::Status StartFfn(int p);
  absl::Status StartAttention(int a);
  // --resize: starts the joiners of the changes the run approaches.
  absl::Status StartJoiners();
  // --autoscale: one step of the decision loop; a change decided now
  // reaches the join plan.
  absl::Status StepAutoscale(absl::Time now);
  // --autoscale: a child's pipes (null without), its flags appended.
  absl::StatusOr<std::unique_ptr<ChildPipes>> PipesFor(bool reports,
                                                       std::vector<std::string>* argv) const {
    if (autoscale_ == nullptr) return std::unique_ptr<ChildPipes>();
    return AutoscaleLoop::PipesFor(reports, argv);
  }
  std::string ResizeLogPath(int a) const {
    return absl::StrCat(f_.work_dir, "/attention-", a, ".resize");
  }
  std::string EpochLogPath() const { return absl::StrCat(f_.work_dir, "/attention-0.epochs"); }
  // --metrics-port / --metrics-file for the child of `role` and `rank`.
  void AppendMetricsFlags(stepmesh::Role role, int rank, int port_offset,
                          std::vector<std::string>* argv) const;
  // Waits for every child: true when all exited 0. Applies the kill test
  // (launcher.cc).
  bool WaitChildren(absl::Time deadline, std::string* why);
  // The checks and the report after the run (launcher_checks.cc).
  int CheckExpectedFailure();
  // --inject-wrong-layer: every FFN refuses the frame, naming the layer it
  // expected, and every attention instance fails on its own.
  int CheckWrongLayerRefused();
  // --lost-attention: the instance the caller's network fault cuts off.
  bool IsLostAttention(const Child& c) const {
    return f_.lost_attention >= 0 && &c == attention_[f_.lost_attention].get();
  }
  std::string ProgressPath(int a) const {
    return absl::StrCat(f_.work_dir, "/attention-", a, ".progress");
  }
  // "afd_launch: 20 s: attention 0 at step 3/17 layer 2/6 ..." every
  // --progress-s seconds, so a long run is visibly alive.
  void PrintProgress(absl::Time now);

  // This process's environment with the mesh's secret set, for every child.
  std::vector<std::string> ChildEnvironment() const;
  // --chrome-trace: each child's own trace file, and the merged run.
  std::string TracePath(stepmesh::Role role, int rank) const;
  void AppendTraceFlag(stepmesh::Role role, int rank, std::vector<std::string>* argv) const;
  absl::Status WriteMergedTrace(const std::vector<AttentionResults>& results) const;

  LaunchFlags f_;
  std::string auth_token_;
  const ExampleModel model_;   // the model the run uses (--model / --config)
  const ModelConfig& config_;  // model_.config
  // --emulate-compute: the plan, for the emulated throughput line.
  const std::optional<stepmesh::planner::Plan> emulation_;
  const volatile sig_atomic_t* const interrupted_;
  std::unique_ptr<stepmesh::Scheduler> scheduler_;
  std::unique_ptr<Child> scheduler_process_;
  std::string scheduler_address_;
  std::vector<std::unique_ptr<Child>> attention_;
  std::vector<std::unique_ptr<Child>> ffn_;
  absl::Time started_;
  absl::Time next_progress_ = absl::InfiniteFuture();
  absl::Time ffn_killed_at_;
  std::optional<absl::Time> decode_started_;  // every attention instance past the barrier
  JoinPlanner joins_;  // --resize: who starts when (the ranks of attention_, ffn_ in order)
  std::unique_ptr<AutoscaleLoop> autoscale_;  // --autoscale
};

}  // namespace afd::example

#endif  // STEPMESH_EXAMPLES_AFD_MODEL_LAUNCHER_H_
