#pragma once
// The server's batch assembler: puts each worker's multi-part request back
// together (receive thread), groups complete requests into batches by their
// first push key, moves every batch slot through its states and picks the
// batch GetBatch hands out. It knows nothing of transports or threads beyond
// its lock, so it is tested on its own (tests/core/batch_assembler_test.cc).
//
// A batch slot's states:
//   kFree -> kCollecting   a worker's complete request opens it
//         -> kReady        every live worker is in (or a loss completed it)
//         -> kHandedOut    GetBatch (kReadyByDeadline also takes kCollecting)
//         -> kResponding   Respond queued the replies
//         -> kFree         the replies went out
//   kCollecting -> kFree   the last worker in it was lost
//
// A worker whose request the server refused (a key not registered in time, a
// bad size, a failed part) is excused from the batch that request would have
// joined: the batch forms without it, as if it were lost for that batch alone,
// so one worker's mistake costs the others at most one batch.
//
// Membership (docs/elastic.md): a batch waits for a worker that is live and
// was awaited when the batch opened. The start shape's workers are awaited
// from the first batch; a worker that joins (or rejoins) the running mesh
// only by batches opened after its first request arrived, so a joiner never
// stalls the others; a worker whose fence arrived (this server drains) by
// none. A batch that formed without a joiner it did not await is noted as
// the joiner's "late" group: the joiner's request for it, when it comes, is
// handed out alone instead of waiting for the others' next one (which, in a
// step-locked application, wait for the joiner). Its first request keeps the
// notes of batches opened after the one it belongs to (the rest of its step)
// and drops older ones. Read once per batch under the lock; nothing per frame.

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "src/base/sync.h"
#include "src/core/frame.h"
#include "src/core/lost_peers.h"
#include "src/core/protocol.h"
#include "src/core/server_tensors.h"
#include "stepmesh/backend.h"
#include "stepmesh/server.h"
#include "stepmesh/trace.h"

namespace stepmesh::core {

inline constexpr int kAssembliesPerWorker = 64;  // requests of one worker arriving at once
inline constexpr int kBatchSlots = 64;

// One worker request being received (its parts may arrive one by one).
struct Assembly {
  bool used = false;
  uint64_t request_id = 0;
  uint16_t part_count = 0;
  uint16_t parts_done = 0;
  bool failed = false;
  Key group = 0;
  Key pull_key = kNoPull;
  TraceStamps stamps;
  int num_keys = 0;
  std::array<Key, kMaxPushesPerRequest> keys{};
  std::array<size_t, kMaxPushesPerRequest> bytes{};
  std::array<RecvRegistration*, kMaxPushesPerRequest> regs{};
};

enum class BatchState : uint8_t { kFree, kCollecting, kReady, kHandedOut, kResponding };

// A worker's place in a batch.
struct WorkerEntry {
  bool present = false;
  uint64_t request_id = 0;
  Key pull_key = kNoPull;
  TraceStamps stamps;
  size_t reply_bytes = 0;              // set by Respond
  size_t reply_offset = 0;             // set by Respond: into the reply region
  ReplyRegistration* reply = nullptr;  // set by Respond; null: an empty acknowledgement
  bool reply_missing = false;          // set by Respond: its pull key's tensor is gone
  uint32_t pushed_mask = 0;            // bit t: this worker filled tensors[t]
  bool excused = false;                // its request for this batch was refused
};

struct BatchSlot {
  explicit BatchSlot(int num_workers);
  // Frees worker `w`'s slots of the receive regions this batch holds.
  void ReleaseReceiveSlots(int w);

  uint32_t generation = 0;
  BatchState state = BatchState::kFree;
  uint64_t opened_sequence = 0;
  Key group = 0;
  std::vector<WorkerEntry> entries;  // by worker rank
  std::vector<int> workers;          // present, ascending (set when handed out)
  std::vector<Key> pull_keys;        // parallel to workers
  std::vector<BatchTensor> tensors;
  std::vector<RecvRegistration*> regs;     // parallel to tensors
  std::vector<std::vector<size_t>> valid;  // [tensor][worker]
  uint64_t handler_ns = 0;
  uint64_t respond_ns = 0;  // Respond() called (trace)
};

class BatchAssembler {
 public:
  // `lost` says which workers are gone (a batch does not wait for them); it
  // must outlive the assembler. `trace`: take arrival and hand-out stamps.
  BatchAssembler(int num_workers, const LostPeers& lost, bool trace);

  size_t num_slots() const { return slots_.size(); }
  // Bumps `counter` each time a batch becomes ready (not for kReadyByDeadline's
  // partial batches), after its data is in the receive tensors: streams wait
  // on it on the device (AFTensorServer::StreamWaitNextBatch). Set before
  // frames arrive; it must outlive the assembler. ClearReady releases its waiters.
  void CountReadyBatches(HostFlag* counter) { ready_counter_ = counter; }

  // ---- receive thread: assembly ----
  struct Arrival {
    absl::Status report;           // an error the worker must hear (once per request)
    Assembly* complete = nullptr;  // all parts in, none failed: Commit or Abandon it
    bool ready = false;            // a batch became ready (its refused worker excused)
  };
  // Part `h` of worker `w`'s request landed in `reg` (its slot there now
  // busy), or failed with `status` (then `reg`, if any, is released).
  Arrival AddPart(int w, const FrameHeader& h, RecvRegistration* reg, const absl::Status& status);
  // Adds a complete request to the batch its group names, opening one if
  // needed; RESOURCE_EXHAUSTED (the request dropped, its slots freed) when
  // every batch slot is taken. True in `*ready` when a batch became ready.
  absl::Status Commit(int w, Assembly& a, bool* ready);
  // Drops a complete request that could not be delivered, freeing its slots,
  // and excuses `w` from the batch of its group. True when a batch became ready.
  bool Abandon(int w, Assembly& a);
  // Worker `w`'s request for `group` was refused: the oldest batch of the
  // group still waiting for `w` forms without it, or, when there is none yet,
  // the next one opened (bounded per worker). True when a batch became ready.
  bool Excuse(int w, Key group);
  // A restarted `w`: drops what its previous process left half-received and
  // returns the receive regions whose w-slot a batch still holds.
  std::vector<const RecvRegistration*> ForgetWorker(int w);

  // ---- any thread ----
  bool HasReady() const { return ready_count_.load(std::memory_order_acquire) > 0; }
  int ready_count() const { return ready_count_.load(std::memory_order_relaxed); }
  // The oldest ready batch, handed out.
  std::optional<Batch> TakeReady();
  // kReadyByDeadline: the oldest batch still collecting, handed out as it is.
  std::optional<Batch> TakeOldestPartial();
  // Answers the handed-out batch `handle` names: `answer(slot, index)` runs
  // under the lock with the slot in kResponding and keeps it there when it
  // returns OK; on an error the batch stays handed out.
  template <typename Answer>
  absl::Status Respond(BatchHandle handle, Answer answer);
  // Send thread, after the replies of the kResponding slot `index` went out.
  BatchSlot& responding(uint32_t index) { return *slots_[index]; }
  void Release(uint32_t index);
  // Whether a reply being sent reads `reg`.
  bool ReplySourceInUse(const ReplyRegistration* reg);
  // Whether a request in a batch not yet answered pulls `key`.
  bool PullKeyAwaited(Key key);
  // `w` is gone: its requests in batches not yet handed out are dropped (they
  // can never be answered), and batches that waited only for it are ready.
  void DropWorker(int w);
  // Shutdown: no batch is handed out any more (nor becomes ready: streams
  // waiting for one are released).
  void ClearReady();

  // ---- membership (any thread) ----
  // `w` joined the running mesh: batches wait for it once its first request
  // arrived (those opened after that).
  void AwaitAfterFirstRequest(int w);
  // `w` sends nothing more (its fence): no batch waits for it; true when one
  // became ready.
  bool StopAwaiting(int w);
  // No batch collecting or ready: nothing received is left to hand out.
  bool NothingToHandOut();
  // A batch collecting, or more than one ready: more is on its way than the
  // one batch a caller is about to take (GetBatch's `more_coming`).
  bool MoreThanOneToHandOut();
  // Every slot free: everything received was answered and its replies sent.
  bool Idle();

 private:
  Assembly* FindAssembly(int w, const FrameHeader& h);
  BatchSlot* OpenSlot(Key group, int opener, uint32_t* index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Consumes one of `w`'s pending excuses for `group`; false when it has none.
  bool TakePendingExcuse(int w, Key group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool MaybeReady(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `slot` goes without the joiners it did not await: note it for them.
  void NoteLate(const BatchSlot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the note of `w` for `group` (the newest when `newest`, else the
  // oldest); false when there is none. `*seq`: the batch's opened sequence.
  bool TakeLate(int w, Key group, bool newest, uint64_t* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Batch HandOut(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeSlot(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int num_workers_;
  const LostPeers& lost_;
  const bool trace_;
  std::vector<std::vector<Assembly>> assemblies_;  // receive thread only

  base::Mutex mu_;
  // The slots exist for the assembler's life; their contents follow the state
  // machine (a kResponding slot is the send thread's until Release).
  std::vector<std::unique_ptr<BatchSlot>> slots_;
  std::vector<uint32_t> free_slots_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> ready_ ABSL_GUARDED_BY(mu_);  // oldest first
  std::atomic<int> ready_count_{0};
  uint64_t opened_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  // Per worker: groups of refused requests no batch was open for yet; the next
  // batch of such a group opened by another worker excuses it (a ring).
  static constexpr int kPendingExcuses = 8;
  struct PendingExcuses {
    std::array<Key, kPendingExcuses> groups{};
    int count = 0;
    int next = 0;
  };
  std::vector<PendingExcuses> excuses_ ABSL_GUARDED_BY(mu_);
  HostFlag* ready_counter_ = nullptr;
  uint32_t batches_counted_ ABSL_GUARDED_BY(mu_) = 0;
  // Per worker: batches opened after this sequence wait for it (0: every
  // batch; kAwaitAfterFirst: none until its first request sets it; kNever:
  // none).
  static constexpr uint64_t kAwaitNever = ~uint64_t{0};
  static constexpr uint64_t kAwaitAfterFirst = ~uint64_t{0} - 1;
  std::vector<uint64_t> awaited_after_ ABSL_GUARDED_BY(mu_);
  struct LateNote {
    Key group = 0;
    uint64_t seq = 0;
  };
  static constexpr int kLateNotes = 16;
  struct LateNotes {
    std::array<LateNote, kLateNotes> notes{};
    int count = 0;
  };
  std::vector<LateNotes> late_ ABSL_GUARDED_BY(mu_);  // per worker, oldest first
};

template <typename Answer>
absl::Status BatchAssembler::Respond(BatchHandle handle, Answer answer) {
  if (!handle.valid() || handle.index() >= slots_.size()) {
    return absl::InvalidArgumentError("invalid batch handle");
  }
  base::MutexLock lock(&mu_);
  BatchSlot& slot = *slots_[handle.index()];
  if (slot.generation != handle.generation() || slot.state != BatchState::kHandedOut) {
    return absl::FailedPreconditionError("batch already answered (or handle is stale)");
  }
  slot.state = BatchState::kResponding;
  absl::Status answered = answer(slot, handle.index());
  if (!answered.ok()) slot.state = BatchState::kHandedOut;  // the caller may retry
  return answered;
}

}  // namespace stepmesh::core
