#pragma once

// How the example's processes cross a shape change of --resize together
// (docs/elastic.md, "The example resizes"). At a change step S every
// participant that is a member at S - 1 or joins at S:
//   1. waits until the membership holds every rank of the new shape (the
//      joiners have joined: an FFN joiner has registered its regions,
//      since it joins after that);
//   2. attention instances finish step S - 1 (every reply in), FFN
//      instances serve it; then everyone meets at barrier A;
//   3. each joining attention instance posts its first requests (the
//      prefill of the requests that arrive with it, stage (S, 0, m) of
//      every micro-batch) and waits until they left its send queue; each
//      FFN instance waits until those bytes arrived from every joiner;
//   4. everyone meets at barrier B; the others then post step S.
// So a joiner's first request reaches every server before any other
// worker's request of step S: it is waited for in exactly the batches of
// steps S.. (the library waits for a joined worker only in batches opened
// after its first request), never in one of S - 1. Leavers take part in both
// barriers, then Leave (drain).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "examples/afd_model/afd_common.h"
#include "stepmesh/participant.h"

namespace afd::example {

// The change steps (> 0) participant `span` takes part in: a member at
// S - 1 or one joining at S.
std::vector<int> ChangeStepsOf(const ResizeSchedule& schedule, MemberSpan span);

// Step 1: waits (deadline `timeout`) until the membership holds attention
// ranks [0, shape.attention) and FFN ranks [0, shape.ffn); returns its epoch.
absl::StatusOr<uint64_t> WaitForShape(stepmesh::Participant& p, MeshShape shape,
                                      absl::Duration timeout);

// The payload bytes of a joining attention instance's first requests: every
// micro-batch's prefill A2F tensors and header.
uint64_t FirstRequestBytes(const RunShape& shape, const ModelConfig& config);

// One line of the membership log (attention 0 writes one per epoch it
// hears of; the launcher matches the schedule's changes to them):
//   "epoch E at NS workers W servers F" (NS: MonotonicNowNs; W, F counts).
struct EpochRecord {
  uint64_t epoch = 0;
  uint64_t at_ns = 0;
  int workers = 0;
  int servers = 0;
};
std::string FormatEpochRecord(const EpochRecord& r);
std::vector<EpochRecord> ReadEpochLog(const std::string& path);

// What an attention instance measured at a change it took part in, one
// line per change in its resize log: "resize S took NS" (from reaching the
// change, step 1, to leaving barrier B).
struct ResizeRecord {
  int step = 0;
  uint64_t took_ns = 0;
};
std::vector<ResizeRecord> ReadResizeLog(const std::string& path);

}  // namespace afd::example
