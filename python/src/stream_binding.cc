#include "python/src/stream_binding.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "python/src/binding_args.h"
#include "python/src/errors.h"
#include "stepmesh/cuda.h"

namespace stepmesh::python {
namespace py = pybind11;

PyStream::~PyStream() {
  py::gil_scoped_release release;
  stream_.reset();
}

Stream* StreamArgs::Resolve(py::handle arg, const char* what, py::object& keep) {
  if (arg.is_none()) return nullptr;
  if (py::isinstance<PyStream>(arg)) {
    keep = py::reinterpret_borrow<py::object>(arg);
    return &arg.cast<PyStream&>().stream();
  }
  const uint64_t value = UnsignedIntArg(
      arg, what, "stream must be None, a stepmesh.Stream or an int cudaStream_t, got a ", "stream",
      "is not a cudaStream_t value");
  const uintptr_t native = static_cast<uintptr_t>(value);
  auto it = wrapped_.find(native);
  if (it != wrapped_.end()) return it->second.get();
  if (backend_.name() != "cuda") {
    ThrowInvalidArgument(
        absl::StrCat(what, ": stream=", value, " is a cudaStream_t, but this node's backend is '",
                     std::string(backend_.name()),
                     "' (use backend='cuda', or a stepmesh.Stream from create_stream())"));
  }
  if (wrapped_.size() >= kMaxWrapped) {
    ThrowStatus(absl::ResourceExhaustedError(absl::StrCat(
        what, ": more than ", kMaxWrapped, " distinct CUDA streams passed as stream=")));
  }
  std::unique_ptr<Stream> stream =
      ValueOrThrow(WrapCudaStream(backend_, reinterpret_cast<void*>(native)));
  Stream* out = stream.get();
  wrapped_.emplace(native, std::move(stream));
  return out;
}

void StreamArgs::WaitCounter(py::handle stream, uintptr_t counter, uintptr_t target) {
  if (stream.is_none()) ThrowInvalidArgument("stream_wait_counter: stream is None");
  if (counter == 0 || target == 0) {
    ThrowInvalidArgument(absl::StrCat("stream_wait_counter: ", counter == 0 ? "counter" : "target",
                                      " is a null address"));
  }
  py::object keep;
  Stream* s = Resolve(stream, "stream_wait_counter", keep);
  ThrowIfError(s->WaitCounterAtLeast(reinterpret_cast<const int64_t*>(counter),
                                     reinterpret_cast<const int64_t*>(target)));
}

Event* EventPool::Take() {
  if (!free_.empty()) {
    Event* e = free_.back();
    free_.pop_back();
    return e;
  }
  all_.push_back(ValueOrThrow(backend_.CreateEvent()));
  return all_.back().get();
}

namespace {

// A Python callable a stream calls, perhaps many times (a captured graph
// replays it): referenced until the last copy of the stream item is gone,
// which may happen on the stream's thread, without the GIL.
struct PyCallable {
  explicit PyCallable(PyObject* f) : fn(f) {}
  ~PyCallable() {
    py::gil_scoped_acquire gil;
    Py_DECREF(fn);
  }
  void operator()() const {
    py::gil_scoped_acquire gil;
    PyObject* r = PyObject_CallNoArgs(fn);
    if (r == nullptr) PyErr_WriteUnraisable(fn);
    Py_XDECREF(r);
  }
  PyObject* fn;
};

template <typename T>
T* Address(uintptr_t address, const char* what, const char* name) {
  if (address == 0) ThrowInvalidArgument(absl::StrCat(what, ": ", name, " is a null address"));
  return reinterpret_cast<T*>(address);
}

}  // namespace

PyStreamGraph::~PyStreamGraph() {
  py::gil_scoped_release release;  // its items may hold Python callables
  graph_.reset();
}

void BindStream(py::module_& m) {
  py::class_<PyStreamGraph>(m, "StreamGraph", R"doc(
What one capture of a stepmesh.Stream recorded (Stream.end_capture()): launch()
enqueues exactly those operations again, in order, and returns at once. Host
code that ran between them while capturing is not part of it.)doc")
      .def(
          "launch",
          [](PyStreamGraph& g, PyStream& s) {
            absl::Status st;
            {
              py::gil_scoped_release release;
              st = g.graph().Launch(s.stream());
            }
            ThrowIfError(st);
          },
          py::arg("stream"), "Enqueues the recorded operations on `stream` (asynchronous).")
      .def("__len__", [](PyStreamGraph& g) { return g.graph().size(); });

  py::class_<PyStream>(m, "Stream", R"doc(
A stream of a node's backend (Worker.create_stream(), Server.create_stream()):
a CUDA stream on backend='cuda', a host thread on cpu_mock. Pass it as
stream= to push_pull/respond/wait, like a raw cudaStream_t int.)doc")
      .def(
          "launch_host_func",
          [](PyStream& s, py::function fn) {
            // The stream's thread calls fn holding the GIL; an exception is
            // reported as unraisable (it has no caller to go to).
            auto callable = std::make_shared<PyCallable>(fn.release().ptr());
            ThrowIfError(s.stream().LaunchHostFunc([callable] { (*callable)(); }));
          },
          py::arg("fn"), "Runs fn() (no arguments) when the stream gets to this point.")
      .def(
          "copy_async",
          [](PyStream& s, uintptr_t dst, uintptr_t src, size_t nbytes) {
            ThrowIfError(s.stream().CopyAsync(Address<void>(dst, "copy_async", "dst"),
                                              Address<const void>(src, "copy_async", "src"),
                                              nbytes));
          },
          py::arg("dst"), py::arg("src"), py::arg("nbytes"),
          "Copies nbytes from address src to dst (data_ptr() ints) when the stream gets here.")
      .def(
          "increment_counter",
          [](PyStream& s, uintptr_t counter) {
            ThrowIfError(s.stream().IncrementCounter(
                Address<int64_t>(counter, "increment_counter", "counter")));
          },
          py::arg("counter"), "*counter += 1 (an int64 word by address) when the stream gets here.")
      .def(
          "wait_counter",
          [](PyStream& s, uintptr_t counter, uintptr_t target) {
            ThrowIfError(s.stream().WaitCounterAtLeast(
                Address<const int64_t>(counter, "wait_counter", "counter"),
                Address<const int64_t>(target, "wait_counter", "target")));
          },
          py::arg("counter"), py::arg("target"),
          "Later work waits until *counter >= *target (int64 words, read when it gets there).")
      .def(
          "begin_capture", [](PyStream& s) { ThrowIfError(s.stream().BeginCapture()); },
          "Records the stream's operations instead of running them (cpu_mock; on CUDA capture "
          "with torch.cuda.graph).")
      .def(
          "end_capture",
          [](PyStream& s) { return new PyStreamGraph(ValueOrThrow(s.stream().EndCapture())); },
          "The StreamGraph recorded since begin_capture().")
      .def_property_readonly("is_capturing", [](PyStream& s) { return s.stream().IsCapturing(); })
      .def(
          "synchronize",
          [](PyStream& s, double timeout) {
            absl::Status st;
            {
              py::gil_scoped_release release;
              st = s.stream().Synchronize(absl::Seconds(timeout));
            }
            ThrowIfError(st);
          },
          py::arg("timeout") = 10.0, "Blocks (GIL released) until the enqueued work ran.")
      .def_property_readonly(
          "cuda_stream",
          [](PyStream& s) -> py::object {
            absl::StatusOr<void*> native = NativeCudaStream(s.stream());
            if (!native.ok()) return py::none();
            return py::int_(reinterpret_cast<uintptr_t>(*native));
          },
          "The cudaStream_t (int) of a CUDA backend's stream, else None.");
}

}  // namespace stepmesh::python
