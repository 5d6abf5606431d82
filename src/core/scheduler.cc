// The rendezvous service (stepmesh/scheduler.h): one thread, poll() over a
// handful of control connections. Ranks, roster, barriers, liveness.

#include "stepmesh/scheduler.h"

#include <poll.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/base/net.h"
#include "src/base/sync.h"
#include "src/base/thread_util.h"
#include "src/core/auth.h"
#include "src/core/control_message.h"
#include "stepmesh/status.h"

namespace stepmesh::core {
namespace {

struct Member {
  base::UniqueFd fd;
  std::string endpoint;
  bool joined = false;
  bool left = false;
  bool lost = false;
  uint64_t barrier = 0;
  absl::Time last_heard;
  bool live() const { return joined && !left && !lost; }
};

// A connection accepted but not yet joined. With an auth token it must first
// complete the challenge-response (kChallenge, then kProof) before kJoin.
struct Pending {
  enum class Stage { kHello, kProof, kJoin };
  base::UniqueFd fd;
  Stage stage = Stage::kHello;
  AuthNonce dialer_nonce{};
  AuthNonce acceptor_nonce{};
  absl::Time deadline;  // dropped when it has not joined by then (no fd hoarding)
};

// The context string both ends put into control-connection proofs.
constexpr char kControlAuthContext[] = "control";

class SchedulerImpl final : public Scheduler {
 public:
  SchedulerImpl(const MeshOptions& options, base::UniqueFd listener, std::string address)
      : options_(options),
        listener_(std::move(listener)),
        address_(std::move(address)),
        workers_(options.num_workers),
        servers_(options.num_servers) {
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

  void Stop() override {
    stop_.store(true);
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

  void Send(NodeId node, const ControlMessage& m) {
    Member& member = At(node);
    if (!member.fd.valid()) return;
    absl::Status s = SendControl(member.fd.get(), m, absl::Now() + absl::Seconds(1));
    if (!s.ok()) MarkLost(node, absl::StrCat("control write failed: ", s.message()));
  }

  void MarkLost(NodeId node, const std::string& reason) {
    Member& member = At(node);
    if (!member.live()) return;
    member.lost = true;
    member.fd.Reset();
    STEPMESH_LOG(kWarning, "scheduler: ", PeerName(node), " lost: ", reason);
    ControlMessage m;
    m.type = ControlType::kPeerLost;
    m.node = node;
    m.text = absl::StrCat(PeerName(node), " lost: ", reason);
    ForEachMember([&](NodeId other, Member& o) {
      if (o.live()) Send(other, m);
    });
    MaybeReleaseBarrier();
  }

  void HandleJoin(base::UniqueFd fd, const ControlMessage& join) {
    const Role role = static_cast<Role>(join.role);  // the decoder admits workers and servers
    auto& group = Group(role);
    // Once the mesh formed, a rank whose process was lost or left may be taken
    // by a new process (a restart); before that, every rank is joined once.
    auto replaceable = [&](const Member& m) { return roster_sent_ && m.joined && (m.lost || m.left); };
    int rank = join.rank;
    if (rank < 0) {
      for (size_t r = 0; r < group.size() && rank < 0; ++r) {
        if (!group[r].joined) rank = static_cast<int>(r);
      }
      for (size_t r = 0; r < group.size() && rank < 0; ++r) {
        if (replaceable(group[r])) rank = static_cast<int>(r);
      }
    }
    auto reject = [&](const std::string& reason) {
      ControlMessage m;
      m.type = ControlType::kReject;
      m.text = reason;
      (void)SendControl(fd.get(), m, absl::Now() + absl::Seconds(1));
      STEPMESH_LOG(kWarning, "scheduler: refused a join: ", reason);
    };
    if (rank < 0 || rank >= static_cast<int>(group.size())) {
      return reject(absl::StrCat("no free ", RoleName(role), " rank (wanted ", join.rank,
                                 ", mesh has ", group.size(), ")"));
    }
    Member& member = group[rank];
    const bool rejoin = replaceable(member);
    if (member.joined && !rejoin) {
      return reject(absl::StrCat(RoleName(role), " rank ", rank, " already joined"));
    }
    member.fd = std::move(fd);
    member.endpoint = join.text;
    member.joined = true;
    member.left = member.lost = false;
    member.last_heard = absl::Now();
    const NodeId node = MakeNodeId(role, rank);
    if (rejoin) {
      SendRoster(node);
      ControlMessage m;
      m.type = ControlType::kPeerJoined;
      m.node = node;
      m.text = member.endpoint;
      ForEachMember([&](NodeId other, Member& o) {
        if (other != node && o.live()) Send(other, m);
      });
      return;
    }
    bool all = true;
    ForEachMember([&](NodeId, Member& o) { all = all && o.joined; });
    if (all) {
      roster_sent_ = true;
      ForEachMember([&](NodeId n, Member& o) {
        if (o.live()) SendRoster(n);
      });
    }
  }

  void SendRoster(NodeId node) {
    ControlMessage m;
    m.type = ControlType::kRoster;
    m.rank = static_cast<int32_t>(NodeRank(node));
    ForEachMember([&](NodeId n, Member& o) { m.roster.push_back({n, o.endpoint}); });
    Send(node, m);
  }

  void MaybeReleaseBarrier() {
    uint64_t lowest = ~uint64_t{0};
    bool any = false;
    ForEachMember([&](NodeId, Member& o) {
      if (!o.live()) return;
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
      case ControlType::kLeave:
        member.left = true;
        member.fd.Reset();
        MaybeReleaseBarrier();
        break;
      case ControlType::kPong:
        break;
      default:
        MarkLost(node, absl::StrCat("sent unexpected control message ", static_cast<int>(m.type)));
    }
  }

  void Heartbeat() {
    const absl::Time now = absl::Now();
    if (now - last_ping_ < options_.heartbeat_interval) return;
    last_ping_ = now;
    ControlMessage ping;
    ping.type = ControlType::kPing;
    ping.sequence = ++ping_sequence_;
    ForEachMember([&](NodeId n, Member& o) {
      if (!o.live()) return;
      if (now - o.last_heard > options_.timeout) {
        MarkLost(n, absl::StrCat("silent for ", absl::FormatDuration(now - o.last_heard)));
        return;
      }
      Send(n, ping);
    });
  }

  // Refuses a connection before it joined: tells it why, logs, closes.
  void Refuse(base::UniqueFd fd, const std::string& reason) {
    ControlMessage m;
    m.type = ControlType::kReject;
    m.text = reason;
    (void)SendControl(fd.get(), m, absl::Now() + absl::Seconds(1));
    STEPMESH_LOG(kWarning, "scheduler: refused a connection: ", reason);
  }

  // One step of a not-yet-joined connection; false when it is finished (joined,
  // refused or dropped), true when it stays pending.
  bool Advance(Pending& p, absl::Time deadline) {
    absl::StatusOr<ControlMessage> m = ReceiveControl(p.fd.get(), deadline);
    if (!m.ok()) {
      STEPMESH_LOG(kInfo, "scheduler: dropped a connection before join: ", m.status().ToString());
      return false;
    }
    const bool need_auth = !options_.auth_token.empty();
    switch (p.stage) {
      case Pending::Stage::kHello:
        if (m->type == ControlType::kChallenge) {
          if (!need_auth) {
            Refuse(std::move(p.fd), "this scheduler has no auth token; the participant has one");
            return false;
          }
          absl::StatusOr<AuthNonce> nonce = RandomNonce();
          if (!NonceFromText(m->text, &p.dialer_nonce) || !nonce.ok()) {
            Refuse(std::move(p.fd), "malformed authentication challenge");
            return false;
          }
          p.acceptor_nonce = *nonce;
          ControlMessage challenge;
          challenge.type = ControlType::kChallenge;
          challenge.text = std::string(AsText(p.acceptor_nonce));
          ControlMessage proof;
          proof.type = ControlType::kProof;
          proof.text =
              std::string(AsText(AuthProof(options_.auth_token, AuthSide::kAcceptor,
                                           kControlAuthContext, p.dialer_nonce, p.acceptor_nonce)));
          if (!SendControl(p.fd.get(), challenge, deadline).ok() ||
              !SendControl(p.fd.get(), proof, deadline).ok()) {
            return false;
          }
          p.stage = Pending::Stage::kProof;
          return true;
        }
        if (m->type == ControlType::kJoin && !need_auth) {
          HandleJoin(std::move(p.fd), *m);
          return false;
        }
        Refuse(std::move(p.fd), m->type == ControlType::kJoin
                                    ? "authentication required (set STEPMESH_AUTH_TOKEN)"
                                    : "expected a join");
        return false;
      case Pending::Stage::kProof:
        if (m->type != ControlType::kProof ||
            !CheckAuthProof(options_.auth_token, AuthSide::kDialer, kControlAuthContext,
                            p.dialer_nonce, p.acceptor_nonce, m->text)) {
          Refuse(std::move(p.fd), "authentication failed (wrong auth token?)");
          return false;
        }
        p.stage = Pending::Stage::kJoin;
        return true;
      case Pending::Stage::kJoin:
        if (m->type != ControlType::kJoin) {
          Refuse(std::move(p.fd), "expected a join after authenticating");
          return false;
        }
        HandleJoin(std::move(p.fd), *m);
        return false;
    }
    return false;
  }

  void Run() {
    std::vector<Pending> pending;  // accepted, not yet joined
    std::vector<pollfd> fds;
    std::vector<NodeId> owners;  // parallel to fds: kNoNode for listener/pending
    while (!stop_.load()) {
      fds.clear();
      owners.clear();
      fds.push_back({listener_.get(), POLLIN, 0});
      owners.push_back(kNoNode);
      for (const Pending& p : pending) {
        fds.push_back({p.fd.get(), POLLIN, 0});
        owners.push_back(kNoNode);
      }
      ForEachMember([&](NodeId n, Member& o) {
        if (o.live()) {
          fds.push_back({o.fd.get(), POLLIN, 0});
          owners.push_back(n);
        }
      });
      const int ready = ::poll(fds.data(), fds.size(), 50);
      if (ready > 0) {
        const size_t num_pending = pending.size();
        std::vector<Pending> still_pending;
        if (fds[0].revents & POLLIN) {
          absl::StatusOr<base::UniqueFd> fd = base::AcceptTcp(listener_.get(), absl::Now());
          if (fd.ok()) {
            Pending p;
            p.fd = *std::move(fd);
            p.deadline = absl::Now() + options_.timeout;
            still_pending.push_back(std::move(p));
          }
        }
        for (size_t i = 1; i < fds.size(); ++i) {
          if (fds[i].revents == 0) {
            if (i <= num_pending && absl::Now() < pending[i - 1].deadline) {
              still_pending.push_back(std::move(pending[i - 1]));
            } else if (i <= num_pending) {
              STEPMESH_LOG(kWarning, "scheduler: dropped a connection that did not join in ",
                           absl::FormatDuration(options_.timeout));
            }
            continue;
          }
          const absl::Time deadline = absl::Now() + absl::Seconds(1);
          if (i <= num_pending) {
            Pending p = std::move(pending[i - 1]);
            if (Advance(p, deadline)) still_pending.push_back(std::move(p));
            continue;
          }
          const NodeId node = owners[i];
          if (!At(node).live()) continue;
          absl::StatusOr<ControlMessage> m = ReceiveControl(At(node).fd.get(), deadline);
          if (!m.ok()) {
            MarkLost(node, std::string(m.status().message()));
          } else {
            HandleMessage(node, *m);
          }
        }
        pending = std::move(still_pending);
      }
      if (roster_sent_) {
        Heartbeat();
        bool anyone = false;
        ForEachMember([&](NodeId, Member& o) { anyone = anyone || o.live(); });
        if (!anyone && !done_.HasBeenNotified()) done_.Notify();
      }
    }
  }

  const MeshOptions options_;
  base::UniqueFd listener_;
  const std::string address_;
  std::vector<Member> workers_;
  std::vector<Member> servers_;
  bool roster_sent_ = false;
  uint64_t released_ = 0;
  uint64_t ping_sequence_ = 0;
  absl::Time last_ping_ = absl::InfinitePast();
  std::atomic<bool> stop_{false};
  base::Notification done_;
  std::thread thread_;
};

}  // namespace
}  // namespace stepmesh::core

namespace stepmesh {

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Start(const MeshOptions& options) {
  STEPMESH_RETURN_IF_ERROR(options.Validate());
  STEPMESH_ASSIGN_OR_RETURN(base::HostPort where, base::ParseHostPort(options.scheduler));
  STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd listener, base::ListenTcp(where.host, where.port));
  STEPMESH_ASSIGN_OR_RETURN(uint16_t port, base::LocalPort(listener.get()));
  return std::unique_ptr<Scheduler>(
      new core::SchedulerImpl(options, std::move(listener), absl::StrCat(where.host, ":", port)));
}

}  // namespace stepmesh
