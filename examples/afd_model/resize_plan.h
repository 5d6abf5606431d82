#pragma once

// The shape schedule of an elastic run of the example (afd_launch --resize
// STEP:xAyF, docs/elastic.md "The example resizes"). Every process of the
// run gets the same schedule as a run flag, so each knows, for every global
// step, which attention instances and how many FFN partitions exist:
//
//  - the run has RunShape::steps() global steps (step 0 the prefill of the
//    start shape's requests); "STEP:xAyF" means steps STEP.. run as xAyF;
//  - attention instances are numbered by rank: a grow to xA adds ranks
//    [old x, x), each of which joins at that step and takes the R
//    (--requests) requests that arrive then (their prefill is its first
//    step); a shrink removes the highest ranks, whose requests end at the
//    step before (the request stream gives a leaving instance only the
//    decode steps it stays: it finishes them, then leaves);
//  - FFN rank p serves partition p of F(step) (experts e % F == p, a 1/F
//    column slice of the dense FFN and the shared expert): the expert
//    layout schedule, replayed by the reference. A grow adds ranks, a
//    shrink removes the highest; every member re-shards to the new F.
// Each rank is a member for one contiguous span of steps (a rank that left
// does not come back): the schedule is refused otherwise.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace afd::example {

struct MeshShape {
  int attention = 1;
  int ffn = 1;
  bool operator==(const MeshShape&) const = default;
  std::string Name() const;  // "3A2F"
};

// "3A2F" (also "3a2f").
absl::StatusOr<MeshShape> ParseMeshShape(absl::string_view text);

struct ShapeChange {
  int step = 0;  // the first step run in `to`
  MeshShape from;
  MeshShape to;
};

// Steps [begin, end) during which a rank is a member.
struct MemberSpan {
  int begin = 0;
  int end = 0;
  int steps() const { return end - begin; }
  bool Contains(int step) const { return step >= begin && step < end; }
};

class ResizeSchedule {
 public:
  // A run that never changes shape.
  ResizeSchedule(MeshShape start, int steps);

  // `specs`: "STEP:xAyF" each, steps strictly increasing in [1, steps), each
  // a real change. Errors name the spec.
  static absl::StatusOr<ResizeSchedule> Parse(MeshShape start, int steps,
                                              const std::vector<std::string>& specs);

  bool empty() const { return changes_.empty(); }
  int steps() const { return steps_; }
  MeshShape start() const { return start_; }
  const std::vector<ShapeChange>& changes() const { return changes_; }
  // The shape steps `step`.. run in (until the next change).
  MeshShape At(int step) const;
  // The most instances of each side at any step: the mesh's capacity
  // (max_workers, max_servers) and the size of every registered region.
  MeshShape Capacity() const;
  // The ranks ever used: [0, Capacity().attention) and [0, Capacity().ffn).
  MemberSpan AttentionSpan(int rank) const;
  MemberSpan FfnSpan(int rank) const;
  // "6:3A2F" per change, to pass the schedule down (AppendRunFlags).
  std::vector<std::string> Specs() const;
  // afd_launch --autoscale: a change decided while the run decodes, after
  // every change already in the schedule; the same checks as Parse (errors
  // name the change). Nothing changes on error.
  absl::Status Append(int step, MeshShape to);

 private:
  MeshShape start_;
  int steps_ = 1;
  std::vector<ShapeChange> changes_;
};

// The report's line for one change, exactly:
// "resize at step S: xAyF -> x'Ay'F (epoch E, T ms)".
std::string FormatResizeLine(const ShapeChange& change, int64_t epoch, double ms);

}  // namespace afd::example
