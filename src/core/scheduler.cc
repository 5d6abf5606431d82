// The rendezvous service (stepmesh/scheduler.h): one thread running an event
// loop over the listener and every control connection. Ranks, roster,
// barriers, liveness.
//
// Nothing a connection does can hold the loop: sockets are non-blocking,
// messages are reassembled from whatever arrived (ControlAssembler) and sent
// from a per-connection output buffer continued on writability, so a client
// that trickles a byte a second, never reads, or never finishes its handshake
// costs a descriptor and a few bytes until its own deadline, never the
// heartbeats of everyone else. Connections that have not joined are capped
// per source address and in total (the oldest goes first), and running out
// of descriptors backs off instead of spinning (base::Acceptor).
//
// A scheduler restarted on the same address rebuilds its roster from the
// participants that reconnect (kJoin with kJoinResume): after rendezvous the
// data plane never needs the scheduler, so losing it only pauses barriers and
// liveness reports until it is back.

#include "stepmesh/scheduler.h"

#include <sys/epoll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <list>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/event_loop.h"
#include "src/base/logging.h"
#include "src/base/net.h"
#include "src/base/rate_limit.h"
#include "src/base/sync.h"
#include "src/base/thread_util.h"
#include "src/core/auth.h"
#include "src/core/control_message.h"
#include "stepmesh/status.h"
#include "stepmesh/trace.h"

namespace stepmesh::core {
namespace {

// The context string both ends put into control-connection proofs.
constexpr char kControlAuthContext[] = "control";
// A connection gets this long (or the mesh timeout, if shorter) from accept to
// its join; participants need a round trip or two.
constexpr absl::Duration kJoinTimeout = absl::Seconds(10);
// Connections that have not joined yet, per source address and in total: at
// least these, and room for every participant of the mesh (CapsForPeers).
constexpr size_t kMaxPendingPerAddress = 16;
constexpr size_t kMaxPending = 64;
// What a not-yet-joined connection may send in one message (a join is an
// endpoint and a mesh id: well under this), and what a member may leave
// unread on its connection before it counts as lost.
constexpr uint32_t kMaxPendingPayload = 4096;
constexpr size_t kMaxUnsentBytes = 8 << 20;
// A refused connection gets this long to read why before it is closed.
constexpr absl::Duration kLinger = absl::Seconds(1);

struct Conn {
  enum class Stage { kHello, kProof, kJoin, kMember, kClosing };

  base::UniqueFd fd;
  std::string peer;  // remote address, for logs
  Stage stage = Stage::kHello;
  ControlAssembler in{kMaxPendingPayload};
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

struct Member {
  Conn* conn = nullptr;  // null while a resumed mesh waits for it to reconnect
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
  SchedulerImpl(const MeshOptions& options, base::EventLoop loop, base::Acceptor acceptor,
                std::string address)
      : options_(options),
        loop_(std::move(loop)),
        acceptor_(std::move(acceptor)),
        address_(std::move(address)),
        join_timeout_(std::min(options.timeout, kJoinTimeout)),
        join_caps_(base::CapsForPeers(static_cast<size_t>(options.WorkerCapacity()) +
                                          static_cast<size_t>(options.ServerCapacity()),
                                      {kMaxPendingPerAddress, kMaxPending})),
        workers_(options.WorkerCapacity()),
        servers_(options.ServerCapacity()),
        start_workers_(options.num_workers),
        start_servers_(options.num_servers) {
    thread_ = base::StartNamedThread("sm-scheduler", {}, [this] { Run(); });
  }
  ~SchedulerImpl() override { Stop(); }

  std::string address() const override { return address_; }

  absl::Status WaitUntilDone(absl::Duration timeout) override {
    if (!done_.WaitForNotificationWithTimeout(timeout)) {
      return absl::DeadlineExceededError("scheduler: participants still running");
    }
    return absl::OkStatus();
  }

  absl::Status WaitForParticipants() override {
    const absl::Time form_deadline = absl::Now() + options_.timeout;
    // Until everyone left or was lost: liveness is the heartbeat's (a
    // participant silent for options.timeout is lost), not a deadline here.
    while (!done_.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
      if (stop_.load()) return absl::CancelledError("scheduler: stopped while waiting");
      if (!formed_note_.HasBeenNotified() && absl::Now() >= form_deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("scheduler: the mesh did not form within ",
                         absl::FormatDuration(options_.timeout), " (", joined_count_.load(), " of ",
                         options_.num_workers + options_.num_servers, " participants joined)"));
      }
    }
    return absl::OkStatus();
  }

  void Stop() override {
    stop_.store(true);
    loop_.Wake();
    if (thread_.joinable()) thread_.join();
  }

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

  // --- connections ---

  // Queues `m` on `c` and writes what the socket takes now.
  void Queue(Conn& c, const ControlMessage& m) {
    if (c.out_sent == c.out.size()) {
      c.out.clear();
      c.out_sent = 0;
    }
    c.out += EncodeControl(m);
    Flush(c);
  }

  // Writes queued bytes without blocking; false when the connection broke.
  bool Flush(Conn& c) {
    while (c.out_sent < c.out.size()) {
      const ssize_t n = ::send(c.fd.get(), c.out.data() + c.out_sent, c.out.size() - c.out_sent,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.out_sent += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      return false;
    }
    if (c.out_sent == c.out.size()) {
      c.out.clear();
      c.out_sent = 0;
    }
    return true;
  }

  // Tells a connection that has not joined why it is refused, then closes it
  // once that went out (or after kLinger).
  void Refuse(Conn& c, absl::string_view reason) {
    STEPMESH_LOG_LIMITED(refusals_, kWarning, "scheduler: refused ", c.peer, ": ", reason);
    ControlMessage m;
    m.type = ControlType::kReject;
    m.text = std::string(reason);
    Queue(c, m);
    c.stage = Conn::Stage::kClosing;
    c.deadline = absl::Now() + kLinger;
  }

  // A protocol violation by a connection that has not joined: logged (rate
  // limited, with the address and the reason) and closed.
  void Drop(Conn& c, absl::string_view reason) {
    STEPMESH_LOG_LIMITED(violations_, kWarning, "scheduler: dropped the connection from ", c.peer,
                         ": ", reason);
    Close(c);
  }

  void Close(Conn& c) {
    if (c.watched) loop_.Unwatch(c.fd.get());
    c.fd.Reset();
    if (c.node != kNoNode && At(c.node).conn == &c) At(c.node).conn = nullptr;
    c.node = kNoNode;
  }

  void Accept(absl::Time now) {
    base::AcceptAndAdmit(
        acceptor_, exhausted_, "scheduler", conns_,
        [](const Conn& c) { return c.fd.valid() && c.pending(); },
        [](const Conn& c) -> const std::string& { return c.peer; }, join_caps_,
        [this](Conn& c, const std::string& why) { Drop(c, why); },
        [&](base::Acceptor::Accepted accepted) {
          conns_.emplace_back();
          Conn& c = conns_.back();
          c.fd = std::move(accepted.fd);
          c.peer = std::move(accepted.peer);
          c.accepted = now;
          c.deadline = now + join_timeout_;
        });
  }

  // Reads what arrived and handles complete messages; bounded per call, so
  // one busy connection cannot starve the others.
  void Read(Conn& c) {
    std::byte chunk[16 << 10];
    for (int round = 0; round < 4 && c.fd.valid(); ++round) {
      const ssize_t n = ::recv(c.fd.get(), chunk, sizeof(chunk), MSG_DONTWAIT);
      if (n == 0) return Broken(c, "closed the connection");
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        return Broken(c, base::ErrnoMessage("recv", errno));
      }
      if (c.stage == Conn::Stage::kClosing) continue;  // draining before the close
      c.in.Feed(absl::MakeConstSpan(chunk, static_cast<size_t>(n)));
      for (int messages = 0; messages < 64 && c.fd.valid() && c.stage != Conn::Stage::kClosing;
           ++messages) {
        absl::StatusOr<std::optional<ControlMessage>> m = c.in.Next();
        if (!m.ok()) return Violation(c, m.status().ToString());
        if (!m->has_value()) break;
        if (c.stage == Conn::Stage::kMember) {
          HandleMessage(c.node, **m);
        } else {
          Advance(c, **m);
        }
      }
    }
  }

  void Broken(Conn& c, absl::string_view why) {
    if (c.stage == Conn::Stage::kMember) {
      const NodeId node = c.node;
      Close(c);
      MarkLost(node, std::string(why));
      return;
    }
    if (c.stage != Conn::Stage::kClosing) {
      STEPMESH_LOG(kInfo, "scheduler: ", c.peer, " ", why, " before joining");
    }
    Close(c);
  }

  void Violation(Conn& c, absl::string_view why) {
    if (c.stage == Conn::Stage::kMember) {
      const NodeId node = c.node;
      STEPMESH_LOG_LIMITED(violations_, kWarning, "scheduler: ", PeerName(node), " (", c.peer,
                           ") broke the control protocol: ", why);
      Close(c);
      MarkLost(node, absl::StrCat("broke the control protocol: ", why));
      return;
    }
    Drop(c, why);
  }

  // --- the handshake of a connection that has not joined ---

  void Advance(Conn& c, const ControlMessage& m) {
    const bool need_auth = !options_.auth_token.empty();
    switch (c.stage) {
      case Conn::Stage::kHello:
        if (m.type == ControlType::kChallenge) {
          if (!need_auth) {
            return Refuse(c, "this scheduler has no auth token; the participant has one");
          }
          absl::StatusOr<AuthNonce> nonce = RandomNonce();
          if (!NonceFromText(m.text, &c.dialer_nonce)) {
            return Violation(c, "malformed authentication challenge");
          }
          if (!nonce.ok()) return Refuse(c, nonce.status().ToString());
          c.acceptor_nonce = *nonce;
          ControlMessage challenge;
          challenge.type = ControlType::kChallenge;
          challenge.text = std::string(AsText(c.acceptor_nonce));
          ControlMessage proof;
          proof.type = ControlType::kProof;
          proof.text =
              std::string(AsText(AuthProof(options_.auth_token, AuthSide::kAcceptor,
                                           kControlAuthContext, c.dialer_nonce, c.acceptor_nonce)));
          Queue(c, challenge);
          Queue(c, proof);
          c.stage = Conn::Stage::kProof;
          return;
        }
        if (m.type == ControlType::kJoin && !need_auth) return HandleJoin(c, m);
        if (m.type == ControlType::kJoin) {
          return Refuse(c, "authentication required (set STEPMESH_AUTH_TOKEN)");
        }
        return Violation(
            c, absl::StrCat("sent control message ", static_cast<int>(m.type), " before joining"));
      case Conn::Stage::kProof:
        if (m.type != ControlType::kProof ||
            !CheckAuthProof(options_.auth_token, AuthSide::kDialer, kControlAuthContext,
                            c.dialer_nonce, c.acceptor_nonce, m.text)) {
          return Refuse(c, "authentication failed (wrong auth token?)");
        }
        c.stage = Conn::Stage::kJoin;
        return;
      case Conn::Stage::kJoin:
        if (m.type != ControlType::kJoin) {
          return Violation(c, "expected a join after authenticating");
        }
        return HandleJoin(c, m);
      case Conn::Stage::kMember:
      case Conn::Stage::kClosing:
        return;
    }
  }

  // Why a join's mesh differs from this scheduler's, or empty.
  std::string ShapeMismatch(const ControlMessage& join) const {
    const std::string who =
        absl::StrCat(RoleName(static_cast<Role>(join.role)), " ",
                     join.rank < 0 ? std::string("(any rank)") : absl::StrCat("rank ", join.rank));
    if (join.num_workers != static_cast<uint32_t>(options_.num_workers) ||
        join.num_servers != static_cast<uint32_t>(options_.num_servers)) {
      return absl::StrCat(who, " was configured for ", join.num_workers, " workers and ",
                          join.num_servers, " servers, but this mesh has ", options_.num_workers,
                          " workers and ", options_.num_servers,
                          " servers (num_workers/num_servers: STEPMESH_NUM_WORKERS/"
                          "STEPMESH_NUM_SERVERS or the program's flags)");
    }
    if (join.max_workers != static_cast<uint32_t>(options_.WorkerCapacity()) ||
        join.max_servers != static_cast<uint32_t>(options_.ServerCapacity())) {
      return absl::StrCat(who, " was configured for a capacity of ", join.max_workers,
                          " workers and ", join.max_servers, " servers, but this mesh has ",
                          options_.WorkerCapacity(), " and ", options_.ServerCapacity(),
                          " (max_workers/max_servers: STEPMESH_MAX_WORKERS/STEPMESH_MAX_SERVERS)");
    }
    if (join.mesh_id != options_.mesh_id) {
      return absl::StrCat(who, " names mesh '", join.mesh_id, "' but this scheduler runs mesh '",
                          options_.mesh_id, "' (mesh_id: STEPMESH_MESH_ID)");
    }
    return "";
  }

  void HandleJoin(Conn& c, const ControlMessage& join) {
    if (std::string mismatch = ShapeMismatch(join); !mismatch.empty()) {
      return Refuse(c, mismatch);
    }
    if (join.join_flags & kJoinResume) return HandleResume(c, join);
    const Role role = static_cast<Role>(join.role);  // the decoder admits workers and servers
    auto& group = Group(role);
    const int start = role == Role::kWorker ? start_workers_ : start_servers_;
    // Once the mesh formed, a rank whose process was lost or left may be taken
    // by a new process (a restart, or a join into the running mesh); before
    // that, every rank is joined once, and an unasked rank comes from the
    // start shape.
    auto replaceable = [&](const Member& m) { return formed_ && m.joined && (m.lost || m.left); };
    int rank = join.rank;
    if (rank < 0) {
      const size_t limit = formed_ ? group.size() : static_cast<size_t>(start);
      for (size_t r = 0; r < limit && rank < 0; ++r) {
        if (!group[r].joined || replaceable(group[r])) rank = static_cast<int>(r);
      }
    }
    if (rank < 0 || rank >= static_cast<int>(group.size())) {
      const char* option = role == Role::kWorker ? "max_workers, STEPMESH_MAX_WORKERS"
                                                 : "max_servers, STEPMESH_MAX_SERVERS";
      if (join.rank < 0 && formed_) {
        return Refuse(c, absl::StrCat("no free ", RoleName(role), " rank: all ", group.size(),
                                      " of the mesh's capacity (", option, ") are members"));
      }
      return Refuse(c, absl::StrCat("no free ", RoleName(role), " rank (wanted ", join.rank,
                                    ", mesh has ", start, " at the start and a capacity of ",
                                    group.size(), " (", option, "))"));
    }
    Member& member = group[rank];
    const NodeId node = MakeNodeId(role, rank);
    const bool rejoin = replaceable(member);
    if (member.joined && !rejoin) {
      return Refuse(
          c, absl::StrCat(PeerName(node), " already joined",
                          member.conn != nullptr ? absl::StrCat(" from ", member.conn->peer)
                                                 : std::string(" (waiting for it to reconnect)")));
    }
    Admit(c, node, join.text);
    member.barrier = 0;
    member.draining = false;
    if (formed_) {
      // A join into the running mesh: a restarted process under its old
      // rank, or a new member. It counts in barriers from the next one on (a
      // barrier in progress passes without it), and everyone hears of it as
      // the next epoch.
      member.barrier = BarrierInProgress();
      STEPMESH_LOG(kInfo, "scheduler: ", PeerName(node), rejoin ? " rejoined" : " joined",
                   " the running mesh from ", c.peer, " (epoch ", epoch_ + 1, ")");
      ControlMessage m;
      m.type = ControlType::kPeerJoined;
      m.node = node;
      m.text = member.endpoint;
      m.epoch = ++epoch_;
      SendRoster(node);
      ForEachMember([&](NodeId other, Member& o) {
        if (other != node && o.live()) Send(other, m);
      });
      return;
    }
    bool all = true;
    ForEachMember([&](NodeId n, Member& o) {
      if (static_cast<int>(NodeRank(n)) <
          (NodeRole(n) == Role::kWorker ? start_workers_ : start_servers_)) {
        all = all && o.joined;
      }
    });
    if (all) {
      formed_ = true;
      if (!formed_note_.HasBeenNotified()) formed_note_.Notify();
      ForEachMember([&](NodeId n, Member& o) {
        if (o.live()) SendRoster(n);
      });
    }
  }

  // A participant of a formed mesh reconnecting after this scheduler
  // (re)started: it keeps its rank, endpoint and barrier count. The first one
  // tells this scheduler that the mesh formed before it; every rank then
  // counts as joined and gets `timeout` to reconnect before it is lost.
  void HandleResume(Conn& c, const ControlMessage& join) {
    const Role role = static_cast<Role>(join.role);
    auto& group = Group(role);
    if (join.rank < 0 || join.rank >= static_cast<int>(group.size())) {
      return Refuse(c, absl::StrCat(RoleName(role), " rank ", join.rank, " out of range [0, ",
                                    group.size(), ")"));
    }
    const NodeId node = MakeNodeId(role, join.rank);
    Member& member = group[join.rank];
    if (!formed_) {
      bool fresh = true;
      ForEachMember([&](NodeId, Member& o) { fresh = fresh && !o.joined; });
      if (!fresh) {
        return Refuse(c, absl::StrCat(PeerName(node),
                                      " resumes a mesh, but this scheduler is forming a new one"));
      }
      STEPMESH_LOG(kWarning, "scheduler: ", PeerName(node),
                   " resumes a running mesh: rebuilding the roster from the participants that "
                   "reconnect (each gets ",
                   absl::FormatDuration(options_.timeout), ")");
      formed_ = true;
      if (!formed_note_.HasBeenNotified()) formed_note_.Notify();
      const absl::Time now = absl::Now();
      ForEachMember([&](NodeId n, Member& o) {
        // The start shape; members beyond it are known once they reconnect.
        if (static_cast<int>(NodeRank(n)) >=
            (NodeRole(n) == Role::kWorker ? start_workers_ : start_servers_)) {
          return;
        }
        o.joined = true;
        o.last_heard = now;
      });
    }
    epoch_ = std::max(epoch_, join.epoch);
    if (!member.joined) {
      // A member that joined the running mesh beyond the start shape.
      member.joined = true;
      joined_count_.fetch_add(1);
    }
    if (!member.live()) {
      return Refuse(c, absl::StrCat(PeerName(node),
                                    " was declared lost while it was away; restart it to rejoin"));
    }
    if (member.conn != nullptr) {
      return Refuse(c,
                    absl::StrCat(PeerName(node), " is already connected from ", member.conn->peer));
    }
    Admit(c, node, join.text);
    STEPMESH_LOG(kInfo, "scheduler: ", PeerName(node), " reconnected from ", c.peer);
    member.barrier = join.sequence;
    released_ = std::max(released_, join.barrier_released);
    SendRoster(node);
    if (member.barrier <= released_ && member.barrier > join.barrier_released) {
      // Released while it was away (another participant saw the release).
      ControlMessage release;
      release.type = ControlType::kRelease;
      release.sequence = member.barrier;
      Send(node, release);
    }
    MaybeReleaseBarrier();
  }

  void Admit(Conn& c, NodeId node, const std::string& endpoint) {
    Member& member = At(node);
    c.stage = Conn::Stage::kMember;
    c.node = node;
    c.deadline = absl::InfiniteFuture();
    c.in.set_max_payload(kMaxControlPayload);  // members may send the largest messages
    member.conn = &c;
    member.endpoint = endpoint;
    if (!member.joined) joined_count_.fetch_add(1);
    member.joined = true;
    member.left = member.lost = false;
    member.last_heard = absl::Now();
  }

  // --- members ---

  void Send(NodeId node, const ControlMessage& m) {
    Member& member = At(node);
    if (member.conn == nullptr) return;
    Conn& c = *member.conn;
    Queue(c, m);
    if (!c.fd.valid()) return;
    if (c.out.size() - c.out_sent > kMaxUnsentBytes) {
      const size_t unsent = c.out.size() - c.out_sent;
      Close(c);
      MarkLost(node,
               absl::StrCat("does not read its control connection (", unsent, " bytes unsent)"));
    }
  }

  void MarkLost(NodeId node, const std::string& reason) {
    Member& member = At(node);
    if (!member.live()) return;
    if (!formed_) return Unjoin(node, reason);
    member.lost = true;
    if (member.conn != nullptr) Close(*member.conn);
    if (member.draining) {
      // Counted out when it began to drain: the peers learn of the rest from
      // their data connections.
      STEPMESH_LOG(kWarning, "scheduler: ", PeerName(node), " lost while draining: ", reason);
      MaybeReleaseBarrier();
      return;
    }
    STEPMESH_LOG(kWarning, "scheduler: ", PeerName(node), " lost: ", reason);
    ControlMessage m;
    m.type = ControlType::kPeerLost;
    m.node = node;
    m.epoch = ++epoch_;
    m.text = reason;  // the reason only: receivers name the peer themselves
    ForEachMember([&](NodeId other, Member& o) {
      if (o.live()) Send(other, m);
    });
    MaybeReleaseBarrier();
  }

  // Before the mesh formed nobody has a roster, so a member that is lost or
  // leaves is simply taken off it: its rank is free again (a restarted
  // process takes it), the others keep waiting within their own timeouts, and
  // the roster they get lists only processes that are there.
  void Unjoin(NodeId node, absl::string_view reason, bool orderly = false) {
    Member& member = At(node);
    if (member.conn != nullptr) Close(*member.conn);
    if (orderly) {
      STEPMESH_LOG(kInfo, "scheduler: ", PeerName(node),
                   " left before the mesh formed; its rank is open again");
    } else {
      STEPMESH_LOG(kWarning, "scheduler: ", PeerName(node), " lost before the mesh formed (",
                   reason, "); its rank is open again");
    }
    member = Member{};
  }

  // The members of the current epoch (live, not draining), with their
  // endpoints, the epoch, and the barrier count `node` starts from.
  void SendRoster(NodeId node) {
    ControlMessage m;
    m.type = ControlType::kRoster;
    m.rank = static_cast<int32_t>(NodeRank(node));
    m.epoch = epoch_;
    m.sequence = At(node).barrier;
    ForEachMember([&](NodeId n, Member& o) {
      if (o.live() && !o.draining) m.roster.push_back({n, o.endpoint});
    });
    Send(node, m);
  }

  // The barrier the members have entered and not yet passed (the highest
  // entered), else the last released: a member joining now counts as
  // having entered it.
  uint64_t BarrierInProgress() {
    uint64_t entered = released_;
    ForEachMember([&](NodeId, Member& o) {
      if (o.live() && !o.draining) entered = std::max(entered, o.barrier);
    });
    return entered;
  }

  // A new epoch in which `node` is no longer a member, told to the live
  // others; a barrier waiting only for it may now pass.
  void AnnounceLeft(NodeId node) {
    ControlMessage left;
    left.type = ControlType::kPeerLeft;
    left.node = node;
    left.epoch = ++epoch_;
    ForEachMember([&](NodeId other, Member& o) {
      if (other != node && o.live()) Send(other, left);
    });
    MaybeReleaseBarrier();
  }

  void MaybeReleaseBarrier() {
    uint64_t lowest = ~uint64_t{0};
    bool any = false;
    ForEachMember([&](NodeId, Member& o) {
      if (!o.live() || o.draining) return;
      any = true;
      lowest = std::min(lowest, o.barrier);
    });
    if (!any || lowest <= released_) return;
    released_ = lowest;
    ControlMessage m;
    m.type = ControlType::kRelease;
    m.sequence = lowest;
    ForEachMember([&](NodeId n, Member& o) {
      if (o.live()) Send(n, m);
    });
  }

  void HandleMessage(NodeId node, const ControlMessage& m) {
    Member& member = At(node);
    member.last_heard = absl::Now();
    switch (m.type) {
      case ControlType::kBarrier:
        if (m.sequence <= released_) {
          // A rejoined process counts its barriers from 1 again: ones the mesh
          // already passed are released at once instead of never.
          ControlMessage release;
          release.type = ControlType::kRelease;
          release.sequence = m.sequence;
          Send(node, release);
          break;
        }
        member.barrier = m.sequence;
        MaybeReleaseBarrier();
        break;
      case ControlType::kDrain: {
        if (!formed_ || member.draining) break;
        // Counted out now (a new epoch, "left" to the others), still
        // connected while it answers what it received.
        member.draining = true;
        STEPMESH_LOG(kInfo, "scheduler: ", PeerName(node), " drains before leaving (epoch ",
                     epoch_ + 1, ")");
        AnnounceLeft(node);
        break;
      }
      case ControlType::kLeave: {
        if (!formed_) {
          Unjoin(node, "left", /*orderly=*/true);
          break;
        }
        member.left = true;
        if (member.conn != nullptr) Close(*member.conn);
        if (member.draining) {
          STEPMESH_LOG(kInfo, "scheduler: ", PeerName(node), " drained and left");
          MaybeReleaseBarrier();
          break;
        }
        // The peers learn of a departure from its data connection's goodbye,
        // which follows the departing node's last frames. This notice is for
        // the one peer that cannot tell that goodbye from a previous process's
        // (a server still connecting a rejoined worker, see server.cc).
        AnnounceLeft(node);
        break;
      }
      case ControlType::kPong:
        break;
      case ControlType::kClock: {
        // Answered at once, so the participant's round trip bounds the error.
        ControlMessage reply;
        reply.type = ControlType::kClock;
        reply.sequence = m.sequence;
        reply.clock_ns = MonotonicNowNs();
        Send(node, reply);
        break;
      }
      default:
        if (member.conn != nullptr) {
          Violation(*member.conn,
                    absl::StrCat("sent unexpected control message ", static_cast<int>(m.type)));
        }
    }
  }

  void Heartbeat(absl::Time now) {
    if (now - last_ping_ < options_.heartbeat_interval) return;
    last_ping_ = now;
    ControlMessage ping;
    ping.type = ControlType::kPing;
    ping.sequence = ++ping_sequence_;
    ForEachMember([&](NodeId n, Member& o) {
      if (!o.live()) return;
      if (now - o.last_heard > options_.timeout) {
        MarkLost(n, o.conn == nullptr
                        ? absl::StrCat("did not reconnect to the restarted scheduler within ",
                                       absl::FormatDuration(options_.timeout))
                        : absl::StrCat("silent for ", absl::FormatDuration(now - o.last_heard)));
        return;
      }
      Send(n, ping);
    });
  }

  void Expire(absl::Time now) {
    for (Conn& c : conns_) {
      if (!c.fd.valid() || now < c.deadline) continue;
      if (c.stage == Conn::Stage::kClosing) {
        Close(c);
      } else if (c.pending()) {
        Drop(c, absl::StrCat("did not join within ", absl::FormatDuration(join_timeout_)));
      }
    }
    conns_.remove_if([](const Conn& c) { return !c.fd.valid(); });
  }

  void Run() {
    // The loop watches the listener (while not paused) and every connection,
    // for writability too while it has bytes to write.
    bool listening = false;
    epoll_event events[64];
    while (!stop_.load()) {
      absl::Time now = absl::Now();
      if (const bool listen = now >= acceptor_.paused_until(); listen != listening) {
        if (listen) {
          listening = loop_.Watch(acceptor_.fd(), EPOLLIN, kListenerToken).ok();
        } else {
          loop_.Unwatch(acceptor_.fd());
          listening = false;
        }
      }
      absl::Time wake = now + absl::Milliseconds(50);
      for (Conn& c : conns_) {
        if (!c.fd.valid()) continue;
        const bool out = c.out_sent < c.out.size();
        const uint32_t wanted = EPOLLIN | (out ? uint32_t{EPOLLOUT} : 0u);
        const uint64_t token = reinterpret_cast<uintptr_t>(&c);
        if (!c.watched) {
          c.watched = loop_.Watch(c.fd.get(), wanted, token).ok();
          c.out_armed = out;
        } else if (out != c.out_armed && loop_.Modify(c.fd.get(), wanted, token).ok()) {
          c.out_armed = out;
        }
        wake = std::min(wake, c.deadline);
      }
      const int timeout_ms =
          static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(wake - now) + 1, 0, 50));
      absl::StatusOr<int> ready = loop_.Wait(events, 64, timeout_ms);
      if (!ready.ok()) {
        STEPMESH_LOG_LIMITED(violations_, kWarning, "scheduler: ", ready.status().message());
      }
      now = absl::Now();
      for (int i = 0; i < (ready.ok() ? *ready : 0); ++i) {
        if (events[i].data.u64 == kListenerToken) {
          Accept(now);
          continue;
        }
        // Connections leave the loop before they close, and the list only in
        // Expire below: the pointer is valid.
        Conn& c = *reinterpret_cast<Conn*>(static_cast<uintptr_t>(events[i].data.u64));
        if (!c.fd.valid()) continue;  // closed while handling an earlier one
        const uint32_t revents = events[i].events;
        // Reads first: a participant that leaves sends its kLeave and closes
        // with our messages unread, which resets the connection; its leave
        // is still in the receive queue, and must be read before a write
        // that fails on the reset declares it lost.
        if (revents & (EPOLLIN | EPOLLHUP | EPOLLERR)) Read(c);
        if (!c.fd.valid()) continue;
        if ((revents & EPOLLOUT) && !Flush(c)) {
          Broken(c, "connection reset while writing");
          continue;
        }
        if (c.stage == Conn::Stage::kClosing && c.out_sent == c.out.size()) Close(c);
      }
      Expire(now);
      if (formed_) {
        Heartbeat(now);
        bool anyone = false;
        ForEachMember([&](NodeId, Member& o) { anyone = anyone || o.live(); });
        if (!anyone && !done_.HasBeenNotified()) done_.Notify();
      }
    }
  }

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

}  // namespace
}  // namespace stepmesh::core

namespace stepmesh {

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Start(const MeshOptions& options) {
  STEPMESH_RETURN_IF_ERROR(options.Validate());
  STEPMESH_ASSIGN_OR_RETURN(base::HostPort where, base::ParseHostPort(options.scheduler));
  bool open_on_loopback = false;
  STEPMESH_RETURN_IF_ERROR(
      core::CheckAuthPolicy(options, "the scheduler", where.host, &open_on_loopback));
  STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd listener, base::ListenTcp(where.host, where.port));
  STEPMESH_ASSIGN_OR_RETURN(uint16_t port, base::LocalPort(listener.get()));
  STEPMESH_ASSIGN_OR_RETURN(base::Acceptor acceptor, base::Acceptor::Create(std::move(listener)));
  const std::string address = absl::StrCat(where.host, ":", port);
  if (open_on_loopback) {
    STEPMESH_LOG(kWarning, "scheduler at ", address,
                 ": no auth token, so any local process can join this mesh (set "
                 "STEPMESH_AUTH_TOKEN on every process, or STEPMESH_AUTH=off to silence this)");
  }
  STEPMESH_ASSIGN_OR_RETURN(base::EventLoop loop, base::EventLoop::Create());
  return std::unique_ptr<Scheduler>(
      new core::SchedulerImpl(options, std::move(loop), std::move(acceptor), address));
}

}  // namespace stepmesh
