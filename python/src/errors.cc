#include "python/src/errors.h"

#include <array>

namespace stepmesh::python {
namespace py = pybind11;

namespace {

struct ErrorClass {
  absl::StatusCode code;
  const char* name;        // Python class name
  PyObject* builtin_base;  // extra base besides stepmesh.Error, or null
};

// Filled once at import; the classes live as long as the interpreter (the
// module holds them), so borrowed pointers are safe to keep.
PyObject* g_base = nullptr;
std::array<PyObject*, 17> g_by_code{};

}  // namespace

void RegisterErrors(py::module_& m) {
  const ErrorClass classes[] = {
      {absl::StatusCode::kCancelled, "Cancelled", nullptr},
      {absl::StatusCode::kUnknown, "Unknown", nullptr},
      {absl::StatusCode::kInvalidArgument, "InvalidArgument", PyExc_ValueError},
      {absl::StatusCode::kDeadlineExceeded, "DeadlineExceeded", PyExc_TimeoutError},
      {absl::StatusCode::kNotFound, "NotFound", PyExc_LookupError},
      {absl::StatusCode::kAlreadyExists, "AlreadyExists", nullptr},
      {absl::StatusCode::kPermissionDenied, "PermissionDenied", nullptr},
      {absl::StatusCode::kResourceExhausted, "ResourceExhausted", nullptr},
      {absl::StatusCode::kFailedPrecondition, "FailedPrecondition", nullptr},
      {absl::StatusCode::kAborted, "Aborted", nullptr},
      {absl::StatusCode::kOutOfRange, "OutOfRange", PyExc_ValueError},
      {absl::StatusCode::kUnimplemented, "Unimplemented", PyExc_NotImplementedError},
      {absl::StatusCode::kInternal, "Internal", nullptr},
      {absl::StatusCode::kUnavailable, "Unavailable", PyExc_ConnectionError},
      {absl::StatusCode::kDataLoss, "DataLoss", nullptr},
      {absl::StatusCode::kUnauthenticated, "Unauthenticated", nullptr},
  };
  py::dict base_attrs;
  base_attrs["__doc__"] = "Base of every stepmesh error; `code` names the absl status code.";
  base_attrs["code"] = "UNKNOWN";
  g_base = PyErr_NewException("stepmesh.Error", PyExc_Exception, base_attrs.ptr());
  if (g_base == nullptr) throw py::error_already_set();
  m.add_object("Error", py::handle(g_base));
  for (const ErrorClass& c : classes) {
    py::tuple bases = c.builtin_base == nullptr
                          ? py::make_tuple(py::handle(g_base))
                          : py::make_tuple(py::handle(g_base), py::handle(c.builtin_base));
    py::dict attrs;
    attrs["code"] = absl::StatusCodeToString(c.code);
    attrs["code_value"] = static_cast<int>(c.code);
    const std::string qualified = std::string("stepmesh.") + c.name;
    PyObject* cls = PyErr_NewException(qualified.c_str(), bases.ptr(), attrs.ptr());
    if (cls == nullptr) throw py::error_already_set();
    m.add_object(c.name, py::handle(cls));
    g_by_code[static_cast<size_t>(c.code)] = cls;
  }
}

void ThrowStatus(const absl::Status& status) {
  const auto index = static_cast<size_t>(status.code());
  PyObject* cls =
      index < g_by_code.size() && g_by_code[index] != nullptr ? g_by_code[index] : g_base;
  const std::string message(status.message());
  PyErr_SetString(cls, message.c_str());
  throw py::error_already_set();
}

void ThrowInvalidArgument(const std::string& message) {
  ThrowStatus(absl::InvalidArgumentError(message));
}

}  // namespace stepmesh::python
