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
  size_t bytes = kWholeTensor;  // a prefix of the registered tensor
  // Empty: every server of the membership current at each Post (the worker's
  // view, CurrentMembership()); else these ranks, each of which must be a
  // member when posted (UNAVAILABLE naming it otherwise).
  absl::Span<const int> servers = {};
};

struct Pull {
  Key key = 0;  // the key the server replies under; lands in RegisterPullTensor(key, server)
  int server = 0;
};

// A PushPull validated once (AFTensorWorker::Prepare) and posted many times
// (Post): its keys looked up, byte counts checked, servers routed. It names
// registrations by generation, so a key unregistered (or registered again)
// after Prepare makes it stale: Post then fails FAILED_PRECONDITION naming
// the key, and never reads the old tensor. Movable; post it only on the
// worker that prepared it, while that worker lives. Not thread-safe to
// SetBytes while another thread posts it; posting it from several threads is
// safe (the second post of a request still in flight is refused).
class STEPMESH_EXPORT PreparedRequest {
 public:
  PreparedRequest();  // empty: Post refuses it
  PreparedRequest(PreparedRequest&&) noexcept;
  PreparedRequest& operator=(PreparedRequest&&) noexcept;
  ~PreparedRequest();

  bool valid() const { return plan_ != nullptr; }
  size_t num_pushes() const;
  size_t num_pulls() const;
  // Push `push` (in Prepare's order): its key, the bytes it sends, and the
  // bytes of the tensor registered under that key when it was prepared.
  Key push_key(size_t push) const;
  size_t bytes(size_t push) const;
  size_t registered_bytes(size_t push) const;
  // The tensor registered under push `push`'s key at Prepare (empty out of range).
  TensorView push_tensor(size_t push) const;
  // Push `push` sends its first `bytes` bytes from the next Post on (posted
  // requests keep theirs). OUT_OF_RANGE above registered_bytes(push),
  // INVALID_ARGUMENT for an index out of range; nothing changes then.
  absl::Status SetBytes(size_t push, size_t bytes);

  struct Plan;  // what Prepare found: defined by the library (src/core/prepared_request.h)

 private:
  friend struct Plan;
  std::unique_ptr<Plan> plan_;
};

// Rank, backend, stats, traces, Barrier, Shutdown, the membership and Leave:
// stepmesh/participant.h.
class STEPMESH_EXPORT AFTensorWorker : public Participant {
 public:
  // Connects to the scheduler and every server. `backend` may be null: one is
  // created from options.backend / options.device.
  static absl::StatusOr<std::unique_ptr<AFTensorWorker>> Create(
      const MeshOptions& options, std::shared_ptr<Backend> backend = nullptr);
  ~AFTensorWorker() override = default;

  // The server rank range, [0, num_servers()): the capacity (max_servers, or
  // the start shape). Which of them are members: CurrentMembership().servers.
  virtual int num_servers() const = 0;

  // `tensor` is the largest push under `key`; its memory must outlive the worker.
  virtual absl::Status RegisterPushTensor(Key key, TensorView tensor) = 0;
  // Receives `server`'s reply under `key`; one tensor per (key, server).
  virtual absl::Status RegisterPullTensor(Key key, int server, TensorView tensor) = 0;
  virtual absl::Status Unregister(Key key) = 0;

  // Validates a request once: every key registered, no key repeated, byte
  // counts within the registered tensors, servers in range, at most one pull
  // per server and only from a server pushed to. Errors name the key or
  // server. Allocates; the result is posted any number of times.
  virtual absl::StatusOr<PreparedRequest> Prepare(absl::Span<const Push> pushes,
                                                  absl::Span<const Pull> pulls) = 0;
  // Broadcasts the prepared pushes and expects one reply per server
  // addressed (a reply carries the pull for that server, if any). Returns at
  // once; the send happens on the send thread once `options.ready`
  // completes (with no ready event, an idle send thread and a transport
  // whose send never waits, TCP, on the calling thread before returning).
  // A key may be in one request at a time (FAILED_PRECONDITION otherwise).
  // No lookup and no allocation: the checks left are the prepared
  // registrations' generations, their in-flight flags and the servers'
  // membership (a flag per server). A server that left (or drains) fails the
  // post at once with UNAVAILABLE naming it; a request already sent to a
  // server that starts draining completes with its reply.
  virtual absl::StatusOr<RequestHandle> Post(const PreparedRequest& request,
                                             const SendOptions& options = {}) = 0;
  // Prepare + Post in one call (into storage of the worker's: no allocation).
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
