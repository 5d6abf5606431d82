#pragma once
// The items of a Worker.push_pull / Worker.prepare call: pushes (an int key,
// a tuple or a stepmesh.Push) and pulls ((key, server) or a stepmesh.Pull),
// parsed into the library's Push / Pull with the GIL held.

#include <pybind11/pybind11.h>

#include <unordered_map>
#include <vector>

#include "python/src/tensor_slice_binding.h"
#include "stepmesh/types.h"
#include "stepmesh/worker.h"

namespace stepmesh::python {

// int key | (key,) | (key, nbytes) | (key, nbytes, servers) | stepmesh.Push.
// A stepmesh.Push's rows are turned into bytes with the row size of the
// tensor `push_regs` holds for its key; `servers` receives its server list.
Push ParsePush(pybind11::handle item, std::vector<int>& servers,
               const std::unordered_map<Key, Registered>& push_regs);

// (key, server) | stepmesh.Pull
Pull ParsePull(pybind11::handle item);

// The items of a list or tuple by index (the per-call path: no iterator
// object); any other iterable through the iterator protocol. Each item is
// referenced while `fn` parses it and the length re-read per item: a
// stepmesh.Push's attribute lookup may run Python code that edits the list.
template <typename Fn>
void ForEachItem(pybind11::handle seq, Fn&& fn) {
  if (PyList_CheckExact(seq.ptr()) || PyTuple_CheckExact(seq.ptr())) {
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq.ptr()); ++i) {
      fn(pybind11::reinterpret_borrow<pybind11::object>(PySequence_Fast_GET_ITEM(seq.ptr(), i)));
    }
    return;
  }
  for (pybind11::handle item : seq) fn(item);
}

}  // namespace stepmesh::python
