// The scheduler's liveness checks (src/core/scheduler_impl.h): a ping to
// every live member each heartbeat interval; a member silent for the mesh's
// timeout (or, at a restarted scheduler, not back within it) is lost.

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/core/scheduler_impl.h"

namespace stepmesh::core {

void SchedulerImpl::Heartbeat(absl::Time now) {
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

}  // namespace stepmesh::core
