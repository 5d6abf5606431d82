#pragma once
// The worker's role logic (AFTensorWorker's data path), owned by its mesh
// node (src/core/mesh_node.h, src/core/role_logic.h). Its jobs by file:
// worker_requests.cc registrations, prepared requests and their posts;
// worker_wire.cc the send thread's pushes and the receive thread's replies
// around the request table (src/core/request_table.h); worker_peers.cc
// servers lost, leaving and rejoining, the worker's own drain. The public
// object is the facade in worker.cc.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/base/rate_limit.h"
#include "src/base/sync.h"
#include "src/core/mesh_node.h"
#include "src/core/prepared_request.h"
#include "src/core/request_table.h"
#include "src/core/role_logic.h"
#include "stepmesh/worker.h"

namespace stepmesh::core {

class WorkerLogic final : public RoleLogic {
 public:
  explicit WorkerLogic(MeshNode& node);

  // Before the node starts: the request table's done flags.
  absl::Status Init();

  // --- AFTensorWorker's data path (stepmesh/worker.h) ---
  int num_servers() const;

  absl::Status RegisterPushTensor(Key key, TensorView tensor);

  absl::Status RegisterPullTensor(Key key, int server, TensorView tensor);

  absl::Status Unregister(Key key);

  absl::StatusOr<PreparedRequest> Prepare(absl::Span<const Push> pushes,
                                          absl::Span<const Pull> pulls);

  absl::StatusOr<RequestHandle> Post(const PreparedRequest& prepared,
                                     const SendOptions& send_options);

  absl::StatusOr<RequestHandle> PushPull(absl::Span<const Push> pushes,
                                         absl::Span<const Pull> pulls,
                                         const SendOptions& send_options);

  absl::Status Wait(RequestHandle handle, absl::Duration timeout);

  absl::StatusOr<bool> Test(RequestHandle handle);

  absl::Status StreamWaitReply(RequestHandle handle, Stream& stream);

  absl::Status StreamWaitNextPull(Key key, int server, Stream& stream);

  absl::StatusOr<TraceRecord> FetchTrace(RequestHandle handle);

  // MeshStats::in_flight: requests posted and not collected (any thread).
  uint64_t InFlight();
  // No new requests (leaving() is set); every posted one completes first.
  absl::Status Drain(absl::Time deadline);

  // --- RoleLogic ---
  // Send thread (or inline): a request (SendKind::kRequest) or a fence (kFence).
  void Execute(const SendItem& item, const absl::Status& ready) override;

  // Receive thread. Validates a reply once: its sender, its request, and
  // where it lands. The request travels to OnFrame as the frame's context.
  absl::Status Resolve(NodeId peer, const FrameHeader& h, Destination& out,
                       FrameContext* context) override;

  void OnFrame(NodeId peer, const FrameHeader& h, FrameContext context,
               absl::Status status) override;

  // Peer events (receive or rendezvous thread): server `peer` is gone; what
  // it did not answer fails UNAVAILABLE.
  void OnPeerGone(NodeId peer, const absl::Status& why) override;

  // Server `peer` left in order or began to drain (the scheduler's notice):
  // new posts to it fail at once; what was posted before goes out, then a
  // fence telling it nothing more comes; requests it holds complete with its
  // replies (or fail when its connection ends first).
  void OnPeerLeft(NodeId peer) override;

  // A restarted server rejoined: dial it again and let requests address it.
  // Requests that were in flight when it was lost already failed (UNAVAILABLE);
  // the new process starts empty, so its registrations are the app's to redo.
  void OnPeerJoined(NodeId peer, const std::string& endpoint) override;

  void CancelAll(const absl::Status& why) override;

 private:
  // --- leaving (Participant::Leave) ---
  absl::Status LeavingError() const;

  // Requests posted and not complete (any thread; reads each slot's state).
  size_t Pending() const;

  // --- registrations and posts (worker_requests.cc) ---
  // A slot for a new registration: reused when one is free (its generation
  // already bumped past every plan that named it), else a new one.
  TensorRegistration* NewRegistration() ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg_mu_);

  // The slot of a registration just gone: emptied, and stale to every plan
  // that named it. Not freed: a plan may still hold its address.
  void FreeRegistration(TensorRegistration* reg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg_mu_);

  absl::Status BuildLocked(absl::Span<const Push> pushes, absl::Span<const Pull> pulls,
                           PreparedPlan& plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg_mu_);

  // Takes a free slot for `plan`: everything checked before any state
  // changes. `staged`: whether a push is staged through host memory.
  absl::StatusOr<RequestHandle> CommitLocked(const PreparedPlan& plan,
                                             const SendOptions& send_options, uint64_t enqueue_ns,
                                             bool* staged) ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg_mu_);

  // Hands the request to the send thread, or, when the send thread is idle
  // and there is nothing to wait for (no ready event, no staging copy, a
  // transport whose Send never waits), sends it on this thread: one
  // hand-off fewer per round trip.
  absl::StatusOr<RequestHandle> Enqueue(RequestHandle handle, const SendOptions& send_options,
                                        bool staged);

  // How many servers `r` addresses; UNAVAILABLE when one it names is not a
  // member. Pushes to every server (Push::servers empty) skip the servers
  // that are not: the membership current at this post. A flag per server,
  // no lookup; the masking runs only while some rank is not a member.
  absl::StatusOr<int> CountLiveAddressed(const PreparedPlan& plan, Request& r) const;

  absl::Status GoneError(int s) const;

  // Send thread (or inline, under the send lock): the fence after the last
  // push to draining server `s`; every item queued before it went first.
  void SendFence(int s);

  // Every push of `r` addressed to server `s`, as one multi-part request.
  void SendPushes(Request& r, uint64_t request_id, int s);

  // The pending request a frame from `peer` answers.
  absl::StatusOr<Request*> AwaitingReply(NodeId peer, const FrameHeader& h) const;

  // --- request life (worker_wire.cc) ---
  void Settle(Request& r, int server, const absl::Status& status);

  // The worker-side stages of one server's reply (each a difference of two
  // stamps of one host; see Stage).
  void RecordStages(const TraceStamps& t);

  void Release(Request& r);

  // Frees the request's tensors for new requests, then reports it done.
  void Complete(Request& r);

  // Before MarkDone: the slot (and its stamps) is the application's to reuse after.
  void RecordTrace(const Request& r, uint64_t complete_ns);

  // A request that could not even be queued: undone as if it never happened.
  void Fail(uint32_t index, const absl::Status& why);

  MeshNode& node_;
  // The node's, for the data path (src/core/mesh_node.h says what each holds).
  const MeshOptions& options_;
  const PayloadIo& io_;
  LostPeers& lost_;
  MembershipView& membership_;
  StatsRecorder& stats_;
  TraceRing& trace_ring_;

  base::Mutex reg_mu_;  // the registrations, their in_flight flags, the free request slots

  // Registration slots: never freed while the worker lives (prepared
  // requests hold their addresses), reused through free_regs_.
  std::vector<std::unique_ptr<TensorRegistration>> reg_slots_ ABSL_GUARDED_BY(reg_mu_);
  std::vector<TensorRegistration*> free_regs_ ABSL_GUARDED_BY(reg_mu_);
  absl::flat_hash_map<Key, TensorRegistration*> push_regs_ ABSL_GUARDED_BY(reg_mu_);
  absl::flat_hash_map<std::pair<Key, int>, TensorRegistration*> pull_regs_ ABSL_GUARDED_BY(reg_mu_);

  PreparedPlan scratch_ ABSL_GUARDED_BY(reg_mu_);  // PushPull's

  RequestTable requests_;
  // Per server: it left by draining (set by the rendezvous thread): new posts
  // to it fail, the ones queued before go out ahead of its fence.
  std::unique_ptr<std::atomic<bool>[]> draining_;
  // Per server: the fence went (send lock held: send thread or inline send).
  std::vector<uint8_t> fence_sent_;
  base::RateLimiter violations_{10, absl::Seconds(10)};
};

}  // namespace stepmesh::core
