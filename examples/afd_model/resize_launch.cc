#include "examples/afd_model/resize_launch.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "examples/afd_model/elastic_sync.h"

namespace afd::example {

JoinPlanner::JoinPlanner(ResizeSchedule schedule) : schedule_(std::move(schedule)) {}

std::vector<JoinPlanner::Joiner> JoinPlanner::Due(int furthest_step, bool decoding) {
  std::vector<Joiner> due;
  while (decoding && next_ < schedule_.changes().size() &&
         furthest_step >= schedule_.changes()[next_].step - 2) {
    const ShapeChange& c = schedule_.changes()[next_++];
    for (int a = c.from.attention; a < c.to.attention; ++a) due.push_back({true, a, c.step});
    for (int p = c.from.ffn; p < c.to.ffn; ++p) due.push_back({false, p, c.step});
  }
  return due;
}

absl::StatusOr<std::string> FormatResizeLines(const ResizeSchedule& schedule,
                                              const std::string& epoch_log,
                                              const std::vector<std::string>& resize_logs) {
  const std::vector<EpochRecord> epochs = ReadEpochLog(epoch_log);
  std::vector<ResizeRecord> crossings;
  for (const std::string& path : resize_logs) {
    for (const ResizeRecord& r : ReadResizeLog(path)) crossings.push_back(r);
  }
  std::string out;
  uint64_t after_epoch = 0;
  for (const ShapeChange& c : schedule.changes()) {
    const EpochRecord* epoch = nullptr;
    for (const EpochRecord& e : epochs) {
      if (e.epoch > after_epoch && e.workers == c.to.attention && e.servers == c.to.ffn) {
        epoch = &e;
        break;
      }
    }
    uint64_t took = 0;
    bool timed = false;
    for (const ResizeRecord& r : crossings) {
      if (r.step != c.step) continue;
      took = std::max(took, r.took_ns);
      timed = true;
    }
    if (epoch == nullptr || !timed) {
      return absl::NotFoundError(absl::StrCat(
          "resize at step ", c.step, " (", c.from.Name(), " -> ", c.to.Name(), "): ",
          epoch == nullptr ? absl::StrCat("no membership epoch of ", c.to.Name(), " in ", epoch_log)
                           : "no attention instance recorded crossing it"));
    }
    after_epoch = epoch->epoch;
    absl::StrAppend(
        &out,
        FormatResizeLine(c, static_cast<int64_t>(epoch->epoch), static_cast<double>(took) * 1e-6),
        "\n");
  }
  return out;
}

}  // namespace afd::example
