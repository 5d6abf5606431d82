#pragma once
// What stepmesh.Worker and stepmesh.Server share (stepmesh/participant.h),
// bound once: the binding class derives from PyParticipant, attaches its C++
// participant, and DefParticipant adds the shared Python methods. The GIL rule
// is kept here once: released around anything that may block (barrier, close,
// the clock exchange of a trace export), held for anything that may raise.

#include <pybind11/pybind11.h>

#include <string>

#include "python/src/membership_binding.h"
#include "stepmesh/participant.h"

namespace stepmesh::python {

class PyParticipant {
 public:
  // `role` names the participant in errors ("worker", "server").
  explicit PyParticipant(const char* role) : role_(role) {}
  PyParticipant(const PyParticipant&) = delete;
  PyParticipant& operator=(const PyParticipant&) = delete;

  int rank() { return live().rank(); }
  // PrometheusText(Stats()): the counters and stage histograms (docs/metrics.md).
  std::string MetricsText();
  // Chrome trace JSON of the recorded requests (docs/tracing.md).
  std::string ChromeTraceJson();
  void WriteChromeTrace(const std::string& path);
  void Barrier();
  // Leaves the mesh (idempotent); registered tensors stay referenced until
  // the object goes.
  void Close();
  bool closed() const { return closed_; }
  Participant& live_participant() { return live(); }  // membership_binding.h

 protected:
  ~PyParticipant() = default;
  // The participant the methods act on; set once, by the constructor of the
  // derived class, and outliving this object's use of it.
  void Attach(Participant* participant) { participant_ = participant; }
  // Raises FAILED_PRECONDITION "<role> is closed" once Close() ran.
  Participant& live();

 private:
  const char* const role_;
  Participant* participant_ = nullptr;
  bool closed_ = false;
};

// The shared methods and properties, and the context manager (close on exit;
// an exception in the block is not masked by one from close).
template <typename Py>
void DefParticipant(pybind11::class_<Py>& cls) {
  namespace py = pybind11;
  cls.def_property_readonly("rank", [](Py& self) { return self.rank(); })
      .def_property_readonly("closed", [](const Py& self) { return self.closed(); })
      .def(
          "metrics_text", [](Py& self) { return self.MetricsText(); },
          "Stats() in the Prometheus text format (docs/metrics.md).")
      .def(
          "chrome_trace_json", [](Py& self) { return self.ChromeTraceJson(); },
          "Recorded requests as Chrome trace JSON on the scheduler's clock (trace_events > 0).")
      .def(
          "write_chrome_trace",
          [](Py& self, const std::string& path) { self.WriteChromeTrace(path); }, py::arg("path"))
      .def("barrier", [](Py& self) { self.Barrier(); })
      .def("close", [](Py& self) { self.Close(); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](Py& self, py::handle type, py::handle, py::handle) {
        try {
          self.Close();
        } catch (const py::error_already_set&) {
          if (type.is_none()) throw;
        }
        return false;
      });
  DefMembership(cls);
}

}  // namespace stepmesh::python
