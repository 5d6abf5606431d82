#pragma once
// stepmesh.Worker, stepmesh.Server, stepmesh.Scheduler and the objects they
// hand out (Request, Plan, Batch, BatchTensor, TensorSlice), one file per
// class (worker_binding, plan_binding, server_binding, batch_binding,
// scheduler_binding, tensor_slice_binding). Thin: every check that the C++
// library makes stays there; the binding converts tensors (DLPack), keeps
// registered tensors alive, releases the GIL around anything that may block,
// and turns statuses into exceptions.

#include <pybind11/pybind11.h>

namespace stepmesh::python {

// Binds every class above into `m`.
void BindMesh(pybind11::module_& m);

}  // namespace stepmesh::python
