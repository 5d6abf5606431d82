#include "src/base/interfaces.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <memory>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/base/net.h"
#include "stepmesh/status.h"

namespace stepmesh::base {

absl::StatusOr<std::vector<InterfaceAddress>> ListInterfaceAddresses() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return absl::InternalError(ErrnoMessage("getifaddrs", errno));
  std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> guard(list, ::freeifaddrs);
  std::vector<InterfaceAddress> out;
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || (a->ifa_flags & IFF_UP) == 0) continue;
    InterfaceAddress entry;
    entry.interface = a->ifa_name;
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ifa_addr->sa_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
      if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) == nullptr) continue;
    } else if (a->ifa_addr->sa_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a->ifa_addr);
      if (::inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text)) == nullptr) continue;
      entry.ipv6 = true;
      entry.link_local = IN6_IS_ADDR_LINKLOCAL(&in6->sin6_addr);
    } else {
      continue;  // AF_PACKET and friends: no IP address
    }
    entry.address = text;
    out.push_back(std::move(entry));
  }
  return out;
}

absl::StatusOr<std::string> InterfaceAddressOf(const std::string& interface) {
  STEPMESH_ASSIGN_OR_RETURN(std::vector<InterfaceAddress> all, ListInterfaceAddresses());
  const InterfaceAddress* v6 = nullptr;
  for (const InterfaceAddress& a : all) {
    if (a.interface != interface) continue;
    if (!a.ipv6) return a.address;
    if (v6 == nullptr && !a.link_local) v6 = &a;
  }
  if (v6 != nullptr) return v6->address;
  std::vector<std::string> found;
  for (const InterfaceAddress& a : all) found.push_back(absl::StrCat(a.interface, " ", a.address));
  return absl::NotFoundError(absl::StrCat("no interface '", interface,
                                          "' that is up with a usable IP address; found: ",
                                          found.empty() ? "none" : absl::StrJoin(found, ", ")));
}

std::vector<std::string> RdmaNetdevs() {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  std::error_code ec;
  for (const fs::directory_entry& dev : fs::directory_iterator("/sys/class/infiniband", ec)) {
    std::error_code ec2;
    for (const fs::directory_entry& net : fs::directory_iterator(dev.path() / "device/net", ec2)) {
      out.push_back(net.path().filename().string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

absl::StatusOr<std::string> PickAutoInterface(const std::vector<InterfaceAddress>& all,
                                              const std::string& node_host,
                                              const std::vector<std::string>& rdma_netdevs) {
  auto has_ipv4 = [&all](const std::string& name) {
    return std::any_of(all.begin(), all.end(), [&name](const InterfaceAddress& a) {
      return a.interface == name && !a.ipv6;
    });
  };
  if (!node_host.empty()) {
    for (const InterfaceAddress& a : all) {
      if (a.address == node_host) return a.interface;
    }
  }
  for (const std::string& name : rdma_netdevs) {
    if (has_ipv4(name)) return name;
  }
  const InterfaceAddress* loopback = nullptr;
  for (const InterfaceAddress& a : all) {
    if (a.ipv6) continue;
    if (absl::StartsWith(a.address, "127.")) {
      if (loopback == nullptr) loopback = &a;
      continue;
    }
    return a.interface;
  }
  if (loopback != nullptr) return loopback->interface;
  std::vector<std::string> found;
  for (const InterfaceAddress& a : all) found.push_back(absl::StrCat(a.interface, " ", a.address));
  return absl::NotFoundError(
      absl::StrCat("interface 'auto': no interface that is up has an IPv4 address; found: ",
                   found.empty() ? "none" : absl::StrJoin(found, ", ")));
}

}  // namespace stepmesh::base
