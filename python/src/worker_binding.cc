#include "python/src/worker_binding.h"

#include <pybind11/stl.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "python/src/binding_args.h"
#include "python/src/dlpack_tensor.h"
#include "python/src/errors.h"
#include "python/src/gil.h"
#include "python/src/options_binding.h"
#include "python/src/plan_binding.h"
#include "python/src/request_items.h"
#include "python/src/store_binding.h"
#include "python/src/trigger_binding.h"
#include "stepmesh/stats.h"

namespace stepmesh::python {
namespace py = pybind11;

PyWorker::PyWorker(MeshOptions options, std::shared_ptr<RendezvousStore> store)
    : PyNode("worker", Role::kWorker, std::move(options), [&](const MeshOptions& o) {
        return store != nullptr ? CreateWorkerWithStore(o, std::move(store))
                                : AFTensorWorker::Create(o);
      }) {}

PyWorker::~PyWorker() {
  TearDown([&] { ready_.clear(); });
  push_regs_.clear();
  pull_regs_.clear();
}

template <typename PostFn>
RequestRef PyWorker::Submit(py::handle stream, const char* what, PostFn&& post,
                            std::optional<uint32_t> stage) {
  auto& node = live();  // may raise: do it holding the GIL
  py::object keep;
  Stream* s = streams_->Resolve(stream, what, keep);
  Event* ready = s == nullptr ? nullptr : events_->Take();
  absl::StatusOr<RequestHandle> handle;
  {
    py::gil_scoped_release release;
    if (ready == nullptr) {
      handle = post(node, SendOptions{.ready = nullptr, .stage = stage});
    } else if (absl::Status r = ready->Record(*s); !r.ok()) {
      handle = r;
    } else {
      handle = post(node, SendOptions{.ready = ready, .stage = stage});
    }
  }
  if (!handle.ok()) {
    if (ready != nullptr) events_->Give(ready);
    ThrowStatus(handle.status());
  }
  if (ready != nullptr) {
    const uint32_t i = handle->index();
    if (ready_.size() <= i) ready_.resize(i + 1);
    ready_[i] = {handle->generation(), ready, std::move(keep)};
  }
  return RequestRef{*handle};
}

void PyWorker::RegisterPush(py::handle key_arg, py::handle tensor) {
  const Key key = KeyArg(key_arg, "register_push");
  Registered t = ImportTensor(tensor, absl::StrCat("push tensor for key ", key));
  auto& node = live();  // may raise: do it holding the GIL
  CallReleased([&] { return node.RegisterPushTensor(key, t->view()); });
  push_regs_[key] = std::move(t);
}

void PyWorker::RegisterPull(py::handle key_arg, int server, py::handle tensor) {
  const Key key = KeyArg(key_arg, "register_pull");
  Registered t =
      ImportTensor(tensor, absl::StrCat("pull tensor for key ", key, " from server ", server));
  auto& node = live();  // may raise: do it holding the GIL
  CallReleased([&] { return node.RegisterPullTensor(key, server, t->view()); });
  pull_regs_[{key, server}] = std::move(t);
}

void PyWorker::Unregister(py::handle key_arg) {
  const Key key = KeyArg(key_arg, "unregister");
  auto& node = live();  // may raise: do it holding the GIL
  CallReleased([&] { return node.Unregister(key); });
  push_regs_.erase(key);
  for (auto it = pull_regs_.lower_bound({key, INT32_MIN});
       it != pull_regs_.end() && it->first.first == key;) {
    it = pull_regs_.erase(it);
  }
}

RequestRef PyWorker::PushPull(py::handle pushes, py::handle pulls, py::handle stream,
                              std::optional<uint32_t> stage) {
  // Per-thread scratch: parsed with the GIL held, used after releasing it.
  thread_local std::vector<Push> push_items;
  thread_local std::vector<std::vector<int>> push_servers;
  thread_local std::vector<Pull> pull_items;
  push_items.clear();
  pull_items.clear();
  size_t n = 0;
  ForEachItem(pushes, [&](py::handle item) {
    if (push_servers.size() <= n) push_servers.emplace_back();
    push_servers[n].clear();
    push_items.push_back(ParsePush(item, push_servers[n], push_regs_));
    ++n;
  });
  // The server lists were filled first; point the spans at them now that
  // push_servers no longer grows.
  for (size_t i = 0; i < n; ++i) push_items[i].servers = push_servers[i];
  if (!pulls.is_none()) {
    ForEachItem(pulls, [&](py::handle item) { pull_items.push_back(ParsePull(item)); });
  }
  return Submit(
      stream, "push_pull",
      [&](AFTensorWorker& node, const SendOptions& options) {
        return node.PushPull(push_items, pull_items, options);
      },
      stage);
}

void PyWorker::Wait(const RequestRef& request, py::handle timeout, py::handle stream) {
  auto& node = live();  // may raise: do it holding the GIL
  if (!stream.is_none()) {
    py::object keep;
    Stream* s = streams_->Resolve(stream, "wait", keep);
    ThrowIfError(node.StreamWaitReply(request.handle, *s));
    return;
  }
  WaitFor(request.handle, TimeoutArg(timeout, options_.timeout));
}

void PyWorker::WaitFor(RequestHandle h, absl::Duration timeout) {
  auto& node = live();  // may raise: do it holding the GIL
  absl::Status s;
  {
    py::gil_scoped_release release;
    s = node.Wait(h, timeout);
  }
  Finished(h, s);
  ThrowIfError(s);
}

void PyWorker::StreamWaitNextPull(py::handle key_arg, int server, py::handle stream) {
  const Key key = KeyArg(key_arg, "stream_wait_next_pull");
  auto& node = live();
  if (stream.is_none()) ThrowInvalidArgument("stream_wait_next_pull: stream is None");
  py::object keep;
  Stream* s = streams_->Resolve(stream, "stream_wait_next_pull", keep);
  ThrowIfError(node.StreamWaitNextPull(key, server, *s));
}

PreparedRequest PyWorker::Prepare(py::handle pushes, py::handle pulls) {
  auto& node = live();  // may raise: do it holding the GIL
  std::vector<Push> push_items;
  std::vector<std::vector<int>> push_servers;
  std::vector<Pull> pull_items;
  for (py::handle item : pushes) {
    push_servers.emplace_back();
    push_items.push_back(ParsePush(item, push_servers.back(), push_regs_));
  }
  for (size_t i = 0; i < push_items.size(); ++i) push_items[i].servers = push_servers[i];
  if (!pulls.is_none()) {
    for (py::handle item : pulls) pull_items.push_back(ParsePull(item));
  }
  absl::StatusOr<PreparedRequest> prepared;
  {
    py::gil_scoped_release release;
    prepared = node.Prepare(push_items, pull_items);
  }
  if (!prepared.ok()) {
    const absl::Status& s = prepared.status();
    ThrowStatus(absl::Status(s.code(), absl::StrCat("prepare: ", s.message())));
  }
  return *std::move(prepared);
}

void PyWorker::RunPrepared(const PreparedRequest& prepared, absl::Duration timeout,
                           py::handle stream, RequestHandle& last) {
  auto& node = live();      // may raise: do it holding the GIL
  if (!stream.is_none()) {  // ordered after the stream's work: the same, with an event
    last = SubmitPrepared(prepared, stream, "run").handle;
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = node.Wait(last, timeout);
    }
    Finished(last, s);
    ThrowIfError(s);
    return;
  }
  absl::Status s;
  {
    py::gil_scoped_release release;
    absl::StatusOr<RequestHandle> h = node.Post(prepared);
    if (h.ok()) {
      last = *h;
      s = node.Wait(*h, timeout);
    } else {
      s = h.status();
    }
  }
  ThrowIfError(s);
}

void PyWorker::RunPreparedMany(const PreparedRequest& prepared, absl::Duration timeout,
                               std::vector<int64_t>& lat, RequestHandle& last) {
  auto& node = live();  // may raise: do it holding the GIL
  absl::Status s;
  size_t i = 0;
  {
    py::gil_scoped_release release;
    for (; i < lat.size(); ++i) {
      const uint64_t t0 = MonotonicNowNs();
      absl::StatusOr<RequestHandle> h = node.Post(prepared);
      if (!h.ok()) {
        s = h.status();
        break;
      }
      last = *h;
      s = node.Wait(*h, timeout);
      if (!s.ok()) break;
      lat[i] = static_cast<int64_t>(MonotonicNowNs() - t0);
    }
  }
  if (!s.ok()) {
    ThrowStatus(absl::Status(
        s.code(), absl::StrCat("run_many: iteration ", i, " of ", lat.size(), ": ", s.message())));
  }
}

RequestRef PyWorker::SubmitPrepared(const PreparedRequest& prepared, py::handle stream,
                                    const char* what) {
  return Submit(stream, what, [&](AFTensorWorker& node, const SendOptions& options) {
    return node.Post(prepared, options);
  });
}

py::dict PyWorker::FetchTrace(const RequestRef& request) {
  TraceRecord record = ValueOrThrow(live().FetchTrace(request.handle));
  py::list servers;
  for (const TraceRecord::PerServer& s : record.servers) {
    py::dict d;
    d["server"] = s.server;
    d["enqueue_ns"] = s.stamps.enqueue_ns;
    d["post_ns"] = s.stamps.post_ns;
    d["server_arrival_ns"] = s.stamps.server_arrival_ns;
    d["server_handler_ns"] = s.stamps.server_handler_ns;
    d["server_respond_ns"] = s.stamps.server_respond_ns;
    d["server_reply_ns"] = s.stamps.server_reply_ns;
    d["reply_arrival_ns"] = s.stamps.reply_arrival_ns;
    servers.append(std::move(d));
  }
  py::dict out;
  out["servers"] = std::move(servers);
  out["complete_ns"] = record.complete_ns;
  return out;
}

void PyWorker::Finished(RequestHandle h, const absl::Status& s) {
  if (absl::IsDeadlineExceeded(s) || h.index() >= ready_.size()) return;
  ReadyOf& r = ready_[h.index()];
  if (r.event == nullptr || r.generation != h.generation()) return;
  events_->Give(r.event);
  r = ReadyOf{};
}

void BindRequest(py::module_& m) {
  py::class_<RequestRef>(m, "Request", "A worker request (generation-checked handle).")
      .def_property_readonly("index", [](const RequestRef& r) { return r.handle.index(); })
      .def_property_readonly("generation",
                             [](const RequestRef& r) { return r.handle.generation(); })
      .def("__int__",
           [](const RequestRef& r) { return PackHandle(r.handle.index(), r.handle.generation()); })
      .def("__hash__",
           [](const RequestRef& r) { return PackHandle(r.handle.index(), r.handle.generation()); })
      .def("__eq__", [](const RequestRef& a, const RequestRef& b) { return a.handle == b.handle; })
      .def("__repr__", [](const RequestRef& r) {
        return absl::StrCat("Request(index=", r.handle.index(),
                            ", generation=", r.handle.generation(), ")");
      });
}

void BindWorker(py::module_& m) {
  py::class_<PyWorker> worker(m, "Worker", R"doc(
The attention side (C++ AFTensorWorker). Worker(options=None, **fields)
connects to the scheduler and every server (blocking, GIL released).)doc");
  worker.def_property_readonly("num_servers", &PyWorker::num_servers)
      .def("register_push", &PyWorker::RegisterPush, py::arg("key"), py::arg("tensor"))
      .def("register_pull", &PyWorker::RegisterPull, py::arg("key"), py::arg("server"),
           py::arg("tensor"))
      .def("unregister", &PyWorker::Unregister, py::arg("key"))
      .def("push_pull", &PyWorker::PushPull, py::arg("pushes"), py::arg("pulls") = py::tuple(),
           py::arg("stream") = py::none(), py::arg("stage") = py::none(),
           "stream: None, a stepmesh.Stream or an int cudaStream_t; the send waits for the\n"
           "work enqueued on it so far (a ready event), without blocking the caller.\n"
           "stage: the micro-batch stage (SendOptions.stage): servers batch the requests of\n"
           "one stage together whatever their keys; None: the first push key names the batch.")
      .def(
          "prepare",
          [](PyWorker& w, py::handle pushes, py::handle pulls) {
            return std::make_unique<PyPlan>(w, pushes, pulls);
          },
          py::arg("pushes"), py::arg("pulls") = py::tuple(), py::keep_alive<0, 1>(),
          "A PushPull parsed and prepared once (AFTensorWorker::Prepare: keys checked,\n"
          "servers routed): plan.post() -> Request, plan.run(timeout) = post + wait under\n"
          "one GIL release (no Python object made). Unregistering a key it uses makes it\n"
          "stale: posting it then raises FailedPrecondition naming the key.")
      .def("wait", &PyWorker::Wait, py::arg("request"), py::arg("timeout") = py::none(),
           py::arg("stream") = py::none(),
           "Host wait (GIL released), or with stream=: the stream waits on the device for\n"
           "the reply and this returns at once (wait() on the host later releases the handle).")
      .def("stream_wait_next_pull", &PyWorker::StreamWaitNextPull, py::arg("key"),
           py::arg("server"), py::arg("stream"),
           "The stream waits for the next reply under (key, server), counted on the device.")
      .def(
          "create_trigger",
          [](PyWorker& w, int capacity, double timeout) {
            return new PyTrigger(w.node().backend(), capacity, timeout);
          },
          py::keep_alive<0, 1>(), py::arg("capacity") = 4096, py::arg("timeout") = 30.0,
          "A stepmesh.Trigger posting this worker's plans from a stream (graph replays).")
      .def("test", &PyWorker::Test, py::arg("request"))
      .def("fetch_trace", &PyWorker::FetchTrace, py::arg("request"));
  DefNode(worker, "worker");
}

}  // namespace stepmesh::python
