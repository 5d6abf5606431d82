#pragma once
// Framework-free helpers: stepmesh.HostTensor (aligned host memory of any
// stepmesh dtype, bfloat16 and float8 included, exported through DLPack),
// stepmesh.describe(t) and stepmesh.copy_(dst, src).

#include <pybind11/pybind11.h>

namespace stepmesh::python {

void BindHostTensor(pybind11::module_& m);

}  // namespace stepmesh::python
