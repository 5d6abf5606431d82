#pragma once
// absl::Status -> Python exceptions. Every status code has its own class under
// stepmesh.Error (stepmesh.Unavailable, stepmesh.DeadlineExceeded, ...); the
// ones with an obvious built-in meaning also derive from it (InvalidArgument
// and OutOfRange are ValueErrors, DeadlineExceeded a TimeoutError, ...), so
// `except ValueError` works for bad input as Python users expect.

#include <pybind11/pybind11.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace stepmesh::python {

// Creates the exception classes as attributes of `m`. Call once, at import.
void RegisterErrors(pybind11::module_& m);

// Raises the exception class of status.code() with status.message().
[[noreturn]] void ThrowStatus(const absl::Status& status);
inline void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) ThrowStatus(status);
}
template <typename T>
T ValueOrThrow(absl::StatusOr<T> value) {
  if (!value.ok()) ThrowStatus(value.status());
  return *std::move(value);
}

// stepmesh.InvalidArgument (a ValueError) with `message`.
[[noreturn]] void ThrowInvalidArgument(const std::string& message);

}  // namespace stepmesh::python
