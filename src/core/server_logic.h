#pragma once
// The server's role logic (AFTensorServer's data path), owned by its mesh
// node (src/core/mesh_node.h, src/core/role_logic.h). It ties the batch
// assembler (what arrived, which batch is ready) to the reply path (what goes
// back). Its jobs by file: server_batches.cc registrations, batches handed
// out and answered, the send thread; server_pushes.cc the per-frame checks of
// arriving pushes and their delivery; server_parked.cc pushes that arrived
// before their registration; server_peers.cc workers lost, leaving and
// rejoining (with WorkerRejoins), and the server's own drain. The public
// object is the facade in server.cc.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/base/rate_limit.h"
#include "src/base/sync.h"
#include "src/core/batch_assembler.h"
#include "src/core/mesh_node.h"
#include "src/core/reply_path.h"
#include "src/core/role_logic.h"
#include "src/core/server_tensors.h"
#include "src/core/worker_fences.h"
#include "src/core/worker_rejoins.h"
#include "stepmesh/server.h"

namespace stepmesh::core {

// The frame context of a worker's push: the worker, and the receive region
// Resolve checked the push against and reserved its slot in (null when the
// push was refused or parked). One per worker: a transport resolves a peer's
// frames one at a time (see TransportSink).
struct PushNote {
  int worker = 0;
  RecvRegistration* reg = nullptr;
  bool duplicate = false;  // a copy of a push already accepted: dropped, nobody answered
  // Parked: the payload lands in `park` (the key is not registered yet).
  std::unique_ptr<std::byte[]> park;
  bool parking = false;
};

// A push that arrived before its key (or its pull key) was registered here,
// set aside by the receive thread -- which moves on to other frames -- until
// the registration comes (then it is delivered as if it arrived then) or its
// deadline passes (then its request is refused, naming the key).
struct ParkedPush {
  FrameHeader header;
  std::unique_ptr<std::byte[]> payload;  // its key was not registered
  // Its key was, its pull key not: the payload is in the worker's slot of
  // this receive region, reserved for it (busy) until the push is delivered.
  RecvRegistration* reg = nullptr;
  absl::Time deadline;
  uint32_t epoch = 0;  // the sender's process (WorkerRejoins::epoch) when it arrived
};

class ServerLogic final : public RoleLogic {
 public:
  explicit ServerLogic(MeshNode& node);

  // Before the node starts: the flags StreamWaitNextBatch waits on.
  absl::Status Init();

  // --- AFTensorServer's data path (stepmesh/server.h) ---
  int num_workers() const;

  absl::Status RegisterRecvTensor(Key key, TensorView region);

  absl::Status RegisterReplyTensor(Key key, TensorView region);

  absl::Status Unregister(Key key);

  absl::StatusOr<Batch> GetBatch(absl::Duration timeout, BatchPolicy policy);

  absl::Status StreamWaitNextBatch(Stream& stream);

  absl::Status Respond(const Batch& batch, absl::Span<const Reply> replies,
                       const SendOptions& send_options);

  // --- RoleLogic ---
  // Receive thread. Checks a push once: its sender, its key, dtype and size,
  // and that the worker's slot is free (then reserves it). The result travels
  // to OnFrame as the frame's context.
  absl::Status Resolve(NodeId peer, const FrameHeader& h, Destination& out,
                       FrameContext* context) override;

  void OnFrame(NodeId peer, const FrameHeader& h, FrameContext context,
               absl::Status status) override;

  // Receive thread, after every poll: delivers parked pushes whose
  // registrations came, refuses those past their deadline, and drops those of
  // workers that are gone (or restarted). Nothing to do costs a compare.
  void AfterPoll() override;

  // Send thread (or inline): a batch's replies (SendKind::kReplies) or an
  // error report (kError).
  void Execute(const SendItem& item, const absl::Status& ready) override;

  // Peer events (receive or rendezvous thread): worker `peer` is gone; its
  // batches go on without it.
  void OnPeerGone(NodeId peer, const absl::Status& why) override;

  // A connection loss while the worker rejoins may be its previous
  // process's: set aside, settled by the scheduler (src/core/worker_rejoins.h).
  void OnPeerLost(NodeId peer, absl::Status why) override;

  // The scheduler saw worker `peer` leave in order. Its data connection's
  // goodbye says the same after its last pushes, except when that goodbye
  // was set aside while the worker rejoined: only then this counts it out.
  void OnPeerLeft(NodeId peer) override;

  // A restarted attention process rejoined under the same rank: accept its
  // connection and count it in batches again. Requests of its previous process
  // were dropped when that was lost; its registrations are the new process's own.
  void OnPeerJoined(NodeId peer, const std::string& endpoint) override;

  // Joining a running mesh: every worker is new to this server, so none is
  // awaited before its first request here.
  void OnRoster(bool joined_running) override;

  void CancelAll(const absl::Status&) override;

  // --- Participant (ParticipantNode) ---
  // MeshStats::in_flight: batches handed out and not answered (any thread).
  uint64_t InFlight();
  // Counted out now; answers what arrived (the application keeps serving);
  // done once every reply went out.
  absl::Status Drain(absl::Time deadline);

 private:
  // --- draining (Participant::Leave) ---
  // Every worker sent its fence (or is gone): nothing more can arrive.
  bool AllFenced() const;

  // Draining, nothing more arrives and nothing is left to hand out (GetBatch).
  bool DrainedOut();

  // --- receive thread ---
  // Whether the reply tensor a push pulls (if it pulls) is registered.
  bool PullRegistered(const FrameHeader& h) const ABSL_SHARED_LOCKS_REQUIRED(reg_mu_);

  // The same for a push of worker `w` into `reg`, remembering the answer: a
  // worker pulls the same key request after request, so the lookup is paid
  // once (receive thread; a reply key's Unregister forgets every answer).
  bool PullRegistered(const FrameHeader& h, RecvRegistration& reg, int w) const
      ABSL_SHARED_LOCKS_REQUIRED(reg_mu_);

  // The checks of a push whose key is registered here as `reg`: dtype, size,
  // a copy of an accepted push, the worker's slot free (then reserved).
  absl::Status Admit(int w, const FrameHeader& h, RecvRegistration& reg, Destination& out,
                     PushNote& note) ABSL_SHARED_LOCKS_REQUIRED(reg_mu_);

  // A push of worker `w` whose key or pull key is not registered: its payload
  // goes to a buffer of its own, kept (OnFrame) until the registration or the
  // deadline; refused at once when `w` already has its share parked.
  absl::Status Park(int w, const FrameHeader& h, Destination& out, PushNote& note)
      ABSL_SHARED_LOCKS_REQUIRED(reg_mu_);

  // What is not registered for worker `w`'s push `h`, for its error.
  std::string MissingRegistration(int w, const FrameHeader& h) const
      ABSL_SHARED_LOCKS_REQUIRED(reg_mu_);

  // Receive thread: worker `w` pushes nothing more here (its fence, after its
  // last push, sent once it heard this server drains).
  void Fenced(int w);

  // A push of worker `w` resolved (`reg`, its slot reserved) or refused
  // (`status`): checks its bytes, adds it to its request and the request to
  // its batch; a refusal goes back to the worker.
  void Deliver(NodeId peer, int w, const FrameHeader& h, RecvRegistration* reg,
               absl::Status status);

  // Receive thread, before any frame of worker `w`: once a restarted `w`
  // rejoined, drops what its previous process left half-received (request ids
  // restart with the process) and frees the receive slots those pushes held.
  // Slots held by batches the application has not answered stay held.
  void ForgetPreviousProcess(int w);

  // How long a push may stay parked: half the timeout, so that its worker,
  // whose request has the whole timeout, hears this server's NOT_FOUND (naming
  // the key) rather than its own deadline, and a batch it shares with other
  // workers waits at most that long for it.
  absl::Duration ParkWait() const;

  // Any thread: a registration happened; the receive thread looks at what is parked.
  void ReleaseParked();

  // The refusal of worker `w`'s push `h`, parked past its deadline.
  absl::Status ParkTimedOut(int w, const FrameHeader& h) const ABSL_SHARED_LOCKS_REQUIRED(reg_mu_);

  void Unpark(int w, size_t i);

  void QueueError(NodeId worker, uint64_t request_id, const absl::Status& status);

  // --- registration rules ---
  absl::StatusOr<size_t> SlotBytes(const TensorView& region, absl::string_view what) const;

  absl::Status CheckNewKey(Key key, bool exists, absl::string_view what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg_mu_);

  MeshNode& node_;
  // The node's, for the data path (src/core/mesh_node.h says what each holds).
  const MeshOptions& options_;
  const PayloadIo& io_;
  LostPeers& lost_;
  StatsRecorder& stats_;

  base::Mutex reg_mu_;
  absl::flat_hash_map<Key, std::unique_ptr<RecvRegistration>> recv_regs_ ABSL_GUARDED_BY(reg_mu_);
  ReplyTensors reply_regs_ ABSL_GUARDED_BY(reg_mu_);
  // StreamWaitNextBatch: the ready batches the assembler counts, and the
  // device-side cursor of the waiting stream. Declared before the assembler,
  // which points at the first.
  std::unique_ptr<HostFlag> batches_ready_;
  std::unique_ptr<HostFlag> batch_cursor_;
  BatchAssembler assembler_;
  ReplyPath replies_;
  std::vector<PushNote> notes_;  // receive thread only
  // Parked pushes per worker, oldest first, and their payload bytes (receive thread only).
  std::vector<std::deque<ParkedPush>> parked_;
  std::vector<size_t> parked_bytes_;
  size_t parked_total_ = 0;
  absl::Time next_parked_check_ = absl::InfinitePast();
  std::atomic<bool> parked_any_{false};  // whether a registration should wake the receive thread
  std::atomic<bool> registered_{false};  // a registration since the receive thread last looked
  WorkerRejoins rejoins_;  // which process of each worker is served; the rejoin window
  // Leave began (counted out, answering what arrived); whose fence arrived since.
  WorkerFences fences_;
  base::RateLimiter violations_{10, absl::Seconds(10)};
};

}  // namespace stepmesh::core
