#pragma once

// afd_launch's side of --autoscale (docs/elastic.md, "Autoscale";
// autoscale_channel.h has the protocol): the pipes each child inherits, and
// the loop that reads the attention instances' workload reports, decides
// through the plan's AutoscaleController and tells every member.

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/autoscale_channel.h"
#include "src/tools/planner/autoscale.h"

namespace afd::example {

// Where a child finds its pipe ends (--control-fd, --report-fd).
inline constexpr int kChildControlFd = 3;
inline constexpr int kChildReportFd = 4;

// One child's --autoscale pipes, the launcher's ends: it writes decisions
// to `control` and reads an attention instance's reports from `reports`.
struct ChildPipes {
  int control = -1;
  int child_control = -1;  // the child's ends, closed here once it started
  int child_report = -1;
  std::unique_ptr<LineReader> reports;
  ~ChildPipes() {
    for (int fd : {control, child_control, child_report}) {
      if (fd >= 0) ::close(fd);
    }
    if (reports) ::close(reports->fd());
  }
};

class AutoscaleLoop {
 public:
  // `run`: the launcher's run shape (start shape, --decision-every).
  AutoscaleLoop(stepmesh::planner::AutoscalePlan plan, const RunShape& run);

  // A child's pipes; `reports`: an attention instance's report pipe too.
  // Appends the child's --control-fd / --report-fd flags.
  static absl::StatusOr<std::unique_ptr<ChildPipes>> PipesFor(bool reports,
                                                              std::vector<std::string>* argv);
  // The child of the next rank started with `pipes`: its ends are closed
  // here (only the child holds them now, so its exit closes them).
  void AddAttention(std::unique_ptr<ChildPipes> pipes);
  void AddFfn(std::unique_ptr<ChildPipes> pipes);

  // Reads every report available; once every attention member at c - 1 and
  // c has reported checkpoint c, observes, decides and writes c's decision
  // to every member at c. A change is appended to run->resize (the joiners
  // are started with it); returns true then. `log`: the checkpoint's line,
  // when one was decided. Errors name the process or the checkpoint: a
  // report missing a mesh timeout after the first of its checkpoint, a
  // malformed or out-of-turn report, a decision that cannot be written.
  absl::StatusOr<bool> Step(absl::Time now, RunShape* run, std::string* log);

  int decisions() const { return decisions_; }

 private:
  static int NextCheckpoint(const RunShape& run, int from) {
    while (from < run.steps() && !IsCheckpoint(run, from)) ++from;
    return from;
  }
  // Writes checkpoint c's decision to every process that is a member at c.
  absl::Status Tell(const Decision& d, const ResizeSchedule& schedule);

  const stepmesh::planner::AutoscalePlan plan_;
  stepmesh::planner::AutoscaleController controller_;
  std::vector<std::unique_ptr<ChildPipes>> attention_pipes_, ffn_pipes_;  // by rank
  int checkpoint_ = 0;                                                    // the one being decided
  int pending_change_ = -1;                // a decided change's step, until it is observed
  std::map<int, WorkloadReport> reports_;  // by attention rank, for checkpoint_
  std::optional<absl::Time> first_report_;
  int decisions_ = 0;
};

}  // namespace afd::example
