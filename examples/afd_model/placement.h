// Where afd_launch puts its processes: by default all on this host
// (127.0.0.1); with --hosts, each attention and FFN instance in its own
// network namespace (an emulated host, scripts/cluster.sh), the scheduler
// on the first one.
//
//   --hosts NS0,NS1,...        network namespaces (/run/netns/NAME), at
//                              least X + Y: attention a on host a, FFN p on
//                              host X + p, the scheduler on host 0
//   --host-addrs A0,A1,...     each host's address (bound and advertised)

#ifndef STEPMESH_EXAMPLES_AFD_MODEL_PLACEMENT_H_
#define STEPMESH_EXAMPLES_AFD_MODEL_PLACEMENT_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace afd::example {

class Placement {
 public:
  Placement() = default;  // everything on this host
  Placement(Placement&& other) noexcept;
  Placement& operator=(Placement&& other) noexcept;
  Placement(const Placement&) = delete;
  Placement& operator=(const Placement&) = delete;
  ~Placement();

  // Empty `hosts`: the default placement. Opens every namespace now (an
  // unknown name is an error naming it), so a bad flag fails before any
  // process starts.
  static absl::StatusOr<Placement> Open(const std::string& hosts, const std::string& addrs,
                                        int attention, int ffn);

  bool enabled() const { return !fds_.empty(); }
  int AttentionHost(int a) const { return a; }
  int FfnHost(int p) const { return attention_ + p; }
  const std::string& name(int host) const { return names_[host]; }
  // The address processes on `host` bind and advertise ("127.0.0.1" when
  // not enabled).
  std::string address(int host) const;
  // An open /run/netns/NAME descriptor for a child to setns(2) into between
  // fork and exec, or -1 when not enabled.
  int netns_fd(int host) const { return enabled() ? fds_[host] : -1; }
  // Moves the calling thread (and every thread it creates later) into host
  // 0's namespace: the launcher's own scheduler then listens there.
  absl::Status EnterSchedulerHost() const;
  // The environment entries a process on `host` needs.
  std::vector<std::string> Environment(int host) const;

 private:
  int attention_ = 0;
  std::vector<std::string> names_, addrs_;
  std::vector<int> fds_;
};

}  // namespace afd::example

#endif  // STEPMESH_EXAMPLES_AFD_MODEL_PLACEMENT_H_
