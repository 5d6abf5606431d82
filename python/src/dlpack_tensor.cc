#include "python/src/dlpack_tensor.h"

#include <pybind11/numpy.h>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "python/src/errors.h"

namespace stepmesh::python {
namespace py = pybind11;

namespace {

constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";

std::string DlTypeName(const DLDataType& t) {
  const char* kind = "code";
  switch (t.code) {
    case kDLInt:
      kind = "int";
      break;
    case kDLUInt:
      kind = "uint";
      break;
    case kDLFloat:
      kind = "float";
      break;
    case kDLBfloat:
      kind = "bfloat";
      break;
    case kDLBool:
      kind = "bool";
      break;
    default:
      return absl::StrCat("dlpack type code ", t.code, " bits ", t.bits);
  }
  std::string name = absl::StrCat(kind, t.bits);
  if (t.lanes != 1) absl::StrAppend(&name, "x", t.lanes);
  return name;
}

// The DLPack type (one lane) of each stepmesh dtype, in DType order from kUInt8 = 1.
constexpr DLDataType kDlTypes[] = {{kDLUInt, 8, 1},         {kDLInt, 32, 1},   {kDLInt, 64, 1},
                                   {kDLFloat, 32, 1},       {kDLFloat, 16, 1}, {kDLBfloat, 16, 1},
                                   {kDLFloat8_e4m3fn, 8, 1}};

// The stepmesh dtype of a DLPack type, or an error naming it.
absl::StatusOr<DType> ToDType(const DLDataType& t) {
  for (size_t i = 0; i < std::size(kDlTypes); ++i) {
    const DLDataType& known = kDlTypes[i];
    if (t.code == known.code && t.bits == known.bits && t.lanes == known.lanes) {
      return static_cast<DType>(i + 1);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype ", DlTypeName(t),
                   " (supported: uint8, int32, int64, float32, float16, bfloat16, float8_e4m3fn)"));
}

DLDataType FromDType(DType dtype) {
  const size_t i = static_cast<size_t>(dtype) - 1;
  return i < std::size(kDlTypes) ? kDlTypes[i] : kDlTypes[0];
}

absl::StatusOr<Device> ToDevice(const DLDevice& d) {
  switch (d.device_type) {
    case kDLCPU:
    case kDLCUDAHost:  // pinned host memory: the CPU reaches it directly
      return Device::Cpu();
    case kDLCUDA:
    case kDLCUDAManaged:
      return Device::Cuda(d.device_id);
    default:
      return absl::InvalidArgumentError(absl::StrCat("unsupported device (DLPack device type ",
                                                     d.device_type, ", id ", d.device_id,
                                                     "); stepmesh takes CPU and CUDA tensors"));
  }
}

// Whether the strides (in elements) describe a compact row-major layout.
bool IsRowMajor(const DLTensor& t) {
  if (t.strides == nullptr) return true;
  int64_t expected = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] != 1 && t.strides[d] != expected) return false;
    expected *= t.shape[d];
  }
  return true;
}

// Calls obj.__dlpack__(), asking a CUDA producer not to synchronise any stream:
// registration only records the address, and sends are ordered by the caller.
py::object CallDlpack(py::handle obj) {
  if (py::hasattr(obj, "__dlpack_device__")) {
    py::tuple dev = obj.attr("__dlpack_device__")();
    const int type = dev[0].cast<int>();
    if (type == kDLCUDA || type == kDLCUDAManaged) {
      try {
        return obj.attr("__dlpack__")(py::arg("stream") = -1);
      } catch (const py::error_already_set& e) {
        if (!e.matches(PyExc_TypeError) && !e.matches(PyExc_ValueError)) throw;
      }
    }
  }
  return obj.attr("__dlpack__")();
}

void DeleteExported(DLManagedTensor* self);

struct ExportContext {
  DLManagedTensor managed{};
  int64_t shape[Shape::kMaxDims]{};
  std::shared_ptr<const void> owner;
};

void DeleteExported(DLManagedTensor* self) {
  // The consumer may call this from any thread; ImportedTensor takes the GIL itself.
  delete static_cast<ExportContext*>(self->manager_ctx);
}

void ExportCapsuleDestructor(PyObject* capsule) {
  // A consumer renames the capsule when it takes ownership; otherwise nobody did.
  if (!PyCapsule_IsValid(capsule, kCapsuleName)) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

}  // namespace

ImportedTensor::ImportedTensor(DLManagedTensor* managed, py::object owner, TensorView view)
    : managed_(managed), owner_(std::move(owner)), view_(view) {}

ImportedTensor::~ImportedTensor() {
  py::gil_scoped_acquire gil;
  if (managed_ != nullptr && managed_->deleter != nullptr) managed_->deleter(managed_);
  owner_ = py::object();
}

size_t ImportedTensor::row_bytes() const {
  const int64_t r = rows();
  return r > 0 ? view_.bytes() / static_cast<size_t>(r) : 0;
}

std::shared_ptr<ImportedTensor> ImportTensor(py::handle obj, const std::string& what) {
  py::object capsule;
  if (PyCapsule_CheckExact(obj.ptr())) {
    capsule = py::reinterpret_borrow<py::object>(obj);
  } else if (py::hasattr(obj, "__dlpack__")) {
    try {
      capsule = CallDlpack(obj);
    } catch (const py::error_already_set& e) {
      // The producer refuses (numpy: bool, read-only, ...): a bad argument.
      if (!e.matches(PyExc_BufferError) && !e.matches(PyExc_TypeError) &&
          !e.matches(PyExc_ValueError)) {
        throw;
      }
      ThrowInvalidArgument(absl::StrCat(what, ": its __dlpack__() refused: ", e.what()));
    }
  } else {
    ThrowInvalidArgument(absl::StrCat(what, ": ", std::string(py::str(obj.get_type())),
                                      " has no __dlpack__ (pass a numpy array, torch tensor, "
                                      "or any DLPack producer)"));
  }
  if (!PyCapsule_IsValid(capsule.ptr(), kCapsuleName)) {
    ThrowInvalidArgument(
        absl::StrCat(what, ": __dlpack__() did not return an unused \"dltensor\" capsule"));
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), kCapsuleName));
  // From here on we own the managed tensor (DLPack: rename the capsule).
  PyCapsule_SetName(capsule.ptr(), kUsedCapsuleName);
  auto release = [managed] {
    if (managed->deleter != nullptr) managed->deleter(managed);
  };
  const DLTensor& t = managed->dl_tensor;
  auto fail = [&](const std::string& why) {
    release();
    ThrowInvalidArgument(absl::StrCat(what, ": ", why));
  };
  absl::StatusOr<DType> dtype = ToDType(t.dtype);
  if (!dtype.ok()) fail(std::string(dtype.status().message()));
  absl::StatusOr<Device> device = ToDevice(t.device);
  if (!device.ok()) fail(std::string(device.status().message()));
  if (t.ndim < 0 || t.ndim > Shape::kMaxDims) {
    fail(absl::StrCat(t.ndim, " dimensions (at most ", Shape::kMaxDims, ")"));
  }
  if (!IsRowMajor(t)) {
    std::vector<int64_t> shape(t.shape, t.shape + t.ndim), strides(t.strides, t.strides + t.ndim);
    fail(absl::StrCat("not contiguous (shape [", absl::StrJoin(shape, ", "), "], strides [",
                      absl::StrJoin(strides, ", "),
                      "] elements); pass a contiguous tensor (np.ascontiguousarray, "
                      ".contiguous())"));
  }
  absl::StatusOr<Shape> shape = Shape::Make(t.shape, t.ndim);
  if (!shape.ok()) fail(std::string(shape.status().message()));
  TensorView view;
  view.data = static_cast<char*>(t.data) + t.byte_offset;
  view.dtype = *dtype;
  view.shape = *shape;
  view.device = *device;
  return std::make_shared<ImportedTensor>(managed, py::reinterpret_borrow<py::object>(obj), view);
}

py::capsule ExportView(const TensorView& view, std::shared_ptr<const void> owner) {
  auto ctx = std::make_unique<ExportContext>();
  for (int d = 0; d < view.shape.rank(); ++d) ctx->shape[d] = view.shape[d];
  ctx->owner = std::move(owner);
  DLTensor& t = ctx->managed.dl_tensor;
  t.data = view.data;
  t.device = view.device.kind == DeviceKind::kCuda ? DLDevice{kDLCUDA, view.device.index}
                                                   : DLDevice{kDLCPU, 0};
  t.ndim = view.shape.rank();
  t.dtype = FromDType(view.dtype);
  t.shape = ctx->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = DeleteExported;
  PyObject* capsule = PyCapsule_New(&ctx->managed, kCapsuleName, ExportCapsuleDestructor);
  if (capsule == nullptr) throw py::error_already_set();
  ctx.release();  // owned by the capsule (or its consumer) from here on
  return py::reinterpret_steal<py::capsule>(capsule);
}

py::object NumpyView(const TensorView& view, std::shared_ptr<const void> owner) {
  if (view.device.kind != DeviceKind::kCpu) {
    ThrowInvalidArgument(absl::StrCat("numpy(): the tensor is on ", DeviceName(view.device)));
  }
  // numpy spells the dtypes it has as stepmesh does.
  const DType dtype = view.dtype;
  const bool numpy_has = dtype == DType::kUInt8 || dtype == DType::kInt32 ||
                         dtype == DType::kInt64 || dtype == DType::kFloat32 ||
                         dtype == DType::kFloat16;
  if (!numpy_has) {
    ThrowInvalidArgument(absl::StrCat("numpy(): numpy has no ", DTypeName(dtype),
                                      " (use .raw() bytes or torch's from_dlpack)"));
  }
  std::vector<py::ssize_t> shape;
  for (int d = 0; d < view.shape.rank(); ++d) shape.push_back(view.shape[d]);
  // The capsule is the array's base: it holds the owner until numpy lets go.
  auto* hold = new std::shared_ptr<const void>(std::move(owner));
  py::capsule base(hold, [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); });
  return py::array(py::dtype(std::string(DTypeName(dtype))), shape, view.data, base);
}

py::tuple DlpackDevice(const Device& device) {
  if (device.kind == DeviceKind::kCuda) return py::make_tuple(int{kDLCUDA}, device.index);
  return py::make_tuple(int{kDLCPU}, 0);
}

std::string DTypeString(DType dtype) { return std::string(DTypeName(dtype)); }

DType DTypeArg(const std::string& name) {
  absl::StatusOr<DType> dtype = ParseDType(name);
  if (!dtype.ok()) {
    ThrowInvalidArgument(absl::StrCat("dtype '", name,
                                      "' (want uint8, int32, int64, float32, float16, bfloat16 "
                                      "or float8_e4m3)"));
  }
  return *dtype;
}

pybind11::tuple ShapeTuple(const Shape& shape) {
  pybind11::tuple t(shape.rank());
  for (int d = 0; d < shape.rank(); ++d) t[d] = shape[d];
  return t;
}

Shape RowsShape(const TensorView& view, int64_t rows) {
  int64_t dims[Shape::kMaxDims];
  const int rank = view.shape.rank() > 0 ? view.shape.rank() : 1;
  dims[0] = rows;
  for (int d = 1; d < rank; ++d) dims[d] = view.shape[d];
  return *Shape::Make(dims, rank);
}

}  // namespace stepmesh::python
