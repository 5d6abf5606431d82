#include "python/src/tensor_slice_binding.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace stepmesh::python {
namespace py = pybind11;

TensorSlice SliceOf(const Registered& owner, Key key, int worker, size_t slot_bytes,
                    size_t valid_bytes) {
  const TensorView& region = owner->view();
  const size_t row_bytes = owner->row_bytes();
  TensorSlice s;
  s.owner = owner;
  s.key = key;
  s.worker = worker;
  s.valid_bytes = valid_bytes;
  s.view.data = static_cast<char*>(region.data) + static_cast<size_t>(worker) * slot_bytes;
  s.view.dtype = region.dtype;
  s.view.device = region.device;
  if (row_bytes > 0 && valid_bytes % row_bytes == 0) {
    s.rows = static_cast<int64_t>(valid_bytes / row_bytes);
    s.view.shape = RowsShape(region, s.rows);
  } else {
    // Not a whole number of rows: the valid elements, flat.
    const int64_t elements = static_cast<int64_t>(valid_bytes / DTypeSize(region.dtype));
    s.rows = row_bytes > 0 ? static_cast<int64_t>(valid_bytes / row_bytes) : 0;
    s.view.shape = Shape{elements};
  }
  return s;
}

void BindTensorSlice(py::module_& m) {
  py::class_<TensorSlice>(m, "TensorSlice", R"doc(
A zero-copy view of registered memory (a worker's part of a batch, or a slot
of a registered region). Any DLPack consumer takes it: np.from_dlpack(s),
torch.utils.dlpack.from_dlpack(s). The memory stays alive while a view exists;
its contents are only meaningful until the batch is answered.)doc")
      .def(
          "__dlpack__",
          [](const TensorSlice& s, py::handle /*stream*/) { return ExportView(s.view, s.owner); },
          py::arg("stream") = py::none())
      .def("__dlpack_device__", [](const TensorSlice& s) { return DlpackDevice(s.view.device); })
      .def(
          "numpy", [](const TensorSlice& s) { return NumpyView(s.view, s.owner); },
          "A writable numpy view (host memory, numpy dtypes).")
      .def_property_readonly("key", [](const TensorSlice& s) { return s.key; })
      .def_property_readonly("worker", [](const TensorSlice& s) { return s.worker; })
      .def_property_readonly("valid_bytes", [](const TensorSlice& s) { return s.valid_bytes; })
      .def_property_readonly("rows", [](const TensorSlice& s) { return s.rows; })
      .def_property_readonly("shape", [](const TensorSlice& s) { return ShapeTuple(s.view.shape); })
      .def_property_readonly("dtype",
                             [](const TensorSlice& s) { return DTypeString(s.view.dtype); })
      .def_property_readonly("device",
                             [](const TensorSlice& s) { return DeviceName(s.view.device); })
      .def_property_readonly(
          "data_ptr", [](const TensorSlice& s) { return reinterpret_cast<uintptr_t>(s.view.data); })
      .def("__repr__", [](const TensorSlice& s) {
        return absl::StrCat("TensorSlice(key=", s.key, ", worker=", s.worker, ", rows=", s.rows,
                            ", valid_bytes=", s.valid_bytes, ", shape=", s.view.shape.ToString(),
                            ", dtype=", DTypeName(s.view.dtype), ")");
      });
}

}  // namespace stepmesh::python
