#pragma once
// stepmesh.Worker, stepmesh.Server, stepmesh.Scheduler and the objects they
// hand out (Request, Batch, BatchTensor, TensorSlice). Thin: every check that
// the C++ library makes stays there; the binding converts tensors (DLPack),
// keeps registered tensors alive, releases the GIL around anything that may
// block, and turns statuses into exceptions.

#include <pybind11/pybind11.h>

namespace stepmesh::python {

void BindMesh(pybind11::module_& m);

}  // namespace stepmesh::python
