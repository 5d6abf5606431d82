#include "python/src/membership_binding.h"

#include <pybind11/stl.h>

#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "python/src/errors.h"

namespace stepmesh::python {
namespace py = pybind11;

void BindMembership(py::module& m) {
  py::class_<Membership>(m, "Membership", "Who is in the mesh at one epoch (docs/elastic.md).")
      .def_readonly("epoch", &Membership::epoch)
      .def_readonly("workers", &Membership::workers)
      .def_readonly("servers", &Membership::servers)
      .def("__repr__", [](const Membership& m) {
        return py::str("Membership(epoch={}, workers={}, servers={})")
            .format(m.epoch, py::cast(m.workers), py::cast(m.servers));
      });
}

py::object MembershipObject(const Membership& membership) { return py::cast(membership); }

py::object WaitMembershipChange(Participant& participant, uint64_t after_epoch, double timeout_s) {
  absl::StatusOr<Membership> changed;
  {
    py::gil_scoped_release release;
    changed = participant.WaitMembershipChange(after_epoch, absl::Seconds(timeout_s));
  }
  return py::cast(ValueOrThrow(std::move(changed)));
}

void LeaveMesh(Participant& participant, double timeout_s) {
  absl::Status left;
  {
    py::gil_scoped_release release;
    left = participant.Leave(absl::Seconds(timeout_s));
  }
  ThrowIfError(left);
}

}  // namespace stepmesh::python
