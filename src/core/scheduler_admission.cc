// The scheduler's admission (src/core/scheduler_impl.h): a connection that
// has not joined authenticates (challenge-response, when the mesh has a
// secret), then joins with its role, rank, endpoint and the mesh's shape, or
// resumes a formed mesh at a restarted scheduler. A join either takes a rank
// or is refused with why; the one that completes the start shape forms the
// mesh and sends everyone the roster.

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/core/scheduler_impl.h"

namespace stepmesh::core {
namespace {

// The context string both ends put into control-connection proofs.
constexpr char kControlAuthContext[] = "control";

}  // namespace

void SchedulerImpl::Advance(Conn& c, const ControlMessage& m) {
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
std::string SchedulerImpl::ShapeMismatch(const ControlMessage& join) const {
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

void SchedulerImpl::HandleJoin(Conn& c, const ControlMessage& join) {
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
void SchedulerImpl::HandleResume(Conn& c, const ControlMessage& join) {
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

void SchedulerImpl::Admit(Conn& c, NodeId node, const std::string& endpoint) {
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

}  // namespace stepmesh::core
