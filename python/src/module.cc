// The _stepmesh extension module; python/stepmesh/__init__.py re-exports it.
#include <pybind11/pybind11.h>

#include "python/src/errors.h"
#include "python/src/host_tensor_binding.h"
#include "python/src/membership_binding.h"
#include "python/src/mesh_binding.h"
#include "python/src/options_binding.h"
#include "python/src/stream_binding.h"
#include "python/src/trigger_binding.h"
#include "stepmesh/trace.h"

PYBIND11_MODULE(_stepmesh, m) {
  m.doc() = "stepmesh: Attention-FFN disaggregation communication (C++ core bindings)";
  stepmesh::python::RegisterErrors(m);
  stepmesh::python::BindOptions(m);
  stepmesh::python::BindStream(m);
  stepmesh::python::BindTrigger(m);
  stepmesh::python::BindMembership(m);
  stepmesh::python::BindMesh(m);
  stepmesh::python::BindHostTensor(m);
  m.def("monotonic_ns", &stepmesh::MonotonicNowNs,
        "CLOCK_MONOTONIC in nanoseconds: the clock trace stamps use.");
}
