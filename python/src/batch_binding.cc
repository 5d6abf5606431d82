#include "python/src/batch_binding.h"

#include <pybind11/stl.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "python/src/binding_args.h"
#include "python/src/errors.h"

namespace stepmesh::python {
namespace py = pybind11;

TensorSlice PyBatchTensor::Part(int worker) const {
  if (worker < 0 || static_cast<size_t>(worker) >= valid_bytes.size()) {
    ThrowInvalidArgument(
        absl::StrCat("worker ", worker, " out of range [0, ", valid_bytes.size(), ")"));
  }
  return SliceOf(owner, key, worker, slot_bytes, valid_bytes[worker]);
}

const PyBatchTensor& PyBatch::TensorFor(py::handle key_arg) const {
  const Key key = KeyArg(key_arg, "batch tensor");
  for (const PyBatchTensor& t : tensors) {
    if (t.key == key) return t;
  }
  ThrowStatus(absl::NotFoundError(absl::StrCat("key ", key, " is not in this batch")));
}

void BindBatch(py::module_& m) {
  py::class_<PyBatchTensor>(m, "BatchTensor",
                            "One pushed key of a batch: every worker's slot of its receive region.")
      .def_property_readonly("key", [](const PyBatchTensor& t) { return t.key; })
      .def_property_readonly("slot_bytes", [](const PyBatchTensor& t) { return t.slot_bytes; })
      .def_property_readonly("valid_bytes", [](const PyBatchTensor& t) { return t.valid_bytes; })
      .def("part", &PyBatchTensor::Part, py::arg("worker"),
           "Worker `worker`'s valid rows as a TensorSlice (zero-copy).")
      .def(
          "rows", [](const PyBatchTensor& t, int w) { return t.Part(w).rows; }, py::arg("worker"));

  py::class_<PyBatch>(m, "Batch", "A micro-batch handed out by Server.get_batch().")
      .def_property_readonly("handle",
                             [](const PyBatch& b) {
                               return PackHandle(b.batch.handle.index(),
                                                 b.batch.handle.generation());
                             })
      .def_property_readonly("group", [](const PyBatch& b) { return b.group; })
      .def_property_readonly("workers", [](const PyBatch& b) { return b.workers; })
      .def_property_readonly("pull_keys", [](const PyBatch& b) { return b.pull_keys; })
      .def_property_readonly("tensors", [](const PyBatch& b) { return b.tensors; })
      .def_property_readonly("answered", [](const PyBatch& b) { return b.answered; })
      .def("tensor", &PyBatch::TensorFor, py::arg("key"), py::return_value_policy::copy)
      .def(
          "part", [](const PyBatch& b, py::handle key, int w) { return b.TensorFor(key).Part(w); },
          py::arg("key"), py::arg("worker"))
      .def(
          "rows",
          [](const PyBatch& b, py::handle key) {
            // What part(key, w).rows is for every present worker, without the slices.
            const PyBatchTensor& t = b.TensorFor(key);
            const size_t row_bytes = t.owner->row_bytes();
            py::list out(b.workers.size());
            for (size_t i = 0; i < b.workers.size(); ++i) {
              const size_t valid = t.valid_bytes[static_cast<size_t>(b.workers[i])];
              out[i] = py::int_(row_bytes > 0 ? valid / row_bytes : 0);
            }
            return out;
          },
          py::arg("key"), "part(key, w).rows of every present worker, in `workers` order.")
      .def(
          "parts",
          [](const PyBatch& b, int w) {
            std::vector<TensorSlice> out;
            for (const PyBatchTensor& t : b.tensors) out.push_back(t.Part(w));
            return out;
          },
          py::arg("worker"), "Worker `worker`'s part of every pushed tensor, in push order.")
      .def("__repr__", [](const PyBatch& b) {
        std::string workers;
        for (int w : b.workers) absl::StrAppend(&workers, workers.empty() ? "" : ", ", w);
        return absl::StrCat("Batch(group=", b.group, ", workers=[", workers,
                            "], tensors=", b.tensors.size(), b.answered ? ", answered" : "", ")");
      });
}

}  // namespace stepmesh::python
