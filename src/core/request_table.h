#pragma once
// The worker's requests in flight: a fixed table of slots, one per PushPull
// from the call until Wait() collects it. Sized once at creation, so a request
// never allocates; the application holds a generation-checked handle, and the
// request id on the wire (index << 32 | generation) finds the slot without a
// lookup table.
//
// Threads: the application fills, commits, collects and frees slots under the
// worker's registration lock (which also guards the free list: the methods so
// marked); the send and receive threads settle servers through atomics only.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/base/sync.h"
#include "src/core/payload_io.h"
#include "src/core/protocol.h"
#include "stepmesh/backend.h"
#include "stepmesh/handle.h"
#include "stepmesh/tensor.h"
#include "stepmesh/trace.h"
#include "stepmesh/types.h"

namespace stepmesh::core {

// A worker tensor registered with the transport: a push source or a pull
// destination. The worker keeps these in slots it reuses and never frees while
// it lives; `generation` tells a prepared request (src/core/prepared_request.h)
// whether the slot still holds the registration it was prepared against.
struct TensorRegistration {
  TensorView view;
  WireTensor wire;
  // Bumped when the registration goes (never 0); guarded by the worker's
  // registration lock, like in_flight.
  uint32_t generation = 1;
  bool in_flight = false;  // in a pending request; guarded by the worker's registration lock
  // Pull registrations: replies settled so far (success or failure), and the
  // device-side cursor of StreamWaitNextPull. `arrived` changes once per
  // request that pulls here, and one such request is in flight at a time.
  std::unique_ptr<HostFlag> arrivals;
  std::unique_ptr<HostFlag> cursor;
  uint32_t arrived = 0;
};

enum class RequestState : uint8_t { kFree, kPending, kDone, kReleased };

struct PlannedPush {
  Key key = 0;
  const std::byte* data = nullptr;
  size_t bytes = 0;
  DType dtype = DType::kUInt8;
  RegionId region = 0;
  TensorRegistration* reg = nullptr;
};

// One PushPull in flight.
struct Request {
  explicit Request(int num_servers);

  // Read by the receive thread to reject stale frames while a new request fills the slot.
  std::atomic<uint32_t> generation{0};
  std::atomic<RequestState> state{RequestState::kFree};
  uint32_t index = 0;  // the slot's, fixed
  int num_pushes = 0;
  std::array<PlannedPush, kMaxPushesPerRequest> pushes;
  std::vector<uint8_t> targets;  // [push][server]: push goes to server
  std::vector<Key> pull_key;     // per server; kNoPull when none
  std::vector<TensorRegistration*> pull_reg;
  std::vector<uint8_t> addressed;
  std::unique_ptr<std::atomic<bool>[]> settled;
  std::atomic<int> outstanding{0};  // unsettled servers + the send thread's reference
  std::vector<TraceStamps> stamps;
  uint64_t enqueue_ns = 0;
  uint64_t complete_ns = 0;
  std::optional<uint32_t> stage;  // SendOptions::stage
  // The generation of this slot's latest finished request, for streams
  // waiting on the GPU timeline (StreamWaitReply); made by CreateDoneFlags.
  std::unique_ptr<HostFlag> done_flag;
  base::Mutex status_mu;
  absl::Status status ABSL_GUARDED_BY(status_mu);
};

inline uint64_t RequestId(uint32_t index, uint32_t generation) {
  return (uint64_t{index} << 32) | generation;
}

class RequestTable {
 public:
  // Generations start at `first_generation` (never 0: handles with generation 0 are invalid).
  RequestTable(int slots, int num_servers, uint32_t first_generation);

  size_t size() const { return requests_.size(); }
  // Gives every slot its done flag, holding the slot's current generation.
  // Once, before the first request: making a flag later pins memory, which
  // waits for the whole device.
  absl::Status CreateDoneFlags(Backend& backend);
  Request& at(uint32_t index) { return *requests_[index]; }
  const Request& at(uint32_t index) const { return *requests_[index]; }

  // --- the owner's lock ---
  // The slot the next Commit() takes, for the caller to fill; null when every
  // slot is in flight. Its pushes, targets, pulls and `addressed` are the caller's.
  Request* NextFree();
  // Slots taken (pending, done or not yet collected).
  size_t in_use() const { return requests_.size() - free_.size(); }
  // Requests committed and not yet done (any thread).
  int pending() const { return pending_.load(std::memory_order_acquire); }
  // Takes NextFree() as a pending request for `addressed` servers (its
  // `addressed` vector filled in): a new generation, every addressed server
  // unsettled, the send thread's reference counted.
  RequestHandle Commit(int addressed, uint64_t enqueue_ns);
  // Returns a collected (or never queued) slot to the free list.
  void Free(uint32_t index);
  // Handles of the pending requests that address `server` and still await its reply.
  std::vector<RequestHandle> PendingAddressing(int server) const;

  // --- the application ---
  // The request `handle` names: INVALID_ARGUMENT for a handle never issued,
  // FAILED_PRECONDITION for a stale or collected one.
  absl::StatusOr<Request*> Lookup(RequestHandle handle) const;
  // A done request's result; it becomes kReleased (the caller then Free()s it).
  // FAILED_PRECONDITION when collected before.
  absl::Status Collect(Request& r, absl::Status* result);

  // --- the receive thread ---
  // The pending request `request_id` names, which awaits `server`'s reply.
  absl::StatusOr<Request*> PendingFor(uint64_t request_id, int server) const;
  // Whether `r` is still the pending request `request_id` named (not since
  // completed and reused): a frame resolved earlier may still settle it.
  bool IsCurrent(const Request& r, uint64_t request_id) const;

  // --- any thread ---
  // Records `server`'s outcome (the first error is the request's result) and
  // counts it as an arrival of the pull registration it lands in, if any; a
  // second settle of the same server does nothing. True when that dropped the
  // last reference: the caller completes the request.
  // `first`, when given, says whether this call settled the server.
  [[nodiscard]] bool Settle(Request& r, int server, const absl::Status& status,
                            bool* first = nullptr);
  // Drops a reference (the send thread's); true when it was the last.
  [[nodiscard]] bool Release(Request& r);
  // Sets the result unless an error is already recorded: a copy of `why`
  // that shares nothing with it (the caller's thread may drop `why` at any
  // time, unordered with the application reading the result).
  void FailIfOk(Request& r, const absl::Status& why);
  // The request is done (the owner released its tensors first); streams
  // waiting for it on the device may go.
  void MarkDone(Request& r, uint64_t complete_ns);

 private:
  std::vector<std::unique_ptr<Request>> requests_;
  std::vector<uint32_t> free_;  // the owner's lock
  std::atomic<int> pending_{0};
};

}  // namespace stepmesh::core
