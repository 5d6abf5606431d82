#pragma once
// stepmesh.Server (C++ AFTensorServer): the FFN side. The binding keeps the
// tensors it registered alive (a batch's slices view them), builds a
// stepmesh.Batch per get_batch(), turns respond()'s rows/bytes into replies,
// and keeps one ready event per micro-batch group for stream-ordered replies.

#include <pybind11/pybind11.h>

namespace stepmesh::python {

void BindServer(pybind11::module_& m);

}  // namespace stepmesh::python
