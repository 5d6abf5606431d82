#pragma once
// The attention side of AFD: pushes activations to FFN servers and pulls
// their outputs back, into tensors registered ahead of time.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "stepmesh/backend.h"
#include "stepmesh/export.h"
#include "stepmesh/handle.h"
#include "stepmesh/options.h"
#include "stepmesh/participant.h"
#include "stepmesh/stats.h"
#include "stepmesh/tensor.h"
#include "stepmesh/trace.h"
#include "stepmesh/types.h"

namespace stepmesh {

struct Push {
  Key key = 0;
  size_t bytes = kWholeTensor;         // a prefix of the registered tensor
  absl::Span<const int> servers = {};  // empty: every server
};

struct Pull {
  Key key = 0;  // the key the server replies under; lands in RegisterPullTensor(key, server)
  int server = 0;
};

// Rank, backend, stats, traces, Barrier and Shutdown: stepmesh/participant.h.
class STEPMESH_EXPORT AFTensorWorker : public Participant {
 public:
  // Connects to the scheduler and every server. `backend` may be null: one is
  // created from options.backend / options.device.
  static absl::StatusOr<std::unique_ptr<AFTensorWorker>> Create(
      const MeshOptions& options, std::shared_ptr<Backend> backend = nullptr);
  ~AFTensorWorker() override = default;

  virtual int num_servers() const = 0;

  // `tensor` is the largest push under `key`; its memory must outlive the worker.
  virtual absl::Status RegisterPushTensor(Key key, TensorView tensor) = 0;
  // Receives `server`'s reply under `key`; one tensor per (key, server).
  virtual absl::Status RegisterPullTensor(Key key, int server, TensorView tensor) = 0;
  virtual absl::Status Unregister(Key key) = 0;

  // Broadcasts the pushes and expects one reply per server addressed (a reply
  // carries the pull for that server, if any). Returns at once; the send happens
  // on the send thread once `options.ready` completes. A key may be in one
  // request at a time.
  virtual absl::StatusOr<RequestHandle> PushPull(absl::Span<const Push> pushes,
                                                 absl::Span<const Pull> pulls,
                                                 const SendOptions& options = {}) = 0;
  // Blocks until done and returns the request's result, releasing the handle
  // (a second Wait is FAILED_PRECONDITION). DEADLINE_EXCEEDED keeps it pending.
  virtual absl::Status Wait(RequestHandle handle, absl::Duration timeout) = 0;
  // Non-blocking: true once done (then Wait returns at once); never releases.
  virtual absl::StatusOr<bool> Test(RequestHandle handle) = 0;

  // Arrival on the GPU timeline: work enqueued on `stream` after this call
  // waits, on the device and without a host sync, until the request is done
  // (its replies are in the pull tensors and visible to the device, or it
  // failed: Wait() says which). Returns at once; the handle stays valid for
  // Wait(), which the application still calls. May be captured into a CUDA
  // graph, but a replay then waits for this same request again: in graphs
  // replayed per step use StreamWaitNextPull.
  virtual absl::Status StreamWaitReply(RequestHandle handle, Stream& stream) = 0;
  // `stream` waits for the next reply under pull `key` from `server`,
  // counted on the device: the n-th time the wait runs, it waits for the
  // n-th reply (success or failure) under that registration. A CUDA graph
  // holding it therefore waits for a new reply at every replay. Wait this
  // way for every reply under the key (one stream or graph per key), or for
  // none; Unregister and Shutdown release such waits.
  virtual absl::Status StreamWaitNextPull(Key key, int server, Stream& stream) = 0;
  // The stamps of a completed request; valid after Wait until its slot is reused.
  virtual absl::StatusOr<TraceRecord> FetchTrace(RequestHandle handle) = 0;
};

}  // namespace stepmesh
