#pragma once
// stepmesh.TensorSlice: a window of registered memory (a worker's part of a
// batch, a slot of a registered region), handed to numpy/torch through
// DLPack without a copy.

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "python/src/dlpack_tensor.h"
#include "stepmesh/tensor.h"
#include "stepmesh/types.h"

namespace stepmesh::python {

// A registration's tensor, kept alive while the registration or a view of it lives.
using Registered = std::shared_ptr<ImportedTensor>;

// A window of registered memory, handed to numpy/torch through DLPack (no copy).
struct TensorSlice {
  TensorView view;
  Registered owner;
  Key key = 0;
  int worker = -1;
  size_t valid_bytes = 0;
  int64_t rows = 0;
};

// Worker `worker`'s slot (`slot_bytes` each) of `owner`, its first `valid_bytes` bytes.
TensorSlice SliceOf(const Registered& owner, Key key, int worker, size_t slot_bytes,
                    size_t valid_bytes);

void BindTensorSlice(pybind11::module_& m);

}  // namespace stepmesh::python
