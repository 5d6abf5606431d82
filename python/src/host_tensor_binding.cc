#include "python/src/host_tensor_binding.h"

#include <pybind11/stl.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "python/src/dlpack_tensor.h"
#include "python/src/errors.h"

namespace stepmesh::python {
namespace py = pybind11;

namespace {

// 64-byte aligned, zero-filled host memory.
struct HostMemory {
  explicit HostMemory(size_t bytes) : bytes(bytes) {
    data = std::aligned_alloc(64, ((bytes + 63) / 64) * 64 + 64);
    if (data == nullptr) throw std::bad_alloc();
    std::memset(data, 0, bytes);
  }
  ~HostMemory() { std::free(data); }
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;
  void* data = nullptr;
  size_t bytes = 0;
};

struct HostTensor {
  std::shared_ptr<HostMemory> memory;
  TensorView view;
};

HostTensor MakeHostTensor(const std::vector<int64_t>& dims, const std::string& dtype_name) {
  const DType dtype = DTypeArg(dtype_name);
  if (dims.size() > static_cast<size_t>(Shape::kMaxDims)) {
    ThrowInvalidArgument(
        absl::StrCat("shape: ", dims.size(), " dimensions (at most ", Shape::kMaxDims, ")"));
  }
  for (int64_t d : dims) {
    if (d < 0) ThrowInvalidArgument(absl::StrCat("shape: negative dimension ", d));
  }
  HostTensor t;
  t.view.dtype = dtype;
  t.view.shape = ValueOrThrow(Shape::Make(dims.data(), static_cast<int>(dims.size())));
  t.memory = std::make_shared<HostMemory>(t.view.bytes());
  t.view.data = t.memory->data;
  return t;
}

}  // namespace

void BindHostTensor(py::module_& m) {
  py::class_<HostTensor>(m, "HostTensor", R"doc(
HostTensor(shape, dtype): zero-filled, 64-byte aligned host memory of a
stepmesh dtype, usable wherever a tensor is taken and viewable by any DLPack
consumer (np.from_dlpack; torch.utils.dlpack.from_dlpack for bfloat16/fp8).)doc")
      .def(py::init(&MakeHostTensor), py::arg("shape"), py::arg("dtype"))
      .def(
          "__dlpack__",
          [](const HostTensor& t, py::handle) { return ExportView(t.view, t.memory); },
          py::arg("stream") = py::none())
      .def("__dlpack_device__", [](const HostTensor& t) { return DlpackDevice(t.view.device); })
      .def_property_readonly("shape", [](const HostTensor& t) { return ShapeTuple(t.view.shape); })
      .def_property_readonly("dtype", [](const HostTensor& t) { return DTypeString(t.view.dtype); })
      .def_property_readonly("nbytes", [](const HostTensor& t) { return t.view.bytes(); })
      .def_property_readonly(
          "data_ptr", [](const HostTensor& t) { return reinterpret_cast<uintptr_t>(t.view.data); })
      .def(
          "numpy", [](const HostTensor& t) { return NumpyView(t.view, t.memory); },
          "A writable numpy view (numpy dtypes only; bfloat16/fp8: .raw()).")
      .def(
          "raw",
          [](const HostTensor& t) {
            HostTensor raw = t;
            raw.view = BytesView(t.view.data, t.view.bytes(), t.view.device);
            return raw;
          },
          "The same memory as a flat uint8 HostTensor (to fill or read any dtype's bytes).")
      .def("__repr__", [](const HostTensor& t) {
        return absl::StrCat("HostTensor(shape=", t.view.shape.ToString(),
                            ", dtype=", DTypeName(t.view.dtype), ")");
      });

  m.def(
      "describe",
      [](py::handle tensor) {
        std::shared_ptr<ImportedTensor> t = ImportTensor(tensor, "describe");
        const TensorView& v = t->view();
        py::dict d;
        d["data_ptr"] = reinterpret_cast<uintptr_t>(v.data);
        d["nbytes"] = v.bytes();
        d["dtype"] = DTypeString(v.dtype);
        d["shape"] = ShapeTuple(v.shape);
        d["device"] = DeviceName(v.device);
        return d;
      },
      py::arg("tensor"),
      "What stepmesh sees of a DLPack tensor: data_ptr, nbytes, dtype, shape, device. "
      "Raises ValueError for what stepmesh cannot take.");

  m.def(
      "copy_",
      [](py::handle dst, py::handle src) {
        std::shared_ptr<ImportedTensor> d = ImportTensor(dst, "copy_ destination");
        std::shared_ptr<ImportedTensor> s = ImportTensor(src, "copy_ source");
        const TensorView& dv = d->view();
        const TensorView& sv = s->view();
        if (dv.dtype != sv.dtype) {
          ThrowInvalidArgument(
              absl::StrCat("copy_: dtype ", DTypeName(sv.dtype), " into ", DTypeName(dv.dtype)));
        }
        if (sv.bytes() > dv.bytes()) {
          ThrowInvalidArgument(absl::StrCat("copy_: ", sv.bytes(), " bytes into ", dv.bytes()));
        }
        if (dv.device.kind != DeviceKind::kCpu || sv.device.kind != DeviceKind::kCpu) {
          ThrowStatus(absl::UnimplementedError(
              "copy_: device tensors (copy with the framework, e.g. torch's copy_)"));
        }
        {
          py::gil_scoped_release release;
          std::memmove(dv.data, sv.data, sv.bytes());
        }
        return sv.bytes();
      },
      py::arg("dst"), py::arg("src"),
      "Copies src's bytes to the start of dst (host tensors, same dtype); returns the count.");
}

}  // namespace stepmesh::python
