#include "src/core/rendezvous.h"

#include <time.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace stepmesh::core {

void Dispatch(const RendezvousEvents& events, const MembershipEvent& event) {
  switch (event.kind) {
    case MembershipEvent::Kind::kJoined:
      if (events.on_peer_joined) events.on_peer_joined(event.node, event.endpoint);
      break;
    case MembershipEvent::Kind::kLeft:
      if (events.on_peer_left) events.on_peer_left(event.node);
      break;
    case MembershipEvent::Kind::kLost:
      if (events.on_peer_lost) events.on_peer_lost(event.node, event.why);
      break;
  }
  if (events.on_membership) events.on_membership(event);
}

std::string RedactedRendezvous(const std::string& url) {
  const size_t at = url.find('@');
  const size_t sep = url.find("://");
  if (at == std::string::npos || sep == std::string::npos || at < sep) return url;
  const size_t colon = url.find(':', sep + 3);
  if (colon == std::string::npos || colon > at) return url;
  return absl::StrCat(url.substr(0, colon + 1), "***", url.substr(at));
}

absl::StatusOr<RendezvousUrl> ParseRendezvousUrl(const MeshOptions& options) {
  if (options.rendezvous.empty()) return RendezvousUrl{"scheduler", options.scheduler};
  const size_t sep = options.rendezvous.find("://");
  const std::string scheme =
      sep == std::string::npos ? std::string() : options.rendezvous.substr(0, sep);
  if (scheme != "scheduler" && scheme != "etcd") {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous '", RedactedRendezvous(options.rendezvous),
                     "' (STEPMESH_RENDEZVOUS): want scheduler://HOST:PORT or "
                     "etcd://HOST:PORT[,HOST:PORT...][/PREFIX]"));
  }
  RendezvousUrl url{scheme, options.rendezvous.substr(sep + 3)};
  if (url.rest.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous '",
                                                   RedactedRendezvous(options.rendezvous),
                                                   "' (STEPMESH_RENDEZVOUS) names no address"));
  }
  return url;
}

absl::Status RequireFixedShape(const MeshOptions& options, absl::string_view rendezvous) {
  if (options.WorkerCapacity() == options.num_workers &&
      options.ServerCapacity() == options.num_servers) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "a capacity above the start shape (max_workers=", options.WorkerCapacity(),
      " for num_workers=", options.num_workers, ", max_servers=", options.ServerCapacity(),
      " for num_servers=", options.num_servers,
      ": STEPMESH_MAX_WORKERS/STEPMESH_MAX_SERVERS) "
      "needs the scheduler or etcd rendezvous; ",
      rendezvous, " runs fixed shapes only (docs/elastic.md)"));
}

ClockSync WallClockAgainstMonotonic() {
  timespec wall{};
  const uint64_t before = MonotonicNowNs();
  clock_gettime(CLOCK_REALTIME, &wall);
  const uint64_t after = MonotonicNowNs();
  const uint64_t wall_ns =
      static_cast<uint64_t>(wall.tv_sec) * 1000000000ull + static_cast<uint64_t>(wall.tv_nsec);
  return ClockSync{static_cast<int64_t>(wall_ns - (before + (after - before) / 2)), after - before};
}

}  // namespace stepmesh::core
