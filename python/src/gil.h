#pragma once
// The binding's GIL rule, written once: a library call that may block runs
// with the GIL released; its error is raised after the GIL is taken back
// (raising needs it).

#include <pybind11/pybind11.h>

#include <utility>

#include "absl/status/status.h"
#include "python/src/errors.h"

namespace stepmesh::python {

// Runs `call` (returns absl::Status) without the GIL; raises its error.
template <typename Call>
void CallReleased(Call&& call) {
  absl::Status s;
  {
    pybind11::gil_scoped_release release;
    s = std::forward<Call>(call)();
  }
  ThrowIfError(s);
}

// The value `make` (returns absl::StatusOr<T>) produces without the GIL, e.g.
// a participant joining the mesh; raises its error.
template <typename Make>
auto MakeReleased(Make&& make) {
  decltype(make()) made;
  {
    pybind11::gil_scoped_release release;
    made = make();
  }
  return ValueOrThrow(std::move(made));
}

}  // namespace stepmesh::python
