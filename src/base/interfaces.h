#pragma once
// The host's network interfaces and their addresses (getifaddrs), for
// choosing the address a listener binds and advertises by interface name.

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace stepmesh::base {

struct InterfaceAddress {
  std::string interface;  // "eth0", "lo"
  std::string address;    // numeric: "10.0.0.2", "2001:db8::5"
  bool ipv6 = false;
  bool link_local = false;  // fe80::/10: unusable without a scope, never chosen
};

// Every IPv4 and IPv6 address of every interface that is up, in getifaddrs order.
absl::StatusOr<std::vector<InterfaceAddress>> ListInterfaceAddresses();

// The address `interface` is reached at: its first IPv4 address, else its
// first IPv6 address that is not link-local. NOT_FOUND when there is none,
// listing the interfaces and addresses found.
absl::StatusOr<std::string> InterfaceAddressOf(const std::string& interface);

// The netdevs of this host's RDMA devices (/sys/class/infiniband/*/device/net/*),
// sorted; empty when there are none.
std::vector<std::string> RdmaNetdevs();

// The interface DMLC_INTERFACE=auto names, chosen among `all` as StepMesh
// does: the interface that holds `node_host` when that is one of its
// addresses (StepMesh's launch scripts set both); else the first RDMA netdev
// (in `rdma_netdevs` order) with an IPv4 address; else the first interface
// other than loopback with an IPv4 address; else a loopback one. NOT_FOUND,
// listing what was found, when nothing has an IPv4 address.
absl::StatusOr<std::string> PickAutoInterface(const std::vector<InterfaceAddress>& all,
                                              const std::string& node_host,
                                              const std::vector<std::string>& rdma_netdevs);

}  // namespace stepmesh::base
