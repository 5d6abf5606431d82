#include "python/src/server_binding.h"

#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "python/src/batch_binding.h"
#include "python/src/binding_args.h"
#include "python/src/dlpack_tensor.h"
#include "python/src/errors.h"
#include "python/src/options_binding.h"
#include "python/src/participant_binding.h"
#include "python/src/store_binding.h"
#include "python/src/stream_binding.h"
#include "python/src/tensor_slice_binding.h"
#include "stepmesh/options.h"
#include "stepmesh/rendezvous_store.h"
#include "stepmesh/server.h"

namespace stepmesh::python {
namespace py = pybind11;

namespace {

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

}  // namespace

void BindServer(py::module_& m) {
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
}

}  // namespace stepmesh::python
