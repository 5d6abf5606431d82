#include "python/src/binding_args.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "python/src/errors.h"

namespace stepmesh::python {
namespace py = pybind11;

absl::Duration TimeoutArg(py::handle timeout, absl::Duration fallback) {
  if (timeout.is_none()) return fallback;
  if (PyBool_Check(timeout.ptr()) ||
      !(PyFloat_Check(timeout.ptr()) || PyLong_Check(timeout.ptr()))) {
    ThrowInvalidArgument("timeout: expected seconds (float) or None");
  }
  const double s = timeout.cast<double>();
  if (!(s >= 0)) ThrowInvalidArgument(absl::StrCat("timeout: ", s, " s is negative"));
  return absl::Seconds(s);
}

uint64_t UnsignedIntArg(py::handle arg, const char* what, const char* wrong_type, const char* noun,
                        const char* out_of_range) {
  if (PyBool_Check(arg.ptr()) || !PyLong_Check(arg.ptr())) {
    ThrowInvalidArgument(absl::StrCat(what, ": ", wrong_type,
                                      std::string(py::str(arg.get_type().attr("__name__")))));
  }
  const unsigned long long value = PyLong_AsUnsignedLongLong(arg.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    ThrowInvalidArgument(
        absl::StrCat(what, ": ", noun, " ", std::string(py::str(arg)), " ", out_of_range));
  }
  return value;
}

Key KeyArg(py::handle key, const char* what) {
  return UnsignedIntArg(key, what, "expected an int key, got ", "key", "is not in [0, 2**64)");
}

}  // namespace stepmesh::python
