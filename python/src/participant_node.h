#pragma once
// The C++ participant a stepmesh.Worker or stepmesh.Server binding owns, and
// the streams and ready events made on its backend: created, and torn down in
// the order both need, once here. The GIL is released around the creation and
// around everything in the teardown that stops threads.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "python/src/errors.h"
#include "python/src/gil.h"
#include "python/src/options_binding.h"
#include "python/src/participant_binding.h"
#include "python/src/store_binding.h"
#include "python/src/stream_binding.h"
#include "stepmesh/options.h"
#include "stepmesh/rendezvous_store.h"

namespace stepmesh::python {

template <typename Node>
class PyNode : public PyParticipant {
 public:
  const MeshOptions& options() const { return options_; }
  PyStream* CreateStream() { return new PyStream(ValueOrThrow(live().backend().CreateStream())); }
  void StreamWaitCounter(uintptr_t counter, uintptr_t target, pybind11::handle stream) {
    live();
    streams_->WaitCounter(stream, counter, target);
  }

 protected:
  // `make(options)` creates the node, with options.role = `role`; `name`
  // names it in errors ("worker", "server").
  template <typename Make>
  PyNode(const char* name, Role role, MeshOptions options, Make make)
      : PyParticipant(name), options_(std::move(options)) {
    options_.role = role;
    node_ = MakeReleased([&] { return make(options_); });
    Attach(node_.get());
    streams_ = std::make_unique<StreamArgs>(node_->backend());
    events_ = std::make_unique<EventPool>(node_->backend());
  }
  ~PyNode() = default;

  // The derived destructor's first step, before its registrations go: shuts
  // the node down (the send thread no longer reads ready events), runs
  // `drop_stream_refs` with the GIL held (the stream objects that events were
  // recorded on), then drops the events before the backend that made them,
  // the streams and the node.
  template <typename DropRefs>
  void TearDown(DropRefs drop_stream_refs) {
    {
      pybind11::gil_scoped_release release;
      (void)node_->Shutdown();
    }
    drop_stream_refs();
    {
      pybind11::gil_scoped_release release;
      events_.reset();
      streams_.reset();
      node_.reset();  // stops the threads
    }
  }

  // Raises FAILED_PRECONDITION once closed (hold the GIL).
  Node& live() {
    PyParticipant::live();
    return *node_;
  }

  MeshOptions options_;
  std::unique_ptr<StreamArgs> streams_;
  std::unique_ptr<EventPool> events_;

 private:
  std::unique_ptr<Node> node_;
};

// What Py (a PyNode<...>) binds alike: the constructor Py(options=None,
// **fields), options, stream_wait_counter, create_stream, and the
// participant's methods (DefParticipant). `role` names it in the docs.
template <typename Py>
void DefNode(pybind11::class_<Py>& cls, const std::string& role) {
  namespace py = pybind11;
  cls.def(py::init([](py::handle options, const py::kwargs& kwargs) {
            auto [fields, store] = SplitStore(kwargs);
            return std::make_unique<Py>(OptionsFrom(options, fields), std::move(store));
          }),
          py::arg("options") = py::none())
      .def_property_readonly("options", &Py::options)
      .def("stream_wait_counter", &Py::StreamWaitCounter, py::arg("counter"), py::arg("target"),
           py::arg("stream"),
           "Later work on `stream` waits until the int64 at address `counter` >= the one at "
           "`target` (both read when the stream gets there: graph-safe on CUDA, a one-thread "
           "kernel).")
      .def("create_stream", &Py::CreateStream, py::keep_alive<0, 1>(),
           ("A stream of this " + role + "'s backend (cpu_mock: a host thread).").c_str());
  DefParticipant(cls);
}

}  // namespace stepmesh::python
