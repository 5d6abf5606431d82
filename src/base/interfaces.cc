#include "src/base/interfaces.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <cerrno>
#include <memory>

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

}  // namespace stepmesh::base
