#pragma once
// Tensors in and out of the extension through DLPack, so any framework works
// (numpy, torch, CuPy, JAX) and nothing links against one.
//
// In: ImportTensor() calls obj.__dlpack__(), takes ownership of the managed
// tensor and keeps the Python object too, so the memory stays valid for as
// long as the ImportedTensor lives (a registration holds one).
// Out: ExportView() wraps a window of an imported tensor as a "dltensor"
// capsule whose deleter keeps that ImportedTensor alive: a numpy/torch view
// made with from_dlpack() never outlives the memory it points at.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>

#include "python/src/dlpack_abi.h"
#include "stepmesh/tensor.h"

namespace stepmesh::python {

class ImportedTensor {
 public:
  ImportedTensor(DLManagedTensor* managed, pybind11::object owner, TensorView view);
  ~ImportedTensor();  // takes the GIL itself: safe to drop from any thread
  ImportedTensor(const ImportedTensor&) = delete;
  ImportedTensor& operator=(const ImportedTensor&) = delete;

  const TensorView& view() const { return view_; }
  // Bytes of one index of the first dimension (the element size for rank 0).
  size_t row_bytes() const;
  int64_t rows() const { return view_.shape.rank() > 0 ? view_.shape[0] : 1; }

 private:
  DLManagedTensor* managed_;  // owned; its deleter releases the producer's memory
  pybind11::object owner_;
  TensorView view_;
};

// `what` names the tensor in errors ("push tensor for key 3"). Raises
// stepmesh.InvalidArgument (a ValueError) naming what is wrong: no __dlpack__,
// non-contiguous, unsupported dtype or device, too many dimensions.
std::shared_ptr<ImportedTensor> ImportTensor(pybind11::handle obj, const std::string& what);

// A capsule over `view`; `owner` (an ImportedTensor, a HostTensor's memory)
// keeps the memory alive until the consumer releases the capsule.
pybind11::capsule ExportView(const TensorView& view, std::shared_ptr<const void> owner);

// Parses a dtype name ("float32", "bfloat16", ...) or raises InvalidArgument.
DType DTypeArg(const std::string& name);

// A writable numpy array over `view` (host memory, a numpy dtype), keeping
// `owner` alive. numpy's own from_dlpack() hands out read-only arrays.
pybind11::object NumpyView(const TensorView& view, std::shared_ptr<const void> owner);

// (device_type, device_id) for __dlpack_device__.
pybind11::tuple DlpackDevice(const Device& device);

// dtype name as stepmesh spells it ("float32", "bfloat16", ...).
std::string DTypeString(DType dtype);

// The shape's extents as a Python tuple (a tensor's .shape).
pybind11::tuple ShapeTuple(const Shape& shape);

// Shape of the first `rows` rows of `view` (the remaining dimensions kept).
Shape RowsShape(const TensorView& view, int64_t rows);

}  // namespace stepmesh::python
