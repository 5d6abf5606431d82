#pragma once
// Elastic membership in Python (docs/elastic.md): stepmesh.Membership and,
// on stepmesh.Worker and stepmesh.Server, the `membership` property,
// wait_membership_change() and leave(). Bound once for both roles over
// stepmesh::Participant; the GIL is released around the waits.

#include <pybind11/pybind11.h>

#include "stepmesh/participant.h"

namespace stepmesh::python {

// stepmesh.Membership (epoch, workers, servers).
void BindMembership(pybind11::module& m);

// A Membership as its Python object.
pybind11::object MembershipObject(const Membership& membership);
// Participant::WaitMembershipChange with the GIL released; raises on errors.
pybind11::object WaitMembershipChange(Participant& participant, uint64_t after_epoch,
                                      double timeout_s);
// Participant::Leave with the GIL released; raises on errors.
void LeaveMesh(Participant& participant, double timeout_s);

// The methods on a binding class whose objects reach their participant
// through live() (PyParticipant).
template <typename Py>
void DefMembership(pybind11::class_<Py>& cls) {
  namespace py = pybind11;
  cls.def_property_readonly(
         "membership",
         [](Py& self) { return MembershipObject(self.live_participant().CurrentMembership()); },
         "The membership as this participant last heard it (Membership).")
      .def(
          "wait_membership_change",
          [](Py& self, uint64_t after_epoch, double timeout) {
            return WaitMembershipChange(self.live_participant(), after_epoch, timeout);
          },
          py::arg("after_epoch"), py::arg("timeout") = 30.0,
          "Blocks until the membership epoch passes after_epoch; returns the Membership. "
          "DeadlineExceeded after timeout seconds.")
      .def(
          "leave",
          [](Py& self, double timeout) {
            LeaveMesh(self.live_participant(), timeout);
            self.Close();  // left: shut down, so later calls raise "closed"
          },
          py::arg("timeout") = 30.0,
          "Drains (a worker: its requests complete; a server: it answers what arrived, "
          "get_batch raising Unavailable 'drained' once done), then leaves in order.");
}

}  // namespace stepmesh::python
