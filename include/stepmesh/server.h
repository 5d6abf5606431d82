#pragma once
// The FFN side of AFD: receives every worker's pushes of a micro-batch into one
// contiguous registered region (a slot per worker) and replies from another.

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

enum class BatchPolicy : uint8_t {
  kAllWorkers,       // wait (up to the timeout) until every worker's request arrived
  kReadyByDeadline,  // at the timeout, hand out whatever workers arrived (at least one)
};

// One received tensor of a batch: the whole registered region, worker w's data
// at bytes [w * slot_bytes, w * slot_bytes + valid_bytes[w]).
struct BatchTensor {
  Key key = 0;
  TensorView region;
  size_t slot_bytes = 0;
  absl::Span<const size_t> valid_bytes;  // per worker; 0 when the worker is absent
};

// Valid until Respond() for it returns.
struct Batch {
  BatchHandle handle;
  Key group = 0;  // the requests' stage (SendOptions::stage), else their first push key
  absl::Span<const int> workers;          // ranks present, ascending
  absl::Span<const BatchTensor> tensors;  // in the workers' push order
  // Key each present worker pulls from this server (parallel to `workers`), or
  // kNoPull when that worker only pushed.
  absl::Span<const Key> pull_keys;
  static constexpr Key kNoPull = ~Key{0};
};

struct Reply {
  int worker = 0;
  size_t bytes = kWholeTensor;  // of the worker's slot in the reply region
  // Where in the reply region the reply starts, in bytes: kSlot is the
  // worker's slot (worker * slot bytes). Another offset lets replies be
  // packed back to back (one copy of a batch's output, whatever its split);
  // offset + bytes must lie inside the region.
  size_t offset = kSlot;
  static constexpr size_t kSlot = ~size_t{0};
};

// Rank, backend, stats, traces, Barrier, Shutdown, the membership and Leave:
// stepmesh/participant.h.
class STEPMESH_EXPORT AFTensorServer : public Participant {
 public:
  static absl::StatusOr<std::unique_ptr<AFTensorServer>> Create(
      const MeshOptions& options, std::shared_ptr<Backend> backend = nullptr);
  ~AFTensorServer() override = default;

  // The worker rank range, [0, num_workers()): the capacity (max_workers, or
  // the start shape), the slots of every region. Which of them are members:
  // CurrentMembership().workers.
  virtual int num_workers() const = 0;

  // `region` holds num_workers() equal slots (its first dimension must divide
  // evenly); worker w's pushes under `key` land in slot w.
  virtual absl::Status RegisterRecvTensor(Key key, TensorView region) = 0;
  // The source of replies under `key` (a worker's pull key): slot w goes to worker w.
  virtual absl::Status RegisterReplyTensor(Key key, TensorView region) = 0;
  virtual absl::Status Unregister(Key key) = 0;

  // The next batch. kAllWorkers waits for every worker that is a member and
  // already sent this server a request of its membership: a worker that
  // joined (or rejoined) is waited for only by batches opened after its first
  // request here, a worker that left or was lost by none (docs/elastic.md).
  // While this server drains (Leave), batches of what arrived are still handed
  // out; once nothing more can arrive and none is left, UNAVAILABLE "drained".
  virtual absl::StatusOr<Batch> GetBatch(absl::Duration timeout,
                                         BatchPolicy policy = BatchPolicy::kAllWorkers) = 0;
  // Arrival on the GPU timeline: work enqueued on `stream` after this call
  // waits, on the device and without a host sync, for the next batch to be
  // complete (every live worker's request in the receive tensors, visible to
  // the device), counted on the device: the n-th time the wait runs, it waits
  // for the n-th batch, the one the n-th GetBatch(kAllWorkers) hands out. So
  // the FFN kernels can be queued before the batch is there, and a CUDA graph
  // holding the wait waits for a new batch at every replay. Pair each wait
  // with one GetBatch(kAllWorkers) (kReadyByDeadline's partial batches are not
  // counted); one stream or graph waits this way. Shutdown releases the waits.
  virtual absl::Status StreamWaitNextBatch(Stream& stream) = 0;
  // Replies to every worker of the batch: worker w's slot of the reply region
  // named by its pull key (workers that only pushed get an empty acknowledgement).
  // Returns at once; sending waits for `options.ready`. Every worker with a pull
  // must have a Reply; nothing is sent when the call fails.
  virtual absl::Status Respond(const Batch& batch, absl::Span<const Reply> replies,
                               const SendOptions& options = {}) = 0;
};

}  // namespace stepmesh
