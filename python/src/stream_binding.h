#pragma once
// GPU-timeline interop for the Python API: what a `stream=` argument names,
// the ready events recorded on it, and stepmesh.Stream (a stream made by a
// Worker's or Server's backend, e.g. cpu_mock's, so the plumbing is usable and
// testable without a GPU).
//
// `stream=` takes None (no ordering), a stepmesh.Stream, or an int: a raw
// cudaStream_t (torch.cuda.current_stream().cuda_stream; 0 is the legacy
// default stream), wrapped with WrapCudaStream on the node's CUDA backend.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "stepmesh/backend.h"

namespace stepmesh::python {

// A stream made by a node's backend (Worker.create_stream / Server.create_stream).
class PyStream {
 public:
  explicit PyStream(std::unique_ptr<Stream> stream) : stream_(std::move(stream)) {}
  ~PyStream();  // releases the GIL: the stream's thread may be running a Python host function
  Stream& stream() { return *stream_; }

 private:
  std::unique_ptr<Stream> stream_;
};

// What a capture recorded (Stream.end_capture / StreamGraph.launch).
class PyStreamGraph {
 public:
  explicit PyStreamGraph(std::unique_ptr<StreamGraph> graph) : graph_(std::move(graph)) {}
  ~PyStreamGraph();
  StreamGraph& graph() { return *graph_; }

 private:
  std::unique_ptr<StreamGraph> graph_;
};

// Resolves `stream=` arguments for one node. Wrappers of raw cudaStream_t
// values are made once per distinct value and kept for the node's life (a
// recorded event needs its stream; prepare once, post many).
class StreamArgs {
 public:
  explicit StreamArgs(Backend& backend) : backend_(backend) {}
  // nullptr for None. Raises InvalidArgument naming the problem (`what`: the
  // call) for anything else, or for an int on a backend that is not CUDA.
  // `keep` receives the Python object to hold while the stream is in use.
  Stream* Resolve(pybind11::handle arg, const char* what, pybind11::object& keep);
  // Stream::WaitCounterAtLeast on `stream` (not None) for two int64 words given
  // by address (a tensor's data_ptr()); raises naming the problem.
  void WaitCounter(pybind11::handle stream, uintptr_t counter, uintptr_t target);

 private:
  static constexpr size_t kMaxWrapped = 256;
  Backend& backend_;
  std::unordered_map<uintptr_t, std::unique_ptr<Stream>> wrapped_;
};

// Ready events of a node, reused only when the caller says their send is over.
class EventPool {
 public:
  explicit EventPool(Backend& backend) : backend_(backend) {}
  // Raises on failure (RESOURCE_EXHAUSTED from a CUDA backend's fixed pool).
  Event* Take();
  void Give(Event* event) { free_.push_back(event); }

 private:
  Backend& backend_;
  std::vector<std::unique_ptr<Event>> all_;
  std::vector<Event*> free_;
};

void BindStream(pybind11::module_& m);

}  // namespace stepmesh::python
