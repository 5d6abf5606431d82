#pragma once
// stepmesh._AttentionLanes: the per-stage state of stepmesh.vllm's attention
// side (python/stepmesh/vllm.py) and its common case in one binding call.
//
// Per stage a lane holds the connector's prepared request (a stepmesh.Plan),
// the addresses of its registered send buffer and of FFN rank 0's receive
// buffer, its metadata words (layer, stage, flags), and the request in flight
// with its row count. The connector's Python path posts and waits through
// post()/wait() (the one definition of what a send writes and of a wait).
//
// send()/recv() take the common case whole: eager, host-ordered, the tensors
// are the registered buffers (computed and received in place), everything
// plain Python ints. They read the tensors' data_ptr, shape and dtype through
// the C API, without the interpreter running the connector's ~40 lines of
// checks, which cost tens of microseconds with cold caches
// (docs/benchmarks.md). Anything else -- a wrong shape, a copy needed, a
// stage pending, an attribute missing -- returns False / None having changed
// nothing, and the Python path runs: its checks stay the one definition of
// the connector's errors. A transport failure raises stepmesh.Error.

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/time/time.h"
#include "python/src/plan_binding.h"
#include "python/src/worker_binding.h"
#include "stepmesh/types.h"

namespace stepmesh::python {

class PyAttentionLanes {
 public:
  // plans[s], send_buffers[s], recv_buffers[s] (FFN rank 0's) and
  // meta_words[s] (int64 tensors of >= 3 words) of every stage s; push 0 of
  // each plan is the hidden states, push `logits_push` (or -1) the router
  // logits; tensors carry `dtype` and have `hidden` columns, at most
  // `max_tokens` rows; timeout None: the worker's options.timeout.
  PyAttentionLanes(pybind11::object worker, pybind11::list plans, pybind11::list send_buffers,
                   pybind11::list recv_buffers, pybind11::list meta_words, int64_t hidden,
                   int64_t max_tokens, pybind11::object dtype, int logits_push,
                   pybind11::handle timeout);

  // send_attn_output(hidden_states, context) without router logits: true when
  // posted; false, nothing changed, when not the common case.
  bool Send(pybind11::handle hidden_states, pybind11::handle metadata, pybind11::handle flags);
  // recv_ffn_output(ref_tensor, ubatch_idx) into FFN rank 0's buffer: the
  // stage's rows once its reply is in; None, nothing changed, when not the
  // common case.
  std::optional<int64_t> Recv(pybind11::handle out, pybind11::handle stage);

  // The Python path's: stage s (checked by the caller) sends `rows` rows of
  // layer `layer` with `flags`, ordered after `stream`'s work when not None.
  void Post(int s, int64_t rows, int64_t layer, int64_t flags, pybind11::handle stream);
  // Waits for stage s's request (no longer pending, whatever the outcome);
  // returns its rows. FailedPrecondition when none is pending.
  int64_t Wait(int s);
  // The rows of stage s's request in flight, or None.
  std::optional<int64_t> Pending(int s) const;

 private:
  struct Lane {
    PyPlan* plan = nullptr;
    uintptr_t send = 0;  // the registered buffers' addresses
    uintptr_t recv = 0;
    int64_t* meta = nullptr;
    RequestHandle pending;
    bool in_flight = false;
    int64_t rows = 0;
  };

  // The stage an exact int names (not a bool), or -1.
  int StageOf(PyObject* stage) const;
  // The rows of `tensor` when it is a [rows, hidden_] tensor of dtype_ at
  // `address` (its data_ptr); -1 otherwise or on an error (cleared).
  int64_t RowsAt(PyObject* tensor, uintptr_t address) const;

  pybind11::object worker_obj_;
  PyWorker& worker_;
  pybind11::list keep_;  // the plans and tensors the lanes point into
  std::vector<Lane> lanes_;
  int64_t hidden_;
  int64_t max_tokens_;
  size_t row_bytes_ = 0;
  pybind11::object dtype_;
  int logits_push_;
  absl::Duration timeout_;
  // Attribute names, interned once.
  pybind11::str data_ptr_, shape_, dtype_name_, stage_idx_, layer_idx_, total_tokens_;
};

void BindAttentionLanes(pybind11::module_& m);

}  // namespace stepmesh::python
