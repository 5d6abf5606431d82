#include "python/src/plan_binding.h"

#include <pybind11/stl.h>

#include "absl/strings/str_cat.h"
#include "python/src/binding_args.h"
#include "python/src/errors.h"
#include "python/src/trigger_binding.h"

namespace stepmesh::python {
namespace py = pybind11;

PyPlan::PyPlan(PyWorker& worker, py::handle pushes, py::handle pulls)
    : worker_(worker),
      prepared_(worker.Prepare(pushes, pulls)),
      pushes_arg_(py::reinterpret_borrow<py::object>(pushes)),
      pulls_arg_(py::reinterpret_borrow<py::object>(pulls)) {
  default_timeout_ = worker.options().timeout;
}

RequestRef PyPlan::Post(py::handle stream) {
  Posting posting(*this);
  return worker_.SubmitPrepared(prepared_, stream, "post");
}

void PyPlan::Run(py::handle timeout, py::handle stream) {
  const absl::Duration t = timeout.is_none() ? default_timeout_ : TimeoutArg(timeout, {});
  Posting posting(*this);
  worker_.RunPrepared(prepared_, t, stream, last_);
}

std::vector<int64_t> PyPlan::RunMany(py::handle n_arg, py::handle timeout) {
  if (PyBool_Check(n_arg.ptr()) || !PyLong_Check(n_arg.ptr())) {
    ThrowInvalidArgument(absl::StrCat("run_many: n: expected an int, got ",
                                      std::string(py::str(n_arg.get_type().attr("__name__")))));
  }
  const long long n = PyLong_AsLongLong(n_arg.ptr());
  if (PyErr_Occurred()) PyErr_Clear();  // out of long long: rejected below as n
  if (n < 1 || n > kMaxRunMany) {
    ThrowInvalidArgument(absl::StrCat("run_many: n = ", std::string(py::str(n_arg)),
                                      " is not in [1, ", kMaxRunMany, "]"));
  }
  const absl::Duration t = timeout.is_none() ? default_timeout_ : TimeoutArg(timeout, {});
  std::vector<int64_t> lat(static_cast<size_t>(n));
  Posting posting(*this);
  worker_.RunPreparedMany(prepared_, t, lat, last_);
  return lat;
}

long long PyPlan::CountArg(size_t i, py::handle arg, const char* what, const char* name) const {
  CheckWritable(what);
  CheckPushIndex(i, what);
  if (PyBool_Check(arg.ptr()) || !PyLong_Check(arg.ptr())) {
    ThrowInvalidArgument(absl::StrCat(what, ": push ", i, " (key ", prepared_.push_key(i),
                                      "): ", name, ": expected an int"));
  }
  const long long n = PyLong_AsLongLong(arg.ptr());
  if (PyErr_Occurred()) PyErr_Clear();  // out of long long: -1, refused as out of range
  return n;
}

void PyPlan::SetBytes(size_t i, py::handle bytes_arg) {
  const long long b = CountArg(i, bytes_arg, "set_bytes", "bytes");
  SetPushBytes(i, b, std::string(py::str(bytes_arg)), "set_bytes", "bytes");
}

void PyPlan::SetRows(size_t i, py::handle rows_arg) {
  const long long r = CountArg(i, rows_arg, "set_rows", "rows");
  const size_t row_bytes = RowBytes(i);
  const long long max_rows =
      row_bytes == 0 ? 0 : static_cast<long long>(prepared_.registered_bytes(i) / row_bytes);
  if (r < 0 || r > max_rows) {
    ThrowInvalidArgument(absl::StrCat("set_rows: push ", i, " (key ", prepared_.push_key(i),
                                      "): rows = ", std::string(py::str(rows_arg)),
                                      " is not in [0, ", max_rows, "]"));
  }
  ThrowIfError(prepared_.SetBytes(i, static_cast<size_t>(r) * row_bytes));
}

size_t PyPlan::RowBytes(size_t i) const {
  const TensorView tensor = prepared_.push_tensor(i);
  const int64_t rows = tensor.shape.rank() > 0 ? tensor.shape[0] : 1;
  return rows > 0 ? tensor.bytes() / static_cast<size_t>(rows) : 0;
}

size_t PyPlan::bytes(size_t i) const {
  CheckPushIndex(i, "bytes");
  return prepared_.bytes(i);
}

TriggerTarget PyPlan::TriggerTargetNow() {
  auto frozen = std::make_shared<PreparedRequest>(worker_.Prepare(pushes_arg_, pulls_arg_));
  for (size_t i = 0; i < prepared_.num_pushes(); ++i) {
    ThrowIfError(frozen->SetBytes(i, prepared_.bytes(i)));
  }
  return PreparedTriggerTarget(worker_.node(), std::move(frozen));
}

void PyPlan::CheckWritable(const char* what) const {
  if (posting_ > 0) {
    ThrowStatus(absl::FailedPreconditionError(absl::StrCat(
        what, ": the plan is being posted by another thread (change it between posts)")));
  }
}

void PyPlan::CheckPushIndex(size_t i, const char* what) const {
  if (i >= prepared_.num_pushes()) {
    ThrowInvalidArgument(
        absl::StrCat(what, ": push index ", i, " is not in [0, ", prepared_.num_pushes(), ")"));
  }
}

void PyPlan::SetPushBytes(size_t i, long long b, const std::string& shown, const char* what,
                          const char* name) {
  const size_t registered = prepared_.registered_bytes(i);
  if (b < 0 || static_cast<unsigned long long>(b) > registered) {
    ThrowInvalidArgument(absl::StrCat(what, ": push ", i, " (key ", prepared_.push_key(i),
                                      "): ", name, " = ", shown, " is not in [0, ", registered,
                                      "] (the registered tensor)"));
  }
  ThrowIfError(prepared_.SetBytes(i, static_cast<size_t>(b)));
}

void BindPlan(py::module_& m) {
  py::class_<PyPlan>(m, "Plan", "A prepared PushPull (Worker.prepare).")
      .def("post", &PyPlan::Post, py::arg("stream") = py::none(),
           "Submits the request (returns at once): a Request to wait on.")
      .def("run", &PyPlan::Run, py::arg("timeout") = py::none(), py::arg("stream") = py::none(),
           "Submits and waits (GIL released once). On DeadlineExceeded the request stays\n"
           "pending: plan.last is its Request.")
      .def("run_many", &PyPlan::RunMany, py::arg("n"), py::arg("timeout") = py::none(),
           "Benchmark hook: run() n times in C++ under one GIL release, no Python per\n"
           "iteration. Returns the n round trips in ns (PushPull entry to Wait return,\n"
           "stepmesh.monotonic_ns's clock). timeout applies to each wait; a failure raises\n"
           "naming the iteration (plan.last: its request).")
      .def("set_bytes", &PyPlan::SetBytes, py::arg("index"), py::arg("bytes"),
           "Push `index` sends `bytes` bytes from now on (<= its registered tensor).")
      .def("set_rows", &PyPlan::SetRows, py::arg("index"), py::arg("rows"),
           "Push `index` sends its first `rows` rows from now on (<= the registered rows).")
      .def("bytes", &PyPlan::bytes, py::arg("index"), "The bytes push `index` sends.")
      .def_property_readonly("last", &PyPlan::last,
                             "The Request of the last run() (for fetch_trace), or None.")
      .def(
          "trigger_target",
          [](py::object self) {
            return PyTriggerTarget{self.cast<PyPlan&>().TriggerTargetNow(), self};
          },
          "The request as it stands now (byte counts included), for Trigger.arm.")
      .def_property_readonly("num_pushes", &PyPlan::num_pushes)
      .def_property_readonly("num_pulls", &PyPlan::num_pulls);
}

}  // namespace stepmesh::python
