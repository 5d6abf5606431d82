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

Key KeyArg(py::handle key, const char* what) {
  if (PyBool_Check(key.ptr()) || !PyLong_Check(key.ptr())) {
    ThrowInvalidArgument(absl::StrCat(what, ": expected an int key, got ",
                                      std::string(py::str(key.get_type().attr("__name__")))));
  }
  const unsigned long long k = PyLong_AsUnsignedLongLong(key.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    ThrowInvalidArgument(
        absl::StrCat(what, ": key ", std::string(py::str(key)), " is not in [0, 2**64)"));
  }
  return k;
}

}  // namespace stepmesh::python
