#include "python/src/participant_binding.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "python/src/errors.h"
#include "python/src/gil.h"
#include "stepmesh/stats.h"

namespace stepmesh::python {
namespace py = pybind11;

Participant& PyParticipant::live() {
  if (closed_) ThrowStatus(absl::FailedPreconditionError(absl::StrCat(role_, " is closed")));
  return *participant_;
}

std::string PyParticipant::MetricsText() { return PrometheusText(live().Stats()); }

std::string PyParticipant::ChromeTraceJson() {
  Participant& node = live();  // may raise: holding the GIL
  absl::StatusOr<std::string> json;
  {
    py::gil_scoped_release release;  // asks the scheduler for the clock
    json = node.ChromeTraceJson();
  }
  return ValueOrThrow(std::move(json));
}

void PyParticipant::WriteChromeTrace(const std::string& path) {
  Participant& node = live();
  CallReleased([&] { return node.WriteChromeTrace(path); });
}

void PyParticipant::Barrier() {
  Participant& node = live();
  CallReleased([&] { return node.Barrier(); });
}

void PyParticipant::Close() {
  if (closed_) return;
  closed_ = true;
  CallReleased([&] { return participant_->Shutdown(); });
}

}  // namespace stepmesh::python
