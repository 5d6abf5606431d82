// The scheduler's barriers (src/core/scheduler_impl.h): each member counts
// the barriers it entered; the scheduler releases a barrier once every live
// member that is not draining has entered it, and tells all of them.

#include <algorithm>

#include "src/core/scheduler_impl.h"

namespace stepmesh::core {

void SchedulerImpl::HandleBarrier(NodeId node, const ControlMessage& m) {
  if (m.sequence <= released_) {
    // A rejoined process counts its barriers from 1 again: ones the mesh
    // already passed are released at once instead of never.
    ControlMessage release;
    release.type = ControlType::kRelease;
    release.sequence = m.sequence;
    Send(node, release);
    return;
  }
  At(node).barrier = m.sequence;
  MaybeReleaseBarrier();
}

// The barrier the members have entered and not yet passed (the highest
// entered), else the last released: a member joining now counts as
// having entered it.
uint64_t SchedulerImpl::BarrierInProgress() {
  uint64_t entered = released_;
  ForEachMember([&](NodeId, Member& o) {
    if (o.live() && !o.draining) entered = std::max(entered, o.barrier);
  });
  return entered;
}

void SchedulerImpl::MaybeReleaseBarrier() {
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

}  // namespace stepmesh::core
