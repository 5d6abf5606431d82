#pragma once
// stepmesh.Worker (C++ AFTensorWorker) and stepmesh.Request. PyWorker keeps
// the tensors it registered alive, parses the items of push_pull / prepare
// (python/src/request_items.h), holds a request's ready event and stream
// until its send is over, and releases the GIL around anything that may block.
// stepmesh.Plan (python/src/plan_binding.h) posts through it.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "python/src/errors.h"
#include "python/src/participant_binding.h"
#include "python/src/participant_node.h"
#include "python/src/stream_binding.h"
#include "python/src/tensor_slice_binding.h"
#include "stepmesh/options.h"
#include "stepmesh/rendezvous_store.h"
#include "stepmesh/worker.h"

namespace stepmesh::python {

// stepmesh.Request: a worker request (generation-checked handle).
struct RequestRef {
  RequestHandle handle;
};

class PyWorker : public PyNode<AFTensorWorker> {
 public:
  explicit PyWorker(MeshOptions options, std::shared_ptr<RendezvousStore> store = nullptr);
  ~PyWorker();

  int num_servers() { return live().num_servers(); }

  void RegisterPush(pybind11::handle key_arg, pybind11::handle tensor);

  void RegisterPull(pybind11::handle key_arg, int server, pybind11::handle tensor);

  void Unregister(pybind11::handle key_arg);

  RequestRef PushPull(pybind11::handle pushes, pybind11::handle pulls, pybind11::handle stream,
                      std::optional<uint32_t> stage);

  // stream=None: blocks (GIL released) until done and releases the handle.
  // Otherwise the stream waits for the reply on the device and this returns
  // at once; the handle stays pending for a later host wait().
  void Wait(const RequestRef& request, pybind11::handle timeout, pybind11::handle stream);

  // The host wait of wait(stream=None) (GIL released), for stepmesh.vllm's
  // attention lanes too: raises the request's failure.
  void WaitFor(RequestHandle h, absl::Duration timeout);

  void StreamWaitNextPull(pybind11::handle key_arg, int server, pybind11::handle stream);

  bool Test(const RequestRef& request) { return ValueOrThrow(live().Test(request.handle)); }

  // Parses a request once for PyPlan (rows turned into bytes) and prepares it
  // in the library, which checks every key once and names the bad one.
  PreparedRequest Prepare(pybind11::handle pushes, pybind11::handle pulls);

  // Post + Wait with the GIL released once, for PyPlan. `last` receives the
  // handle (kept pending when the wait timed out).
  void RunPrepared(const PreparedRequest& prepared, absl::Duration timeout, pybind11::handle stream,
                   RequestHandle& last);

  // Post + Wait `lat.size()` times in C++ under one GIL release (the
  // benchmark hook behind Plan.run_many): lat[i] is iteration i's round trip,
  // Post() entry to Wait() return on MonotonicNowNs's clock, as
  // stepmesh_perf's worker measures it. Stops at the first failure, whose
  // status names the iteration; `last` is the latest request (pending when its
  // wait timed out).
  void RunPreparedMany(const PreparedRequest& prepared, absl::Duration timeout,
                       std::vector<int64_t>& lat, RequestHandle& last);

  RequestRef SubmitPrepared(const PreparedRequest& prepared, pybind11::handle stream,
                            const char* what);

  // Submits a request through `post(node, options)` (PushPull or Post);
  // with a stream, its send waits for a ready event recorded on that stream
  // now (the producing kernels enqueued so far).
  template <typename PostFn>
  RequestRef Submit(pybind11::handle stream, const char* what, PostFn&& post,
                    std::optional<uint32_t> stage = std::nullopt);

  pybind11::dict FetchTrace(const RequestRef& request);

  // For stepmesh.Trigger (python/src/trigger_binding.h): the node and its backend.
  AFTensorWorker& node() { return live(); }

 private:
  // A host wait ended: unless it timed out (the request is still pending), the
  // request's send is over and its ready event may be reused.
  void Finished(RequestHandle h, const absl::Status& s);

  // The ready event of a request submitted with a stream (by handle index)
  // and the stream object it was recorded on, held until the send is over.
  struct ReadyOf {
    uint32_t generation = 0;
    Event* event = nullptr;
    pybind11::object stream;
  };

  std::vector<ReadyOf> ready_;
  // Cleared after TearDown dropped the node, so the memory outlives the mesh.
  std::unordered_map<Key, Registered> push_regs_;
  std::map<std::pair<Key, int>, Registered> pull_regs_;
};

void BindRequest(pybind11::module_& m);
// stepmesh.Worker; its prepare() makes a stepmesh.Plan (bound first, by BindPlan).
void BindWorker(pybind11::module_& m);

}  // namespace stepmesh::python
