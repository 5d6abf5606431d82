#include "python/src/attention_lanes.h"

#include <pybind11/stl.h>

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "python/src/binding_args.h"
#include "python/src/errors.h"

namespace stepmesh::python {
namespace py = pybind11;

namespace {

// An exact Python int (not a bool, not an int subclass) into `out`.
bool ExactInt(PyObject* o, int64_t& out) {
  if (o == nullptr || !PyLong_CheckExact(o)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(o, &overflow);
  return overflow == 0 && !(out == -1 && PyErr_Occurred());
}

// o.name, or nullptr with the error cleared.
py::object AttrOrNull(PyObject* o, const py::str& name) {
  PyObject* v = PyObject_GetAttr(o, name.ptr());
  if (v == nullptr) PyErr_Clear();
  return py::reinterpret_steal<py::object>(v);
}

uintptr_t DataPtrOf(py::handle tensor, const py::str& data_ptr) {
  return tensor.attr(data_ptr)().cast<uintptr_t>();
}

}  // namespace

PyAttentionLanes::PyAttentionLanes(py::object worker, py::list plans, py::list send_buffers,
                                   py::list recv_buffers, py::list meta_words, int64_t hidden,
                                   int64_t max_tokens, py::object dtype, int logits_push,
                                   py::handle timeout)
    : worker_obj_(std::move(worker)),
      worker_(worker_obj_.cast<PyWorker&>()),
      hidden_(hidden),
      max_tokens_(max_tokens),
      dtype_(std::move(dtype)),
      logits_push_(logits_push),
      timeout_(TimeoutArg(timeout, worker_.options().timeout)),
      data_ptr_("data_ptr"),
      shape_("shape"),
      dtype_name_("dtype"),
      stage_idx_("stage_idx"),
      layer_idx_("layer_idx"),
      total_tokens_("total_tokens") {
  for (py::str* name :
       {&data_ptr_, &shape_, &dtype_name_, &stage_idx_, &layer_idx_, &total_tokens_}) {
    PyObject* p = name->release().ptr();
    PyUnicode_InternInPlace(&p);
    *name = py::reinterpret_steal<py::str>(p);
  }
  const size_t n = plans.size();
  if (send_buffers.size() != n || recv_buffers.size() != n || meta_words.size() != n) {
    ThrowInvalidArgument(absl::StrCat("_AttentionLanes: ", n, " plans, ", send_buffers.size(),
                                      " send buffers, ", recv_buffers.size(), " receive buffers, ",
                                      meta_words.size(),
                                      " metadata tensors: want one of each per stage"));
  }
  if (hidden < 1 || max_tokens < 1) {
    ThrowInvalidArgument(absl::StrCat("_AttentionLanes: hidden = ", hidden,
                                      ", max_tokens = ", max_tokens, ": want both >= 1"));
  }
  const py::str element_size("element_size"), numel("numel");
  lanes_.resize(n);
  for (size_t s = 0; s < n; ++s) {
    Lane& lane = lanes_[s];
    lane.plan = &plans[s].cast<PyPlan&>();
    if (logits_push >= 0 && static_cast<size_t>(logits_push) >= lane.plan->num_pushes()) {
      ThrowInvalidArgument(absl::StrCat("_AttentionLanes: logits_push = ", logits_push, ", stage ",
                                        s, "'s plan has ", lane.plan->num_pushes(), " pushes"));
    }
    lane.send = DataPtrOf(send_buffers[s], data_ptr_);
    lane.recv = DataPtrOf(recv_buffers[s], data_ptr_);
    py::handle meta = meta_words[s];
    if (meta.attr(numel)().cast<int64_t>() < 3 || meta.attr(element_size)().cast<int>() != 8) {
      ThrowInvalidArgument(
          absl::StrCat("_AttentionLanes: stage ", s, "'s metadata: want >= 3 int64 words"));
    }
    lane.meta = reinterpret_cast<int64_t*>(DataPtrOf(meta, data_ptr_));
    const size_t row_bytes = lane.plan->RowBytes(0);
    if (s > 0 && row_bytes != row_bytes_) {
      ThrowInvalidArgument(absl::StrCat("_AttentionLanes: stage ", s, "'s rows are ", row_bytes,
                                        " bytes, stage 0's ", row_bytes_));
    }
    row_bytes_ = row_bytes;
    keep_.append(plans[s]);
    keep_.append(send_buffers[s]);
    keep_.append(recv_buffers[s]);
    keep_.append(meta);
  }
}

int PyAttentionLanes::StageOf(PyObject* stage) const {
  int64_t s = 0;
  if (!ExactInt(stage, s) || s < 0 || s >= static_cast<int64_t>(lanes_.size())) {
    if (PyErr_Occurred()) PyErr_Clear();
    return -1;
  }
  return static_cast<int>(s);
}

int64_t PyAttentionLanes::RowsAt(PyObject* tensor, uintptr_t address) const {
  // data_ptr first: a tensor to copy in (or out) is the common miss.
  py::object ptr =
      py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(tensor, data_ptr_.ptr()));
  if (!ptr || !PyLong_CheckExact(ptr.ptr()) ||
      PyLong_AsUnsignedLongLong(ptr.ptr()) != static_cast<unsigned long long>(address)) {
    if (PyErr_Occurred()) PyErr_Clear();
    return -1;
  }
  py::object shape = AttrOrNull(tensor, shape_);
  if (!shape || !PyTuple_Check(shape.ptr()) || PyTuple_GET_SIZE(shape.ptr()) != 2) return -1;
  int64_t rows = 0, cols = 0;
  if (!ExactInt(PyTuple_GET_ITEM(shape.ptr(), 0), rows) ||
      !ExactInt(PyTuple_GET_ITEM(shape.ptr(), 1), cols) || cols != hidden_) {
    if (PyErr_Occurred()) PyErr_Clear();
    return -1;
  }
  py::object dtype = AttrOrNull(tensor, dtype_name_);
  if (!dtype || !dtype.is(dtype_)) return -1;
  return rows;
}

bool PyAttentionLanes::Send(py::handle hidden_states, py::handle metadata, py::handle flags) {
  if (worker_.closed()) return false;  // the Python path says so
  const int s = StageOf(AttrOrNull(metadata.ptr(), stage_idx_).ptr());
  if (s < 0 || lanes_[s].in_flight) return false;
  int64_t layer = 0, total = 0, f = 0;
  if (!ExactInt(AttrOrNull(metadata.ptr(), layer_idx_).ptr(), layer) ||
      !ExactInt(AttrOrNull(metadata.ptr(), total_tokens_).ptr(), total) ||
      !ExactInt(flags.ptr(), f)) {
    if (PyErr_Occurred()) PyErr_Clear();
    return false;
  }
  const int64_t rows = RowsAt(hidden_states.ptr(), lanes_[s].send);
  if (rows < 0 || rows != total || rows > max_tokens_) return false;
  if (logits_push_ >= 0) lanes_[s].plan->SetCount(logits_push_, 0);  // none given
  Post(s, rows, layer, f, py::none());
  return true;
}

std::optional<int64_t> PyAttentionLanes::Recv(py::handle out, py::handle stage) {
  if (worker_.closed()) return std::nullopt;
  const int s = StageOf(stage.ptr());
  if (s < 0 || !lanes_[s].in_flight) return std::nullopt;
  if (RowsAt(out.ptr(), lanes_[s].recv) != lanes_[s].rows) return std::nullopt;
  return Wait(s);
}

void PyAttentionLanes::Post(int s, int64_t rows, int64_t layer, int64_t flags, py::handle stream) {
  if (s < 0 || static_cast<size_t>(s) >= lanes_.size() || rows < 0 || rows > max_tokens_) {
    ThrowInvalidArgument(absl::StrCat("_AttentionLanes.post: stage ", s, ", rows ", rows,
                                      ": want a stage in [0, ", lanes_.size(), ") and rows in [0, ",
                                      max_tokens_, "]"));
  }
  Lane& lane = lanes_[s];
  if (lane.in_flight) {
    ThrowStatus(absl::FailedPreconditionError(
        absl::StrCat("_AttentionLanes.post: stage ", s, " has a request in flight")));
  }
  lane.plan->SetCount(0, static_cast<size_t>(rows) * row_bytes_);
  lane.meta[0] = layer;  // the words the FFN side reads: layer, stage, flags
  lane.meta[1] = s;
  lane.meta[2] = flags;
  lane.pending = lane.plan->Post(stream).handle;
  lane.in_flight = true;
  lane.rows = rows;
}

int64_t PyAttentionLanes::Wait(int s) {
  if (s < 0 || static_cast<size_t>(s) >= lanes_.size() || !lanes_[s].in_flight) {
    ThrowStatus(absl::FailedPreconditionError(
        absl::StrCat("_AttentionLanes.wait: stage ", s, " has no request in flight")));
  }
  Lane& lane = lanes_[s];
  lane.in_flight = false;  // whatever the wait's outcome, as the connector's pop was
  worker_.WaitFor(lane.pending, timeout_);
  return lane.rows;
}

std::optional<int64_t> PyAttentionLanes::Pending(int s) const {
  if (s < 0 || static_cast<size_t>(s) >= lanes_.size() || !lanes_[s].in_flight) {
    return std::nullopt;
  }
  return lanes_[s].rows;
}

void BindAttentionLanes(py::module_& m) {
  py::class_<PyAttentionLanes>(m, "_AttentionLanes",
                               "stepmesh.vllm's attention side per stage "
                               "(python/src/attention_lanes.h); not a public API.")
      .def(py::init<py::object, py::list, py::list, py::list, py::list, int64_t, int64_t,
                    py::object, int, py::handle>(),
           py::arg("worker"), py::arg("plans"), py::arg("send_buffers"), py::arg("recv_buffers"),
           py::arg("meta_words"), py::arg("hidden"), py::arg("max_tokens"), py::arg("dtype"),
           py::arg("logits_push"), py::arg("timeout"))
      .def("send", &PyAttentionLanes::Send)
      .def("recv", &PyAttentionLanes::Recv)
      .def("post", &PyAttentionLanes::Post, py::arg("stage"), py::arg("rows"), py::arg("layer"),
           py::arg("flags"), py::arg("stream") = py::none())
      .def("wait", &PyAttentionLanes::Wait, py::arg("stage"))
      .def("pending", &PyAttentionLanes::Pending, py::arg("stage"));
}

}  // namespace stepmesh::python
