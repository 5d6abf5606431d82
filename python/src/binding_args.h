#pragma once
// Arguments every mesh class parses the same way: a timeout in seconds, an
// int key, and a request or batch handle packed into one Python int.

#include <pybind11/pybind11.h>

#include <cstdint>

#include "absl/time/time.h"
#include "stepmesh/types.h"

namespace stepmesh::python {

// None -> `fallback`; otherwise non-negative seconds (float or int, not bool).
absl::Duration TimeoutArg(pybind11::handle timeout, absl::Duration fallback);

// An int (not a bool) in [0, 2**64); `what` names the call in errors.
Key KeyArg(pybind11::handle key, const char* what);

// An int (not a bool) in [0, 2**64), or InvalidArgument: "<what>: <wrong_type>
// <the type's name>" for anything else, "<what>: <noun> <value> <out_of_range>"
// for an int outside it.
uint64_t UnsignedIntArg(pybind11::handle arg, const char* what, const char* wrong_type,
                        const char* noun, const char* out_of_range);

inline uint64_t PackHandle(uint32_t index, uint32_t generation) {
  return (uint64_t{index} << 32) | generation;
}

}  // namespace stepmesh::python
