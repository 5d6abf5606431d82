#include "examples/afd_model/resize_plan.h"

#include <algorithm>
#include <cctype>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "stepmesh/status.h"

namespace afd::example {
namespace {

// The first step at or after `from` in which `inside(step)` stops holding,
// or `steps`.
template <typename Pred>
int EndOf(int from, int steps, Pred inside) {
  int s = from;
  while (s < steps && inside(s)) ++s;
  return s;
}

}  // namespace

std::string MeshShape::Name() const { return absl::StrCat(attention, "A", ffn, "F"); }

absl::StatusOr<MeshShape> ParseMeshShape(absl::string_view text) {
  const size_t a = text.find_first_of("aA");
  const bool f_last = !text.empty() && (text.back() == 'F' || text.back() == 'f');
  MeshShape s;
  if (a == absl::string_view::npos || !f_last ||
      !absl::SimpleAtoi(text.substr(0, a), &s.attention) ||
      !absl::SimpleAtoi(text.substr(a + 1, text.size() - a - 2), &s.ffn) || s.attention < 1 ||
      s.ffn < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", text, "\" is not a shape xAyF with x, y >= 1 (e.g. 3A2F)"));
  }
  return s;
}

ResizeSchedule::ResizeSchedule(MeshShape start, int steps) : start_(start), steps_(steps) {}

absl::StatusOr<ResizeSchedule> ResizeSchedule::Parse(MeshShape start, int steps,
                                                     const std::vector<std::string>& specs) {
  ResizeSchedule schedule(start, steps);
  MeshShape current = start;
  for (const std::string& spec : specs) {
    const size_t colon = spec.find(':');
    int step = -1;
    if (colon == std::string::npos || !absl::SimpleAtoi(spec.substr(0, colon), &step)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--resize ", spec, ": want STEP:xAyF (e.g. 6:3A2F)"));
    }
    absl::StatusOr<MeshShape> to = ParseMeshShape(spec.substr(colon + 1));
    if (!to.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("--resize ", spec, ": ", to.status().message()));
    const int previous = schedule.changes_.empty() ? 0 : schedule.changes_.back().step;
    if (step <= previous || step >= steps) {
      return absl::InvalidArgumentError(
          absl::StrCat("--resize ", spec, ": step ", step, " must be after ", previous,
                       previous == 0 ? " (the prefill)" : " (the previous --resize)",
                       " and before ", steps, " (the run's steps: prefill + --decode-steps)"));
    }
    if (*to == current) {
      return absl::InvalidArgumentError(
          absl::StrCat("--resize ", spec, ": the run is already ", current.Name(), " then"));
    }
    schedule.changes_.push_back({step, current, *to});
    current = *to;
  }
  // One span per rank: a rank that left does not rejoin.
  const MeshShape cap = schedule.Capacity();
  for (int side = 0; side < 2; ++side) {
    const int ranks = side == 0 ? cap.attention : cap.ffn;
    for (int r = 0; r < ranks; ++r) {
      const MemberSpan span = side == 0 ? schedule.AttentionSpan(r) : schedule.FfnSpan(r);
      for (int s = span.end; s < steps; ++s) {
        const MeshShape at = schedule.At(s);
        if ((side == 0 ? at.attention : at.ffn) > r) {
          return absl::InvalidArgumentError(absl::StrCat(
              "--resize: ", side == 0 ? "attention " : "FFN ", r, " would leave at step ", span.end,
              " and come back at step ", s, "; a rank is a member for one span of steps"));
        }
      }
    }
  }
  return schedule;
}

MeshShape ResizeSchedule::At(int step) const {
  MeshShape s = start_;
  for (const ShapeChange& c : changes_) {
    if (c.step <= step) s = c.to;
  }
  return s;
}

MeshShape ResizeSchedule::Capacity() const {
  MeshShape cap = start_;
  for (const ShapeChange& c : changes_) {
    cap.attention = std::max(cap.attention, c.to.attention);
    cap.ffn = std::max(cap.ffn, c.to.ffn);
  }
  return cap;
}

MemberSpan ResizeSchedule::AttentionSpan(int rank) const {
  const int begin = EndOf(0, steps_, [&](int s) { return At(s).attention <= rank; });
  return {begin, EndOf(begin, steps_, [&](int s) { return At(s).attention > rank; })};
}

MemberSpan ResizeSchedule::FfnSpan(int rank) const {
  const int begin = EndOf(0, steps_, [&](int s) { return At(s).ffn <= rank; });
  return {begin, EndOf(begin, steps_, [&](int s) { return At(s).ffn > rank; })};
}

std::vector<std::string> ResizeSchedule::Specs() const {
  std::vector<std::string> specs;
  for (const ShapeChange& c : changes_) specs.push_back(absl::StrCat(c.step, ":", c.to.Name()));
  return specs;
}

absl::Status ResizeSchedule::Append(int step, MeshShape to) {
  std::vector<std::string> specs = Specs();
  specs.push_back(absl::StrCat(step, ":", to.Name()));
  STEPMESH_ASSIGN_OR_RETURN(ResizeSchedule amended, Parse(start_, steps_, specs));
  *this = std::move(amended);
  return absl::OkStatus();
}

std::string FormatResizeLine(const ShapeChange& change, int64_t epoch, double ms) {
  return absl::StrFormat("resize at step %d: %s -> %s (epoch %d, %.0f ms)", change.step,
                         change.from.Name(), change.to.Name(), epoch, ms);
}

}  // namespace afd::example
