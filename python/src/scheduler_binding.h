#pragma once
// stepmesh.Scheduler: the rendezvous service (C++ Scheduler) in this process;
// waits release the GIL.

#include <pybind11/pybind11.h>

namespace stepmesh::python {

void BindScheduler(pybind11::module_& m);

}  // namespace stepmesh::python
