#pragma once
// stepmesh.Batch and stepmesh.BatchTensor: a micro-batch handed out by
// Server.get_batch() and its pushed keys, each every worker's slot of the
// key's receive region (zero-copy TensorSlices).

#include <pybind11/pybind11.h>

#include <cstddef>
#include <optional>
#include <vector>

#include "python/src/tensor_slice_binding.h"
#include "stepmesh/server.h"
#include "stepmesh/types.h"

namespace stepmesh::python {

struct PyBatchTensor {
  Key key = 0;
  size_t slot_bytes = 0;
  std::vector<size_t> valid_bytes;  // per worker rank
  Registered owner;
  TensorSlice Part(int worker) const;
};

struct PyBatch {
  Batch batch;  // its spans are only used by Respond (which reads the handle)
  Key group = 0;
  std::vector<int> workers;
  std::vector<std::optional<Key>> pull_keys;
  std::vector<PyBatchTensor> tensors;
  bool answered = false;

  const PyBatchTensor& TensorFor(pybind11::handle key_arg) const;
};

void BindBatch(pybind11::module_& m);

}  // namespace stepmesh::python
