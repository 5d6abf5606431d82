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
#include "python/src/gil.h"
#include "python/src/options_binding.h"
#include "python/src/participant_binding.h"
#include "python/src/participant_node.h"
#include "python/src/store_binding.h"
#include "python/src/stream_binding.h"
#include "python/src/tensor_slice_binding.h"
#include "stepmesh/options.h"
#include "stepmesh/rendezvous_store.h"
#include "stepmesh/server.h"

namespace stepmesh::python {
namespace py = pybind11;

namespace {

class PyServer : public PyNode<AFTensorServer> {
 public:
  explicit PyServer(MeshOptions options, std::shared_ptr<RendezvousStore> store = nullptr)
      : PyNode("server", Role::kServer, std::move(options), [&](const MeshOptions& o) {
          return store != nullptr ? CreateServerWithStore(o, std::move(store))
                                  : AFTensorServer::Create(o);
        }) {}

  ~PyServer() {
    TearDown([&] { group_ready_.clear(); });
    recv_regs_.clear();
    reply_regs_.clear();
  }

  int num_workers() { return live().num_workers(); }

  // register_recv (reply = false) / register_reply (reply = true).
  void Register(py::handle key_arg, py::handle tensor, bool reply) {
    const Key key = KeyArg(key_arg, reply ? "register_reply" : "register_recv");
    Registered t =
        ImportTensor(tensor, absl::StrCat(reply ? "reply" : "receive", " tensor for key ", key));
    auto& node = live();  // may raise: do it holding the GIL
    CallReleased([&] {
      return reply ? node.RegisterReplyTensor(key, t->view())
                   : node.RegisterRecvTensor(key, t->view());
    });
    (reply ? reply_regs_ : recv_regs_)[key] = std::move(t);
  }

  void Unregister(py::handle key_arg) {
    const Key key = KeyArg(key_arg, "unregister");
    auto& node = live();  // may raise: do it holding the GIL
    CallReleased([&] { return node.Unregister(key); });
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

  void StreamWaitNextBatch(py::handle stream) {
    auto& node = live();
    if (stream.is_none()) ThrowInvalidArgument("stream_wait_next_batch: stream is None");
    py::object keep;
    Stream* s = streams_->Resolve(stream, "stream_wait_next_batch", keep);
    ThrowIfError(node.StreamWaitNextBatch(*s));
  }

  void Respond(PyBatch& batch, py::handle rows, py::handle nbytes, py::handle stream,
               py::handle offsets) {
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
    // offsets={worker: row}: where in the reply region that worker's reply starts
    // (rows of the reply tensor), e.g. replies packed back to back. Kept per
    // worker rank in a member sized once (the connector passes it every batch).
    const bool with_offsets = !offsets.is_none();
    size_t offsets_left = 0;
    if (with_offsets) {
      offset_bytes_.assign(static_cast<size_t>(num_workers()), Reply::kSlot);
      if (!PyDict_Check(offsets.ptr())) ThrowInvalidArgument("offsets: expected {worker: row}");
      for (const auto& [w_obj, r_obj] : py::reinterpret_borrow<py::dict>(offsets)) {
        const int w = w_obj.cast<int>();
        const int64_t r = r_obj.cast<int64_t>();
        if (r < 0) ThrowInvalidArgument(absl::StrCat("offsets: worker ", w, ": negative row"));
        const size_t row_bytes = ReplyRowBytes(batch, w);  // w is in the batch (or it raises)
        offset_bytes_[static_cast<size_t>(w)] = static_cast<size_t>(r) * row_bytes;
        ++offsets_left;
      }
    }
    auto offset_of = [&](int w) {
      if (!with_offsets || w < 0 || static_cast<size_t>(w) >= offset_bytes_.size())
        return Reply::kSlot;
      size_t& b = offset_bytes_[static_cast<size_t>(w)];
      const size_t out = b;
      if (b != Reply::kSlot) --offsets_left;
      b = Reply::kSlot;
      return out;
    };
    std::vector<Reply>& replies = replies_;  // reused: no allocation per batch
    replies.clear();
    for (size_t i = 0; i < batch.workers.size(); ++i) {
      const int w = batch.workers[i];
      auto it = explicit_bytes.find(w);
      if (it != explicit_bytes.end()) {
        replies.push_back({w, it->second, offset_of(w)});
        explicit_bytes.erase(it);
      } else if (batch.pull_keys[i].has_value()) {
        replies.push_back({w, kWholeTensor, offset_of(w)});
      }
    }
    // Replies to workers outside the batch: the library names the mistake.
    for (const auto& [w, b] : explicit_bytes) replies.push_back({w, b, offset_of(w)});
    if (offsets_left != 0) {  // a worker of the batch that only pushed
      for (size_t w = 0; w < offset_bytes_.size(); ++w) {
        if (offset_bytes_[w] != Reply::kSlot) {
          ThrowInvalidArgument(
              absl::StrCat("offsets: worker ", w, " gets no reply from this batch"));
        }
      }
    }
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

  std::vector<Reply> replies_;        // Respond's scratch
  std::vector<size_t> offset_bytes_;  // and its offsets, per worker rank
  struct GroupReady {
    Event* event = nullptr;
    py::object stream;  // what it was last recorded on
  };
  std::unordered_map<Key, GroupReady> group_ready_;
  std::unordered_map<Key, Registered> recv_regs_;
  std::unordered_map<Key, Registered> reply_regs_;
};

}  // namespace

void BindServer(py::module_& m) {
  py::class_<PyServer> server(m, "Server", R"doc(
The FFN side (C++ AFTensorServer). Server(options=None, **fields) joins the mesh
(blocking, GIL released).)doc");
  server.def_property_readonly("num_workers", &PyServer::num_workers)
      .def(
          "register_recv",
          [](PyServer& s, py::handle key, py::handle t) { s.Register(key, t, false); },
          py::arg("key"), py::arg("tensor"))
      .def(
          "register_reply",
          [](PyServer& s, py::handle key, py::handle t) { s.Register(key, t, true); },
          py::arg("key"), py::arg("tensor"))
      .def("unregister", &PyServer::Unregister, py::arg("key"))
      .def("get_batch", &PyServer::GetBatch, py::arg("timeout") = py::none(),
           py::arg("policy") = py::none())
      .def("respond", &PyServer::Respond, py::arg("batch"), py::arg("rows") = py::none(),
           py::arg("bytes") = py::none(), py::arg("stream") = py::none(),
           py::arg("offsets") = py::none(),
           "stream: None, a stepmesh.Stream or an int cudaStream_t; the replies are sent\n"
           "once the work enqueued on it so far ran (a ready event), without blocking.\n"
           "offsets: {worker: row} where a worker's reply starts in the reply region\n"
           "(default: its slot), e.g. replies packed back to back.")
      .def("stream_wait_next_batch", &PyServer::StreamWaitNextBatch, py::arg("stream"),
           "The stream waits for the next complete batch, counted on the device (pair each\n"
           "with one get_batch()).")
      .def(
          "recv_slot", [](PyServer& s, py::handle key, int w) { return s.Slot(key, w, false); },
          py::arg("key"), py::arg("worker"))
      .def(
          "reply_slot", [](PyServer& s, py::handle key, int w) { return s.Slot(key, w, true); },
          py::arg("key"), py::arg("worker"));
  DefNode(server, "server");
}

}  // namespace stepmesh::python
