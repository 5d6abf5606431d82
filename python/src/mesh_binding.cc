#include "python/src/mesh_binding.h"

#include <pybind11/stl.h>

#include <climits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "python/src/dlpack_tensor.h"
#include "python/src/errors.h"
#include "python/src/options_binding.h"
#include "python/src/participant_binding.h"
#include "python/src/store_binding.h"
#include "python/src/stream_binding.h"
#include "python/src/trigger_binding.h"
#include "stepmesh/scheduler.h"
#include "stepmesh/server.h"
#include "stepmesh/stats.h"
#include "stepmesh/worker.h"

namespace stepmesh::python {
namespace py = pybind11;

namespace {

using Registered = std::shared_ptr<ImportedTensor>;

absl::Duration TimeoutArg(py::handle timeout, absl::Duration fallback) {
  if (timeout.is_none()) return fallback;
  if (PyBool_Check(timeout.ptr()) ||
      !(PyFloat_Check(timeout.ptr()) || PyLong_Check(timeout.ptr()))) {
    ThrowInvalidArgument("timeout: expected seconds (float) or None");
  }
  const double s = timeout.cast<double>();
  if (!(s >= 0)) ThrowInvalidArgument(absl::StrCat("timeout: ", s, " s is negative"));
  return absl::Seconds(s);
}

Key KeyArg(py::handle key, const char* what) {
  if (PyBool_Check(key.ptr()) || !PyLong_Check(key.ptr())) {
    ThrowInvalidArgument(absl::StrCat(what, ": expected an int key, got ",
                                      std::string(py::str(key.get_type().attr("__name__")))));
  }
  const unsigned long long k = PyLong_AsUnsignedLongLong(key.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    ThrowInvalidArgument(
        absl::StrCat(what, ": key ", std::string(py::str(key)), " is not in [0, 2**64)"));
  }
  return k;
}

uint64_t PackHandle(uint32_t index, uint32_t generation) {
  return (uint64_t{index} << 32) | generation;
}

// A window of registered memory, handed to numpy/torch through DLPack (no copy).
struct TensorSlice {
  TensorView view;
  Registered owner;
  Key key = 0;
  int worker = -1;
  size_t valid_bytes = 0;
  int64_t rows = 0;
};

TensorSlice SliceOf(const Registered& owner, Key key, int worker, size_t slot_bytes,
                    size_t valid_bytes) {
  const TensorView& region = owner->view();
  const size_t row_bytes = owner->row_bytes();
  TensorSlice s;
  s.owner = owner;
  s.key = key;
  s.worker = worker;
  s.valid_bytes = valid_bytes;
  s.view.data = static_cast<char*>(region.data) + static_cast<size_t>(worker) * slot_bytes;
  s.view.dtype = region.dtype;
  s.view.device = region.device;
  if (row_bytes > 0 && valid_bytes % row_bytes == 0) {
    s.rows = static_cast<int64_t>(valid_bytes / row_bytes);
    s.view.shape = RowsShape(region, s.rows);
  } else {
    // Not a whole number of rows: the valid elements, flat.
    const int64_t elements = static_cast<int64_t>(valid_bytes / DTypeSize(region.dtype));
    s.rows = row_bytes > 0 ? static_cast<int64_t>(valid_bytes / row_bytes) : 0;
    s.view.shape = Shape{elements};
  }
  return s;
}

py::tuple ShapeTuple(const Shape& shape) {
  py::tuple t(shape.rank());
  for (int d = 0; d < shape.rank(); ++d) t[d] = shape[d];
  return t;
}

// ---------------------------------------------------------------- worker

struct RequestRef {
  RequestHandle handle;
};

class PyWorker : public PyParticipant {
 public:
  explicit PyWorker(MeshOptions options, std::shared_ptr<RendezvousStore> store = nullptr)
      : PyParticipant("worker"), options_(std::move(options)) {
    options_.role = Role::kWorker;
    absl::StatusOr<std::unique_ptr<AFTensorWorker>> worker;
    {
      py::gil_scoped_release release;
      worker = store != nullptr ? CreateWorkerWithStore(options_, std::move(store))
                                : AFTensorWorker::Create(options_);
    }
    worker_ = ValueOrThrow(std::move(worker));
    Attach(worker_.get());
    streams_ = std::make_unique<StreamArgs>(worker_->backend());
    events_ = std::make_unique<EventPool>(worker_->backend());
  }

  ~PyWorker() {
    {
      py::gil_scoped_release release;
      (void)worker_->Shutdown();  // the send thread no longer reads ready events
    }
    ready_.clear();  // stream references (GIL held)
    {
      py::gil_scoped_release release;
      events_.reset();  // before the backend that made them
      streams_.reset();
      worker_.reset();  // stops the threads; registrations are dropped after
    }
    push_regs_.clear();
    pull_regs_.clear();
  }

  PyStream* CreateStream() { return new PyStream(ValueOrThrow(live().backend().CreateStream())); }

  int num_servers() { return live().num_servers(); }
  const MeshOptions& options() const { return options_; }

  void RegisterPush(py::handle key_arg, py::handle tensor) {
    const Key key = KeyArg(key_arg, "register_push");
    Registered t = ImportTensor(tensor, absl::StrCat("push tensor for key ", key));
    absl::Status s;
    auto& node = live();  // may raise: do it holding the GIL
    {
      py::gil_scoped_release release;
      s = node.RegisterPushTensor(key, t->view());
    }
    ThrowIfError(s);
    push_regs_[key] = std::move(t);
  }

  void RegisterPull(py::handle key_arg, int server, py::handle tensor) {
    const Key key = KeyArg(key_arg, "register_pull");
    Registered t =
        ImportTensor(tensor, absl::StrCat("pull tensor for key ", key, " from server ", server));
    absl::Status s;
    auto& node = live();  // may raise: do it holding the GIL
    {
      py::gil_scoped_release release;
      s = node.RegisterPullTensor(key, server, t->view());
    }
    ThrowIfError(s);
    pull_regs_[{key, server}] = std::move(t);
  }

  void Unregister(py::handle key_arg) {
    const Key key = KeyArg(key_arg, "unregister");
    absl::Status s;
    auto& node = live();  // may raise: do it holding the GIL
    {
      py::gil_scoped_release release;
      s = node.Unregister(key);
    }
    ThrowIfError(s);
    push_regs_.erase(key);
    for (auto it = pull_regs_.lower_bound({key, INT32_MIN});
         it != pull_regs_.end() && it->first.first == key;) {
      it = pull_regs_.erase(it);
    }
  }

  RequestRef PushPull(py::handle pushes, py::handle pulls, py::handle stream,
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
      push_items.push_back(ParsePush(item, push_servers[n]));
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

  // stream=None: blocks (GIL released) until done and releases the handle.
  // Otherwise the stream waits for the reply on the device and this returns
  // at once; the handle stays pending for a later host wait().
  void Wait(const RequestRef& request, py::handle timeout, py::handle stream) {
    auto& node = live();  // may raise: do it holding the GIL
    if (!stream.is_none()) {
      py::object keep;
      Stream* s = streams_->Resolve(stream, "wait", keep);
      ThrowIfError(node.StreamWaitReply(request.handle, *s));
      return;
    }
    const absl::Duration t = TimeoutArg(timeout, options_.timeout);
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = node.Wait(request.handle, t);
    }
    Finished(request.handle, s);
    ThrowIfError(s);
  }

  void StreamWaitCounter(uintptr_t counter, uintptr_t target, py::handle stream) {
    live();
    streams_->WaitCounter(stream, counter, target);
  }

  void StreamWaitNextPull(py::handle key_arg, int server, py::handle stream) {
    const Key key = KeyArg(key_arg, "stream_wait_next_pull");
    auto& node = live();
    if (stream.is_none()) ThrowInvalidArgument("stream_wait_next_pull: stream is None");
    py::object keep;
    Stream* s = streams_->Resolve(stream, "stream_wait_next_pull", keep);
    ThrowIfError(node.StreamWaitNextPull(key, server, *s));
  }

  bool Test(const RequestRef& request) { return ValueOrThrow(live().Test(request.handle)); }

  // Parses a request once for PyPlan (rows turned into bytes) and prepares it
  // in the library, which checks every key once and names the bad one.
  PreparedRequest Prepare(py::handle pushes, py::handle pulls) {
    auto& node = live();  // may raise: do it holding the GIL
    std::vector<Push> push_items;
    std::vector<std::vector<int>> push_servers;
    std::vector<Pull> pull_items;
    for (py::handle item : pushes) {
      push_servers.emplace_back();
      push_items.push_back(ParsePush(item, push_servers.back()));
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

  // Post + Wait with the GIL released once, for PyPlan. `last` receives the
  // handle (kept pending when the wait timed out).
  void RunPrepared(const PreparedRequest& prepared, absl::Duration timeout, py::handle stream,
                   RequestHandle& last) {
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

  // Post + Wait `lat.size()` times in C++ under one GIL release (the
  // benchmark hook behind Plan.run_many): lat[i] is iteration i's round trip,
  // Post() entry to Wait() return on MonotonicNowNs's clock, as
  // stepmesh_perf's worker measures it. Stops at the first failure, whose
  // status names the iteration; `last` is the latest request (pending when its
  // wait timed out).
  void RunPreparedMany(const PreparedRequest& prepared, absl::Duration timeout,
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
      ThrowStatus(absl::Status(s.code(), absl::StrCat("run_many: iteration ", i, " of ", lat.size(),
                                                      ": ", s.message())));
    }
  }

  RequestRef SubmitPrepared(const PreparedRequest& prepared, py::handle stream, const char* what) {
    return Submit(stream, what, [&](AFTensorWorker& node, const SendOptions& options) {
      return node.Post(prepared, options);
    });
  }

  // Submits a request through `post(node, options)` (PushPull or Post);
  // with a stream, its send waits for a ready event recorded on that stream
  // now (the producing kernels enqueued so far).
  template <typename PostFn>
  RequestRef Submit(py::handle stream, const char* what, PostFn&& post,
                    std::optional<uint32_t> stage = std::nullopt) {
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

  py::dict FetchTrace(const RequestRef& request) {
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

  // For stepmesh.Trigger (python/src/trigger_binding.h): the node and its backend.
  AFTensorWorker& node() { return live(); }

 private:
  AFTensorWorker& live() {
    PyParticipant::live();  // raises once closed
    return *worker_;
  }

  // A host wait ended: unless it timed out (the request is still pending), the
  // request's send is over and its ready event may be reused.
  void Finished(RequestHandle h, const absl::Status& s) {
    if (absl::IsDeadlineExceeded(s) || h.index() >= ready_.size()) return;
    ReadyOf& r = ready_[h.index()];
    if (r.event == nullptr || r.generation != h.generation()) return;
    events_->Give(r.event);
    r = ReadyOf{};
  }

  size_t RowBytes(Key key) const {
    auto it = push_regs_.find(key);
    if (it == push_regs_.end()) {
      ThrowStatus(absl::NotFoundError(absl::StrCat("push key ", key, " is not registered")));
    }
    return it->second->row_bytes();
  }

  // int key | (key,) | (key, nbytes) | (key, nbytes, servers) | stepmesh.Push
  Push ParsePush(py::handle item, std::vector<int>& servers) {
    Push push;
    if (PyLong_Check(item.ptr())) {
      push.key = KeyArg(item, "push");
      return push;
    }
    if (PyTuple_Check(item.ptr()) || PyList_Check(item.ptr())) {
      py::sequence seq = py::reinterpret_borrow<py::sequence>(item);
      const size_t len = seq.size();
      if (len < 1 || len > 3) {
        ThrowInvalidArgument("push: expected key, (key, nbytes) or (key, nbytes, servers)");
      }
      push.key = KeyArg(seq[0], "push");
      if (len >= 2 && !seq[1].is_none()) push.bytes = seq[1].cast<size_t>();
      if (len == 3 && !seq[2].is_none()) servers = seq[2].cast<std::vector<int>>();
      return push;
    }
    if (py::hasattr(item, "key") && py::hasattr(item, "rows")) {  // stepmesh.Push
      push.key = KeyArg(item.attr("key"), "push");
      py::object bytes = item.attr("bytes"), rows = item.attr("rows");
      if (!bytes.is_none() && !rows.is_none()) {
        ThrowInvalidArgument(
            absl::StrCat("push of key ", push.key, ": give bytes or rows, not both"));
      }
      if (!bytes.is_none()) push.bytes = bytes.cast<size_t>();
      if (!rows.is_none()) {
        const int64_t r = rows.cast<int64_t>();
        if (r < 0)
          ThrowInvalidArgument(absl::StrCat("push of key ", push.key, ": rows ", r, " < 0"));
        push.bytes = static_cast<size_t>(r) * RowBytes(push.key);
      }
      py::object s = item.attr("servers");
      if (!s.is_none()) servers = s.cast<std::vector<int>>();
      return push;
    }
    ThrowInvalidArgument(absl::StrCat("push: cannot use a ",
                                      std::string(py::str(item.get_type().attr("__name__"))),
                                      " (want int key, tuple or stepmesh.Push)"));
  }

  // The items of a list or tuple by index (the per-call path: no iterator
  // object); any other iterable through the iterator protocol. Each item is
  // referenced while `fn` parses it and the length re-read per item: a
  // stepmesh.Push's attribute lookup may run Python code that edits the list.
  template <typename Fn>
  static void ForEachItem(py::handle seq, Fn&& fn) {
    if (PyList_CheckExact(seq.ptr()) || PyTuple_CheckExact(seq.ptr())) {
      for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq.ptr()); ++i) {
        fn(py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(seq.ptr(), i)));
      }
      return;
    }
    for (py::handle item : seq) fn(item);
  }

  // A pull's server rank: an int (not a bool) that fits an int; the library
  // checks the range against num_servers.
  static int ServerArg(py::handle server, Key key) {
    if (PyBool_Check(server.ptr()) || !PyIndex_Check(server.ptr())) {
      ThrowInvalidArgument(absl::StrCat("pull of key ", key, ": server: expected an int rank, got ",
                                        std::string(py::str(server.get_type().attr("__name__")))));
    }
    // numpy integers too (they have __index__), as pybind11's int caster took them.
    py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(server.ptr()));
    if (!index) throw py::error_already_set();
    int overflow = 0;
    const long v = PyLong_AsLongAndOverflow(index.ptr(), &overflow);
    if (overflow != 0 || v < INT_MIN || v > INT_MAX) {
      ThrowInvalidArgument(absl::StrCat("pull of key ", key, ": server ",
                                        std::string(py::str(server)), " is out of range"));
    }
    return static_cast<int>(v);
  }

  // (key, server) | stepmesh.Pull
  Pull ParsePull(py::handle item) {
    Pull pull;
    if (PyTuple_CheckExact(item.ptr()) && PyTuple_GET_SIZE(item.ptr()) == 2) {
      // The common (key, server) tuple of ints without pybind11's casters;
      // anything unusual in it takes the general path below.
      PyObject* server = PyTuple_GET_ITEM(item.ptr(), 1);
      if (PyLong_CheckExact(server)) {
        int overflow = 0;
        const long v = PyLong_AsLongAndOverflow(server, &overflow);
        if (overflow == 0 && v >= INT_MIN && v <= INT_MAX) {
          pull.key = KeyArg(PyTuple_GET_ITEM(item.ptr(), 0), "pull");
          pull.server = static_cast<int>(v);
          return pull;
        }
      }
    }
    if (PyTuple_Check(item.ptr()) || PyList_Check(item.ptr())) {
      py::sequence seq = py::reinterpret_borrow<py::sequence>(item);
      if (seq.size() != 2) ThrowInvalidArgument("pull: expected (key, server)");
      pull.key = KeyArg(seq[0], "pull");
      pull.server = ServerArg(seq[1], pull.key);
      return pull;
    }
    if (py::hasattr(item, "key") && py::hasattr(item, "server")) {
      pull.key = KeyArg(item.attr("key"), "pull");
      pull.server = ServerArg(item.attr("server"), pull.key);
      return pull;
    }
    ThrowInvalidArgument(absl::StrCat("pull: cannot use a ",
                                      std::string(py::str(item.get_type().attr("__name__"))),
                                      " (want (key, server) or stepmesh.Pull)"));
  }

  // The ready event of a request submitted with a stream (by handle index)
  // and the stream object it was recorded on, held until the send is over.
  struct ReadyOf {
    uint32_t generation = 0;
    Event* event = nullptr;
    py::object stream;
  };

  MeshOptions options_;
  std::vector<ReadyOf> ready_;
  std::unique_ptr<StreamArgs> streams_;
  std::unique_ptr<EventPool> events_;
  // Declared before worker_: destroyed after it, so the memory outlives the mesh.
  std::unordered_map<Key, Registered> push_regs_;
  std::map<std::pair<Key, int>, Registered> pull_regs_;
  std::unique_ptr<AFTensorWorker> worker_;
};

// A request prepared once and posted many times (Worker.prepare): the item
// lists are parsed here once and the request prepared in the library
// (AFTensorWorker::Prepare), so a post does no Python parsing and no lookup,
// and run() posts and waits under a single GIL release without creating a
// Python object. The plan holds no tensor: a key unregistered since makes it
// stale, and the library refuses to post it (FailedPrecondition).
class PyPlan {
 public:
  PyPlan(PyWorker& worker, py::handle pushes, py::handle pulls)
      : worker_(worker),
        prepared_(worker.Prepare(pushes, pulls)),
        pushes_arg_(py::reinterpret_borrow<py::object>(pushes)),
        pulls_arg_(py::reinterpret_borrow<py::object>(pulls)) {
    default_timeout_ = worker.options().timeout;
  }

  RequestRef Post(py::handle stream) {
    Posting posting(*this);
    return worker_.SubmitPrepared(prepared_, stream, "post");
  }

  void Run(py::handle timeout, py::handle stream) {
    const absl::Duration t = timeout.is_none() ? default_timeout_ : TimeoutArg(timeout, {});
    Posting posting(*this);
    worker_.RunPrepared(prepared_, t, stream, last_);
  }

  // Plan.run_many(n, timeout): see PyWorker::RunPreparedMany.
  std::vector<int64_t> RunMany(py::handle n_arg, py::handle timeout) {
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

  // Plan.set_bytes / set_rows: push i's byte count changed in place (no
  // re-parsing, no lookup by key), for requests whose keys stay and whose
  // sizes follow the step's token count. Checked here against the tensor
  // registered at preparation, so a bad count fails at the call that set it.
  // A request already posted is unaffected (Post copies the counts).
  void SetBytes(size_t i, py::handle bytes_arg) {
    CheckWritable("set_bytes");
    CheckPushIndex(i, "set_bytes");
    if (PyBool_Check(bytes_arg.ptr()) || !PyLong_Check(bytes_arg.ptr())) {
      ThrowInvalidArgument(absl::StrCat("set_bytes: push ", i, " (key ", prepared_.push_key(i),
                                        "): bytes: expected an int"));
    }
    const long long b = PyLong_AsLongLong(bytes_arg.ptr());
    if (PyErr_Occurred()) PyErr_Clear();
    SetPushBytes(i, b, std::string(py::str(bytes_arg)), "set_bytes", "bytes");
  }
  void SetRows(size_t i, py::handle rows_arg) {
    CheckWritable("set_rows");
    CheckPushIndex(i, "set_rows");
    if (PyBool_Check(rows_arg.ptr()) || !PyLong_Check(rows_arg.ptr())) {
      ThrowInvalidArgument(absl::StrCat("set_rows: push ", i, " (key ", prepared_.push_key(i),
                                        "): rows: expected an int"));
    }
    const long long r = PyLong_AsLongLong(rows_arg.ptr());
    if (PyErr_Occurred()) PyErr_Clear();
    const TensorView tensor = prepared_.push_tensor(i);
    const int64_t rows = tensor.shape.rank() > 0 ? tensor.shape[0] : 1;
    const size_t row_bytes = rows > 0 ? tensor.bytes() / static_cast<size_t>(rows) : 0;
    const long long max_rows = row_bytes == 0 ? 0 : static_cast<long long>(rows);
    if (r < 0 || r > max_rows) {
      ThrowInvalidArgument(absl::StrCat("set_rows: push ", i, " (key ", prepared_.push_key(i),
                                        "): rows = ", std::string(py::str(rows_arg)),
                                        " is not in [0, ", max_rows, "]"));
    }
    ThrowIfError(prepared_.SetBytes(i, static_cast<size_t>(r) * row_bytes));
  }
  size_t bytes(size_t i) const {
    CheckPushIndex(i, "bytes");
    return prepared_.bytes(i);
  }

  std::optional<RequestRef> last() const {
    if (!last_.valid()) return std::nullopt;
    return RequestRef{last_};
  }
  size_t num_pushes() const { return prepared_.num_pushes(); }
  size_t num_pulls() const { return prepared_.num_pulls(); }
  // Plan.trigger_target(): the request as it stands now (its byte counts
  // included), prepared afresh for the trigger's thread to post, so later
  // set_bytes/set_rows on this plan do not race the trigger.
  TriggerTarget TriggerTargetNow() {
    auto frozen = std::make_shared<PreparedRequest>(worker_.Prepare(pushes_arg_, pulls_arg_));
    for (size_t i = 0; i < prepared_.num_pushes(); ++i) {
      ThrowIfError(frozen->SetBytes(i, prepared_.bytes(i)));
    }
    return PreparedTriggerTarget(worker_.node(), std::move(frozen));
  }

 private:
  static constexpr long long kMaxRunMany = 10'000'000;

  // Counts the calls that read the prepared request with the GIL released
  // (post, run, run_many, from any thread); set_rows/set_bytes, which hold
  // the GIL, refuse to write it meanwhile.
  struct Posting {
    explicit Posting(PyPlan& p) : plan(p) { ++plan.posting_; }
    ~Posting() { --plan.posting_; }
    PyPlan& plan;
  };

  void CheckWritable(const char* what) const {
    if (posting_ > 0) {
      ThrowStatus(absl::FailedPreconditionError(absl::StrCat(
          what, ": the plan is being posted by another thread (change it between posts)")));
    }
  }
  void CheckPushIndex(size_t i, const char* what) const {
    if (i >= prepared_.num_pushes()) {
      ThrowInvalidArgument(
          absl::StrCat(what, ": push index ", i, " is not in [0, ", prepared_.num_pushes(), ")"));
    }
  }
  void SetPushBytes(size_t i, long long b, const std::string& shown, const char* what,
                    const char* name) {
    const size_t registered = prepared_.registered_bytes(i);
    if (b < 0 || static_cast<unsigned long long>(b) > registered) {
      ThrowInvalidArgument(absl::StrCat(what, ": push ", i, " (key ", prepared_.push_key(i),
                                        "): ", name, " = ", shown, " is not in [0, ", registered,
                                        "] (the registered tensor)"));
    }
    ThrowIfError(prepared_.SetBytes(i, static_cast<size_t>(b)));
  }

  PyWorker& worker_;  // kept alive by the Python plan object (keep_alive)
  PreparedRequest prepared_;
  py::object pushes_arg_;  // as given: trigger_target prepares them again
  py::object pulls_arg_;
  absl::Duration default_timeout_;
  RequestHandle last_;
  int posting_ = 0;  // Posting scopes in progress (read and written holding the GIL)
};

// ---------------------------------------------------------------- server

struct PyBatchTensor {
  Key key = 0;
  size_t slot_bytes = 0;
  std::vector<size_t> valid_bytes;  // per worker rank
  Registered owner;
  TensorSlice Part(int worker) const {
    if (worker < 0 || static_cast<size_t>(worker) >= valid_bytes.size()) {
      ThrowInvalidArgument(
          absl::StrCat("worker ", worker, " out of range [0, ", valid_bytes.size(), ")"));
    }
    return SliceOf(owner, key, worker, slot_bytes, valid_bytes[worker]);
  }
};

struct PyBatch {
  Batch batch;  // its spans are only used by Respond (which reads the handle)
  Key group = 0;
  std::vector<int> workers;
  std::vector<std::optional<Key>> pull_keys;
  std::vector<PyBatchTensor> tensors;
  bool answered = false;

  const PyBatchTensor& TensorFor(py::handle key_arg) const {
    const Key key = KeyArg(key_arg, "batch tensor");
    for (const PyBatchTensor& t : tensors) {
      if (t.key == key) return t;
    }
    ThrowStatus(absl::NotFoundError(absl::StrCat("key ", key, " is not in this batch")));
  }
};

class PyServer : public PyParticipant {
 public:
  explicit PyServer(MeshOptions options, std::shared_ptr<RendezvousStore> store = nullptr)
      : PyParticipant("server"), options_(std::move(options)) {
    options_.role = Role::kServer;
    absl::StatusOr<std::unique_ptr<AFTensorServer>> server;
    {
      py::gil_scoped_release release;
      server = store != nullptr ? CreateServerWithStore(options_, std::move(store))
                                : AFTensorServer::Create(options_);
    }
    server_ = ValueOrThrow(std::move(server));
    Attach(server_.get());
    streams_ = std::make_unique<StreamArgs>(server_->backend());
    events_ = std::make_unique<EventPool>(server_->backend());
  }

  ~PyServer() {
    {
      py::gil_scoped_release release;
      (void)server_->Shutdown();  // the send thread no longer reads ready events
    }
    group_ready_.clear();  // stream references (GIL held)
    {
      py::gil_scoped_release release;
      events_.reset();  // before the backend that made them
      streams_.reset();
      server_.reset();
    }
    recv_regs_.clear();
    reply_regs_.clear();
  }

  int num_workers() { return live().num_workers(); }
  const MeshOptions& options() const { return options_; }

  void RegisterRecv(py::handle key_arg, py::handle tensor) {
    const Key key = KeyArg(key_arg, "register_recv");
    Registered t = ImportTensor(tensor, absl::StrCat("receive tensor for key ", key));
    absl::Status s;
    auto& node = live();  // may raise: do it holding the GIL
    {
      py::gil_scoped_release release;
      s = node.RegisterRecvTensor(key, t->view());
    }
    ThrowIfError(s);
    recv_regs_[key] = std::move(t);
  }

  void RegisterReply(py::handle key_arg, py::handle tensor) {
    const Key key = KeyArg(key_arg, "register_reply");
    Registered t = ImportTensor(tensor, absl::StrCat("reply tensor for key ", key));
    absl::Status s;
    auto& node = live();  // may raise: do it holding the GIL
    {
      py::gil_scoped_release release;
      s = node.RegisterReplyTensor(key, t->view());
    }
    ThrowIfError(s);
    reply_regs_[key] = std::move(t);
  }

  void Unregister(py::handle key_arg) {
    const Key key = KeyArg(key_arg, "unregister");
    absl::Status s;
    auto& node = live();  // may raise: do it holding the GIL
    {
      py::gil_scoped_release release;
      s = node.Unregister(key);
    }
    ThrowIfError(s);
    recv_regs_.erase(key);
    reply_regs_.erase(key);
  }

  PyBatch GetBatch(py::handle timeout, py::handle policy_arg) {
    BatchPolicy policy = BatchPolicy::kAllWorkers;
    if (!policy_arg.is_none()) {  // None or "all" (the default) cost no string conversion
      const std::string policy_name = py::str(policy_arg);
      if (policy_name == "deadline") {
        policy = BatchPolicy::kReadyByDeadline;
      } else if (policy_name != "all") {
        ThrowInvalidArgument(absl::StrCat("policy '", policy_name, "' (want 'all' or 'deadline')"));
      }
    }
    const absl::Duration t = TimeoutArg(timeout, options_.timeout);
    absl::StatusOr<Batch> got;
    auto& node = live();  // may raise: do it holding the GIL
    {
      py::gil_scoped_release release;
      got = node.GetBatch(t, policy);
    }
    PyBatch out;
    out.batch = ValueOrThrow(std::move(got));
    out.group = out.batch.group;
    out.workers.assign(out.batch.workers.begin(), out.batch.workers.end());
    out.pull_keys.reserve(out.batch.pull_keys.size());
    out.tensors.reserve(out.batch.tensors.size());
    for (Key k : out.batch.pull_keys) {
      out.pull_keys.push_back(k == Batch::kNoPull ? std::nullopt : std::optional<Key>(k));
    }
    for (const BatchTensor& bt : out.batch.tensors) {
      PyBatchTensor t;
      t.key = bt.key;
      t.slot_bytes = bt.slot_bytes;
      t.valid_bytes.assign(bt.valid_bytes.begin(), bt.valid_bytes.end());
      auto it = recv_regs_.find(bt.key);
      if (it == recv_regs_.end()) {
        // Registered through another path than this object: cannot happen here.
        ThrowStatus(
            absl::InternalError(absl::StrCat("batch key ", bt.key, " has no registration")));
      }
      t.owner = it->second;
      out.tensors.push_back(std::move(t));
    }
    return out;
  }

  PyStream* CreateStream() { return new PyStream(ValueOrThrow(live().backend().CreateStream())); }

  void StreamWaitCounter(uintptr_t counter, uintptr_t target, py::handle stream) {
    live();
    streams_->WaitCounter(stream, counter, target);
  }

  void StreamWaitNextBatch(py::handle stream) {
    auto& node = live();
    if (stream.is_none()) ThrowInvalidArgument("stream_wait_next_batch: stream is None");
    py::object keep;
    Stream* s = streams_->Resolve(stream, "stream_wait_next_batch", keep);
    ThrowIfError(node.StreamWaitNextBatch(*s));
  }

  void Respond(PyBatch& batch, py::handle rows, py::handle nbytes, py::handle stream) {
    if (batch.answered) {
      ThrowStatus(absl::FailedPreconditionError("batch already answered"));
    }
    // Only a call with rows= or bytes= fills the map (no allocation otherwise).
    std::map<int, size_t> explicit_bytes;
    auto collect = [&](py::handle mapping, bool in_rows) {
      if (mapping.is_none()) return;
      if (!PyDict_Check(mapping.ptr())) {
        ThrowInvalidArgument(
            absl::StrCat(in_rows ? "rows" : "bytes", ": expected {worker: count}"));
      }
      for (const auto& [w_obj, n_obj] : py::reinterpret_borrow<py::dict>(mapping)) {
        const int w = w_obj.cast<int>();
        const int64_t n = n_obj.cast<int64_t>();
        if (n < 0) ThrowInvalidArgument(absl::StrCat("reply to worker ", w, ": negative count"));
        if (explicit_bytes.count(w) != 0) {
          ThrowInvalidArgument(
              absl::StrCat("reply to worker ", w, " given as both rows and bytes"));
        }
        size_t b = static_cast<size_t>(n);
        if (in_rows) b *= ReplyRowBytes(batch, w);
        explicit_bytes[w] = b;
      }
    };
    collect(rows, true);
    collect(nbytes, false);
    std::vector<Reply>& replies = replies_;  // reused: no allocation per batch
    replies.clear();
    for (size_t i = 0; i < batch.workers.size(); ++i) {
      const int w = batch.workers[i];
      auto it = explicit_bytes.find(w);
      if (it != explicit_bytes.end()) {
        replies.push_back({w, it->second});
        explicit_bytes.erase(it);
      } else if (batch.pull_keys[i].has_value()) {
        replies.push_back({w, kWholeTensor});
      }
    }
    // Replies to workers outside the batch: the library names the mistake.
    for (const auto& [w, b] : explicit_bytes) replies.push_back({w, b});
    auto& node = live();  // may raise: do it holding the GIL
    py::object keep;
    Stream* st = streams_->Resolve(stream, "respond", keep);
    Event* ready = st == nullptr ? nullptr : ReadyFor(batch.group);
    absl::Status s;
    {
      py::gil_scoped_release release;
      if (ready == nullptr) {
        s = node.Respond(batch.batch, replies);
      } else {
        s = ready->Record(*st);
        if (s.ok())
          s = node.Respond(batch.batch, replies, SendOptions{.ready = ready, .stage = {}});
      }
    }
    if (ready != nullptr) group_ready_[batch.group].stream = std::move(keep);
    ThrowIfError(s);
    batch.answered = true;
  }

  TensorSlice Slot(py::handle key_arg, int worker, bool reply) {
    const Key key = KeyArg(key_arg, reply ? "reply_slot" : "recv_slot");
    auto& regs = reply ? reply_regs_ : recv_regs_;
    auto it = regs.find(key);
    if (it == regs.end()) {
      ThrowStatus(absl::NotFoundError(
          absl::StrCat(reply ? "reply" : "receive", " key ", key, " is not registered")));
    }
    const int n = live().num_workers();
    if (worker < 0 || worker >= n) {
      ThrowInvalidArgument(absl::StrCat("worker ", worker, " out of range [0, ", n, ")"));
    }
    const size_t slot_bytes = it->second->view().bytes() / n;
    return SliceOf(it->second, key, worker, slot_bytes, slot_bytes);
  }

 private:
  AFTensorServer& live() {
    PyParticipant::live();  // raises once closed
    return *server_;
  }

  // The ready event for a reply to micro-batch `group`. A batch of the same
  // group arrives only after each of its workers got the previous reply of
  // that group (a key is in one request at a time), so that reply's send is
  // over and its event may be recorded again; one still pending (a worker
  // left meanwhile) is left alone and a fresh event taken.
  Event* ReadyFor(Key group) {
    GroupReady& g = group_ready_[group];
    if (g.event != nullptr) {
      absl::StatusOr<bool> reached = g.event->Query();
      if (reached.ok() && *reached) return g.event;
    }
    g.event = events_->Take();
    return g.event;
  }

  size_t ReplyRowBytes(const PyBatch& batch, int worker) const {
    for (size_t i = 0; i < batch.workers.size(); ++i) {
      if (batch.workers[i] != worker) continue;
      if (!batch.pull_keys[i].has_value()) {
        ThrowInvalidArgument(absl::StrCat("worker ", worker, " pulled nothing from this server"));
      }
      auto it = reply_regs_.find(*batch.pull_keys[i]);
      if (it == reply_regs_.end()) {
        ThrowStatus(
            absl::NotFoundError(absl::StrCat("worker ", worker, " pulls key ", *batch.pull_keys[i],
                                             ", which has no reply tensor here")));
      }
      return it->second->row_bytes();
    }
    ThrowInvalidArgument(absl::StrCat("reply to worker ", worker, " which is not in this batch"));
  }

  MeshOptions options_;
  std::vector<Reply> replies_;  // Respond's scratch
  struct GroupReady {
    Event* event = nullptr;
    py::object stream;  // what it was last recorded on
  };
  std::unordered_map<Key, GroupReady> group_ready_;
  std::unique_ptr<StreamArgs> streams_;
  std::unique_ptr<EventPool> events_;
  std::unordered_map<Key, Registered> recv_regs_;
  std::unordered_map<Key, Registered> reply_regs_;
  std::unique_ptr<AFTensorServer> server_;
};

// ---------------------------------------------------------------- scheduler

class PyScheduler {
 public:
  explicit PyScheduler(MeshOptions options) {
    options.role = Role::kScheduler;
    absl::StatusOr<std::unique_ptr<Scheduler>> started;
    {
      py::gil_scoped_release release;
      started = Scheduler::Start(options);
    }
    scheduler_ = ValueOrThrow(std::move(started));
    timeout_ = options.timeout;
  }
  ~PyScheduler() {
    py::gil_scoped_release release;
    scheduler_.reset();
  }
  std::string address() const { return scheduler_->address(); }
  void WaitUntilDone(py::handle timeout) {
    const absl::Duration t = TimeoutArg(timeout, timeout_);
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = scheduler_->WaitUntilDone(t);
    }
    ThrowIfError(s);
  }
  void WaitForParticipants() {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = scheduler_->WaitForParticipants();
    }
    ThrowIfError(s);
  }
  void Stop() {
    py::gil_scoped_release release;
    scheduler_->Stop();
  }

 private:
  std::unique_ptr<Scheduler> scheduler_;
  absl::Duration timeout_;
};

}  // namespace

void BindMesh(py::module_& m) {
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

  py::class_<TensorSlice>(m, "TensorSlice", R"doc(
A zero-copy view of registered memory (a worker's part of a batch, or a slot
of a registered region). Any DLPack consumer takes it: np.from_dlpack(s),
torch.utils.dlpack.from_dlpack(s). The memory stays alive while a view exists;
its contents are only meaningful until the batch is answered.)doc")
      .def(
          "__dlpack__",
          [](const TensorSlice& s, py::handle /*stream*/) { return ExportView(s.view, s.owner); },
          py::arg("stream") = py::none())
      .def("__dlpack_device__", [](const TensorSlice& s) { return DlpackDevice(s.view.device); })
      .def(
          "numpy", [](const TensorSlice& s) { return NumpyView(s.view, s.owner); },
          "A writable numpy view (host memory, numpy dtypes).")
      .def_property_readonly("key", [](const TensorSlice& s) { return s.key; })
      .def_property_readonly("worker", [](const TensorSlice& s) { return s.worker; })
      .def_property_readonly("valid_bytes", [](const TensorSlice& s) { return s.valid_bytes; })
      .def_property_readonly("rows", [](const TensorSlice& s) { return s.rows; })
      .def_property_readonly("shape", [](const TensorSlice& s) { return ShapeTuple(s.view.shape); })
      .def_property_readonly("dtype",
                             [](const TensorSlice& s) { return DTypeString(s.view.dtype); })
      .def_property_readonly("device",
                             [](const TensorSlice& s) { return DeviceName(s.view.device); })
      .def_property_readonly(
          "data_ptr", [](const TensorSlice& s) { return reinterpret_cast<uintptr_t>(s.view.data); })
      .def("__repr__", [](const TensorSlice& s) {
        return absl::StrCat("TensorSlice(key=", s.key, ", worker=", s.worker, ", rows=", s.rows,
                            ", valid_bytes=", s.valid_bytes, ", shape=", s.view.shape.ToString(),
                            ", dtype=", DTypeName(s.view.dtype), ")");
      });

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

  py::class_<PyWorker> worker(m, "Worker", R"doc(
The attention side (C++ AFTensorWorker). Worker(options=None, **fields)
connects to the scheduler and every server (blocking, GIL released).)doc");
  worker
      .def(py::init([](py::handle options, const py::kwargs& kwargs) {
             auto [fields, store] = SplitStore(kwargs);
             return std::make_unique<PyWorker>(OptionsFrom(options, fields), std::move(store));
           }),
           py::arg("options") = py::none())
      .def_property_readonly("num_servers", &PyWorker::num_servers)
      .def_property_readonly("options", &PyWorker::options)
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
      .def("stream_wait_counter", &PyWorker::StreamWaitCounter, py::arg("counter"),
           py::arg("target"), py::arg("stream"),
           "Later work on `stream` waits until the int64 at address `counter` >= the one at "
           "`target` "
           "(both read when the stream gets there: graph-safe on CUDA, a one-thread kernel).")
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
      .def("create_stream", &PyWorker::CreateStream, py::keep_alive<0, 1>(),
           "A stream of this worker's backend (cpu_mock: a host thread).")
      .def("test", &PyWorker::Test, py::arg("request"))
      .def("fetch_trace", &PyWorker::FetchTrace, py::arg("request"));
  DefParticipant(worker);

  py::class_<PyServer> server(m, "Server", R"doc(
The FFN side (C++ AFTensorServer). Server(options=None, **fields) joins the mesh
(blocking, GIL released).)doc");
  server
      .def(py::init([](py::handle options, const py::kwargs& kwargs) {
             auto [fields, store] = SplitStore(kwargs);
             return std::make_unique<PyServer>(OptionsFrom(options, fields), std::move(store));
           }),
           py::arg("options") = py::none())
      .def_property_readonly("num_workers", &PyServer::num_workers)
      .def_property_readonly("options", &PyServer::options)
      .def("register_recv", &PyServer::RegisterRecv, py::arg("key"), py::arg("tensor"))
      .def("register_reply", &PyServer::RegisterReply, py::arg("key"), py::arg("tensor"))
      .def("unregister", &PyServer::Unregister, py::arg("key"))
      .def("get_batch", &PyServer::GetBatch, py::arg("timeout") = py::none(),
           py::arg("policy") = py::none())
      .def("respond", &PyServer::Respond, py::arg("batch"), py::arg("rows") = py::none(),
           py::arg("bytes") = py::none(), py::arg("stream") = py::none(),
           "stream: None, a stepmesh.Stream or an int cudaStream_t; the replies are sent\n"
           "once the work enqueued on it so far ran (a ready event), without blocking.")
      .def("stream_wait_counter", &PyServer::StreamWaitCounter, py::arg("counter"),
           py::arg("target"), py::arg("stream"),
           "Later work on `stream` waits until the int64 at address `counter` >= the one at "
           "`target` "
           "(both read when the stream gets there: graph-safe on CUDA, a one-thread kernel).")
      .def("stream_wait_next_batch", &PyServer::StreamWaitNextBatch, py::arg("stream"),
           "The stream waits for the next complete batch, counted on the device (pair each\n"
           "with one get_batch()).")
      .def("create_stream", &PyServer::CreateStream, py::keep_alive<0, 1>(),
           "A stream of this server's backend (cpu_mock: a host thread).")
      .def(
          "recv_slot", [](PyServer& s, py::handle key, int w) { return s.Slot(key, w, false); },
          py::arg("key"), py::arg("worker"))
      .def(
          "reply_slot", [](PyServer& s, py::handle key, int w) { return s.Slot(key, w, true); },
          py::arg("key"), py::arg("worker"));
  DefParticipant(server);

  py::class_<PyScheduler> scheduler(m, "Scheduler", R"doc(
The rendezvous service, in this process. Scheduler(options=None, **fields);
the default address is 127.0.0.1:0 (a free port: read .address).)doc");
  scheduler
      .def(py::init([](py::handle options, const py::kwargs& kwargs) {
             MeshOptions o = OptionsFrom(options, kwargs);
             if (options.is_none() && !kwargs.contains("scheduler")) o.scheduler = "127.0.0.1:0";
             return std::make_unique<PyScheduler>(std::move(o));
           }),
           py::arg("options") = py::none())
      .def_property_readonly("address", &PyScheduler::address)
      .def("wait_until_done", &PyScheduler::WaitUntilDone, py::arg("timeout") = py::none())
      .def("wait_for_participants", &PyScheduler::WaitForParticipants,
           "Waits while the participants run, however long (Scheduler::WaitForParticipants)")
      .def("stop", &PyScheduler::Stop)
      .def("close", &PyScheduler::Stop);
  scheduler.def("__enter__", [](py::object self) { return self; });
  scheduler.def("__exit__", [](PyScheduler& self, py::handle, py::handle, py::handle) {
    self.Stop();
    return false;
  });
}

}  // namespace stepmesh::python
