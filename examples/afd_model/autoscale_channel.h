#pragma once

// The launcher <-> process channel of afd_launch --autoscale (docs/elastic.md,
// "Autoscale"). Every process of the run inherits two pipe ends: it reads
// the launcher's decisions from one (--control-fd) and an attention instance
// writes its observed workload to the other (--report-fd).
//
// At every decision checkpoint c (a global step, IsCheckpoint):
//   1. each attention instance that was a member at c - 1 writes
//        "checkpoint c requests R context T micro_batches M"
//      (R virtual decode slots over its micro-batches at step c - 1, T the
//      KV tokens they attended over, summed: what its engine ran);
//   2. the launcher, once every such report is in, makes one observation of
//      the mesh, asks its AutoscaleController, and writes to every process
//      that is a member at c one line:
//        "checkpoint c: no change"  or  "checkpoint c: resize at S: xAyF"
//      with S = c + kDecisionLead, beyond every member's current step;
//   3. each member reads that line before it runs step c (an FFN instance:
//      before it serves a batch of step c), under the mesh timeout, and
//      appends the change to its schedule. A process that gets no line in
//      time fails, naming itself and the checkpoint.
// So every member knows a change at S while it is at step c <= S - 2, and
// the launcher starts the joiners at once (their flags carry the amended
// schedule): the --resize machinery (elastic_sync.h) then crosses S.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/resize_plan.h"

namespace afd::example {

// A change decided at checkpoint c takes effect at step c + kDecisionLead.
inline constexpr int kDecisionLead = 2;

// --decision-every K: c > 0, c % K == 0, and a change decided there still
// falls inside the run.
bool IsCheckpoint(const RunShape& run, int step);

struct WorkloadReport {
  int checkpoint = 0;
  int64_t requests = 0;        // virtual decode slots, all micro-batches
  int64_t context_tokens = 0;  // KV tokens they attended over, summed
  int micro_batches = 0;
};
std::string FormatWorkloadReport(const WorkloadReport& r);  // one line, with '\n'
absl::StatusOr<WorkloadReport> ParseWorkloadReport(absl::string_view line);

struct Decision {
  int checkpoint = 0;
  bool resize = false;
  int step = 0;  // with resize: the first step run in `to`
  MeshShape to;
};
std::string FormatDecision(const Decision& d);  // one line, with '\n'
absl::StatusOr<Decision> ParseDecision(absl::string_view line);

// Applies `d`, received at checkpoint `step`, to `schedule`: false for "no
// change", true for a resize appended. A resize must grow the attention side
// only (UNIMPLEMENTED otherwise). `who` ("attention 0", "ffn 1") leads every
// error.
absl::StatusOr<bool> ApplyDecision(const Decision& d, absl::string_view who, int step,
                                   ResizeSchedule* schedule);

// Whole lines from a pipe end (non-blocking reads).
class LineReader {
 public:
  explicit LineReader(int fd) : fd_(fd) {}
  // Appends every complete line available now; `closed` once the writer is
  // gone and every line was returned.
  absl::Status ReadAvailable(std::vector<std::string>* lines);
  // Waits until one line arrives (deadline `timeout`).
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout);
  bool closed() const { return closed_; }
  int fd() const { return fd_; }

 private:
  bool TakeLine(std::string* line);
  int fd_;
  std::string buffer_;
  bool closed_ = false;
};

// The process side: owns both inherited fds.
class ControlChannel {
 public:
  // `who`: "attention 2" / "ffn 0", for the errors. report_fd may be -1
  // (an FFN instance reports nothing).
  ControlChannel(std::string who, int control_fd, int report_fd);
  ~ControlChannel();
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;

  absl::Status Report(const WorkloadReport& r);
  // The decision of checkpoint `checkpoint`; an error naming `who` and the
  // checkpoint when none arrives within `timeout`, the launcher is gone, or
  // the line is another checkpoint's.
  absl::StatusOr<Decision> Await(int checkpoint, absl::Duration timeout);

 private:
  const std::string who_;
  LineReader in_;
  int out_;
};

}  // namespace afd::example
