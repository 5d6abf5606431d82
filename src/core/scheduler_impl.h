#pragma once
// The rendezvous service's state and its jobs (stepmesh/scheduler.h), for
// the files that implement it; nothing else includes this. One thread runs
// an event loop over the listener and every control connection:
//   scheduler.cc             the loop, connections (accept, read, write, close)
//   scheduler_admission.cc   a connection's handshake, join and resume
//   scheduler_membership.cc  members: sends, roster, lost / left, epochs
//   scheduler_barriers.cc    barriers
//   scheduler_liveness.cc    heartbeats, and silent members declared lost
// Every member function runs on the scheduler's thread, except the public
// ones of Scheduler (they touch only the atomics and notifications).

#include <atomic>
#include <list>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "src/base/admission.h"
#include "src/base/event_loop.h"
#include "src/base/net.h"
#include "src/base/rate_limit.h"
#include "src/base/sync.h"
#include "src/core/auth.h"
#include "src/core/control_message.h"
#include "stepmesh/options.h"
#include "stepmesh/scheduler.h"

namespace stepmesh::core {

// What a not-yet-joined connection may send in one message (a join is an
// endpoint and a mesh id: well under this).
inline constexpr uint32_t kSchedulerMaxPendingPayload = 4096;

// One control connection, from accept to close.
struct SchedulerConn {
  enum class Stage { kHello, kProof, kJoin, kMember, kClosing };

  base::UniqueFd fd;
  std::string peer;  // remote address, for logs
  Stage stage = Stage::kHello;
  ControlAssembler in{kSchedulerMaxPendingPayload};
  std::string out;      // encoded messages not yet written
  size_t out_sent = 0;  // bytes of `out` written
  absl::Time accepted;
  absl::Time deadline;  // not joined by then (or, closing, not drained): closed
  AuthNonce dialer_nonce{};
  AuthNonce acceptor_nonce{};
  NodeId node = kNoNode;   // kMember
  bool watched = false;    // in the scheduler's event loop
  bool out_armed = false;  // watched for writability
  bool pending() const { return stage != Stage::kMember && stage != Stage::kClosing; }
};

// One rank of the mesh's capacity.
struct SchedulerMember {
  SchedulerConn* conn = nullptr;  // null while a resumed mesh waits for it to reconnect
  std::string endpoint;
  bool joined = false;
  bool left = false;
  bool lost = false;
  bool draining = false;  // counted out (kDrain); still connected until it leaves
  uint64_t barrier = 0;
  absl::Time last_heard;
  bool live() const { return joined && !left && !lost; }
};

class SchedulerImpl final : public Scheduler {
 public:
  using Conn = SchedulerConn;
  using Member = SchedulerMember;

  // Starts the scheduler's thread.
  SchedulerImpl(const MeshOptions& options, base::EventLoop loop, base::Acceptor acceptor,
                std::string address);
  ~SchedulerImpl() override { Stop(); }

  std::string address() const override { return address_; }
  absl::Status WaitUntilDone(absl::Duration timeout) override;
  absl::Status WaitForParticipants() override;
  void Stop() override;

 private:
  std::vector<Member>& Group(Role role) { return role == Role::kWorker ? workers_ : servers_; }
  Member& At(NodeId node) { return Group(NodeRole(node))[NodeRank(node)]; }

  template <typename Fn>
  void ForEachMember(Fn fn) {
    for (Role role : {Role::kWorker, Role::kServer}) {
      auto& group = Group(role);
      for (size_t r = 0; r < group.size(); ++r) fn(MakeNodeId(role, r), group[r]);
    }
  }

  // --- connections (scheduler.cc) ---
  void Queue(Conn& c, const ControlMessage& m);
  bool Flush(Conn& c);
  void Refuse(Conn& c, absl::string_view reason);
  void Drop(Conn& c, absl::string_view reason);
  void Close(Conn& c);
  void Accept(absl::Time now);
  void Read(Conn& c);
  void Broken(Conn& c, absl::string_view why);
  void Violation(Conn& c, absl::string_view why);
  void Expire(absl::Time now);
  void Run();

  // --- the handshake of a connection that has not joined (scheduler_admission.cc) ---
  void Advance(Conn& c, const ControlMessage& m);
  std::string ShapeMismatch(const ControlMessage& join) const;
  void HandleJoin(Conn& c, const ControlMessage& join);
  void HandleResume(Conn& c, const ControlMessage& join);
  void Admit(Conn& c, NodeId node, const std::string& endpoint);

  // --- members and epochs (scheduler_membership.cc) ---
  void Send(NodeId node, const ControlMessage& m);
  void MarkLost(NodeId node, const std::string& reason);
  void Unjoin(NodeId node, absl::string_view reason, bool orderly = false);
  void SendRoster(NodeId node);
  void AnnounceLeft(NodeId node);
  void HandleMessage(NodeId node, const ControlMessage& m);

  // --- barriers (scheduler_barriers.cc) ---
  void HandleBarrier(NodeId node, const ControlMessage& m);
  uint64_t BarrierInProgress();
  void MaybeReleaseBarrier();

  // --- liveness (scheduler_liveness.cc) ---
  void Heartbeat(absl::Time now);

  static constexpr uint64_t kListenerToken = 0;  // connections: their Conn*

  const MeshOptions options_;
  base::EventLoop loop_;
  base::Acceptor acceptor_;
  const std::string address_;
  const absl::Duration join_timeout_;
  const base::AdmissionCaps join_caps_;
  std::list<Conn> conns_;        // stable addresses: members point at theirs
  std::vector<Member> workers_;  // the capacity; ranks below start_* form the mesh
  std::vector<Member> servers_;
  const int start_workers_;
  const int start_servers_;
  // Membership changes since the mesh formed (epoch 0), each announced with
  // its number; a restarted scheduler takes the highest a member resumes with.
  uint64_t epoch_ = 0;
  bool formed_ = false;  // every rank joined once (or the mesh resumed here)
  uint64_t released_ = 0;
  uint64_t ping_sequence_ = 0;
  absl::Time last_ping_ = absl::InfinitePast();
  base::RateLimiter refusals_{10, absl::Seconds(10)};
  base::RateLimiter violations_{10, absl::Seconds(10)};
  base::RateLimiter exhausted_{1, absl::Seconds(10)};
  std::atomic<bool> stop_{false};
  base::Notification done_;
  base::Notification formed_note_;    // formed_, for WaitForParticipants
  std::atomic<int> joined_count_{0};  // members that joined, for its error
  std::thread thread_;
};

}  // namespace stepmesh::core
