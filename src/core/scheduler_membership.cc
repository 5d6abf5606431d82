// The scheduler's members (src/core/scheduler_impl.h): what it sends them,
// the roster, and the membership epochs (a member lost, leaving, draining).
// Every change after the mesh formed is a new epoch, announced to the live
// members with its number.

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/core/scheduler_impl.h"
#include "stepmesh/trace.h"

namespace stepmesh::core {
namespace {

// What a member may leave unread on its connection before it counts as lost.
constexpr size_t kMaxUnsentBytes = 8 << 20;

}  // namespace

void SchedulerImpl::Send(NodeId node, const ControlMessage& m) {
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

void SchedulerImpl::MarkLost(NodeId node, const std::string& reason) {
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
void SchedulerImpl::Unjoin(NodeId node, absl::string_view reason, bool orderly) {
  Member& member = At(node);
  if (member.conn != nullptr) Close(*member.conn);
  if (orderly) {
    STEPMESH_LOG(kInfo, "scheduler: ", PeerName(node),
                 " left before the mesh formed; its rank is open again");
  } else {
    STEPMESH_LOG(kWarning, "scheduler: ", PeerName(node), " lost before the mesh formed (", reason,
                 "); its rank is open again");
  }
  member = Member{};
}

// The members of the current epoch (live, not draining), with their
// endpoints, the epoch, and the barrier count `node` starts from.
void SchedulerImpl::SendRoster(NodeId node) {
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

// A new epoch in which `node` is no longer a member, told to the live
// others; a barrier waiting only for it may now pass.
void SchedulerImpl::AnnounceLeft(NodeId node) {
  ControlMessage left;
  left.type = ControlType::kPeerLeft;
  left.node = node;
  left.epoch = ++epoch_;
  ForEachMember([&](NodeId other, Member& o) {
    if (other != node && o.live()) Send(other, left);
  });
  MaybeReleaseBarrier();
}

void SchedulerImpl::HandleMessage(NodeId node, const ControlMessage& m) {
  Member& member = At(node);
  member.last_heard = absl::Now();
  switch (m.type) {
    case ControlType::kBarrier:
      HandleBarrier(node, m);
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
      // (a server still connecting a rejoined worker, see server_peers.cc).
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

}  // namespace stepmesh::core
