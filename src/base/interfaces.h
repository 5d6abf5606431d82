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

}  // namespace stepmesh::base
