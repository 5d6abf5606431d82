#pragma once

// afd_launch's side of --resize (docs/elastic.md, "The example resizes"):
// which processes start with the run, when the joiners of each change are
// started, and the report's line per change.

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "examples/afd_model/resize_plan.h"

namespace afd::example {

class JoinPlanner {
 public:
  explicit JoinPlanner(ResizeSchedule schedule);

  struct Joiner {
    bool attention = false;  // else an FFN instance
    int rank = 0;
    int step = 0;  // the change it joins at
  };
  // The ranks that start with the run: [0, start().attention), [0, start().ffn).
  MeshShape start() const { return schedule_.start(); }
  // The joiners due now, in rank order: those of every change at step S
  // once an attention member reached step S - 2 (so the joiner starts while
  // the run decodes and has its weights by step S). `decoding`: every start
  // member passed the start barrier (a joiner must not join before it).
  std::vector<Joiner> Due(int furthest_step, bool decoding);
  bool pending() const { return next_ < schedule_.changes().size(); }
  // --autoscale: the schedule with a change appended while the run decodes
  // (the changes already due stay done).
  void Amend(ResizeSchedule amended) { schedule_ = std::move(amended); }

 private:
  ResizeSchedule schedule_;
  size_t next_ = 0;  // the first change whose joiners were not started
};

// The report's line per change (FormatResizeLine): its epoch E is the first
// membership epoch attention 0 heard (`epoch_log`) with the new shape's
// counts, its time T the longest any attention instance spent crossing it
// (`resize_logs`: from reaching the change to leaving its last barrier;
// elastic_sync.h). Fails naming the change when no epoch or no time was
// recorded for it.
absl::StatusOr<std::string> FormatResizeLines(const ResizeSchedule& schedule,
                                              const std::string& epoch_log,
                                              const std::vector<std::string>& resize_logs);

}  // namespace afd::example
