#pragma once
// stepmesh.MeshOptions: the C++ MeshOptions with one Python attribute per
// field (durations in seconds, enums as their names), built from keyword
// arguments and/or the environment (MeshOptions.from_env overlays the same
// STEPMESH_* / DMLC_* table the C++ library reads).

#include <pybind11/pybind11.h>

#include "stepmesh/options.h"

namespace stepmesh::python {

void BindOptions(pybind11::module_& m);

// `options` (a MeshOptions, or None) with `kwargs` applied on top; unknown
// names and ill-typed values raise stepmesh.InvalidArgument naming them.
MeshOptions OptionsFrom(pybind11::handle options, const pybind11::kwargs& kwargs);

}  // namespace stepmesh::python
