#include "src/transport/rdma/verbs_resources.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "src/base/enum_names.h"
#include "src/base/net.h"
#include "src/transport/rdma/pci_topology.h"
#include "stepmesh/status.h"

namespace stepmesh::rdma {
namespace {

bool IsZeroGid(const ibv_gid& gid) {
  static constexpr ibv_gid kZero{};
  return std::memcmp(&gid, &kZero, sizeof(gid)) == 0;
}
bool IsIpv4Mapped(const ibv_gid& gid) {
  for (int i = 0; i < 10; ++i) {
    if (gid.raw[i] != 0) return false;
  }
  return gid.raw[10] == 0xFF && gid.raw[11] == 0xFF;
}
// fe80::/10: an IPv6 link-local address, which RoCE v2 (routed UDP/IP)
// cannot reach beyond the local link and NICs may not even answer on.
bool IsLinkLocal(const ibv_gid& gid) { return gid.raw[0] == 0xFE && (gid.raw[1] & 0xC0) == 0x80; }

// Higher is better: RoCE v2 IPv4-mapped 3, RoCE v2 2, IB 1, RoCE v1 0.
int GidScore(const ibv_gid_entry& entry) {
  switch (entry.gid_type) {
    case IBV_GID_TYPE_ROCE_V2:
      return IsIpv4Mapped(entry.gid) ? 3 : 2;
    case IBV_GID_TYPE_IB:
      return 1;
    default:
      return 0;
  }
}

// A usable port of a device; `choice` has no context until it is chosen.
struct Candidate {
  ibv_device* device = nullptr;
  PortChoice choice;
  int score = -1;
  PciPlacement placement;  // relative to the GPU; kUnknown without one
};

// Fills the best GID of `port` into `out`; false when the port is unusable.
bool ChoosePortGid(VerbsApi& verbs, ibv_context* ctx, uint8_t port, const RdmaOptions& options,
                   const std::vector<GidSubnet>& subnets, Candidate& out) {
  ibv_port_attr attr{};
  if (verbs.QueryPort(ctx, port, &attr) != 0 || attr.state != IBV_PORT_ACTIVE) return false;
  PortChoice& c = out.choice;
  c.port = port;
  c.active_mtu = attr.active_mtu;
  c.link_layer = attr.link_layer == IBV_LINK_LAYER_INFINIBAND ? IBV_LINK_LAYER_INFINIBAND
                                                              : IBV_LINK_LAYER_ETHERNET;
  c.lid = attr.lid;
  c.max_msg_sz = attr.max_msg_sz;
  const bool roce = c.link_layer == IBV_LINK_LAYER_ETHERNET;
  for (int index = 0; index < attr.gid_tbl_len; ++index) {
    const bool forced = options.gid_index >= 0;
    if (forced && index != options.gid_index) continue;
    ibv_gid_entry entry{};
    if (verbs.QueryGidEx(ctx, port, static_cast<uint32_t>(index), &entry) != 0) continue;
    if (IsZeroGid(entry.gid)) continue;
    if (!forced && entry.gid_type == IBV_GID_TYPE_ROCE_V2 && IsLinkLocal(entry.gid)) continue;
    if (roce && !subnets.empty() &&
        std::none_of(subnets.begin(), subnets.end(),
                     [&](const GidSubnet& net) { return net.Contains(entry.gid); })) {
      continue;
    }
    const int score = GidScore(entry);
    if (score > out.score) {  // the first of equals: lowest index
      out.score = score;
      c.gid_index = index;
      c.gid = entry.gid;
      c.gid_type = static_cast<ibv_gid_type>(entry.gid_type);
    }
  }
  return out.score >= 0;
}

// Parses an IPv4 or IPv6 address into GID form.
bool ParseAddress(const std::string& text, ibv_gid& gid) {
  gid = {};
  in_addr v4;
  if (::inet_pton(AF_INET, text.c_str(), &v4) == 1) {
    gid.raw[10] = 0xFF;
    gid.raw[11] = 0xFF;
    std::memcpy(&gid.raw[12], &v4, 4);
    return true;
  }
  return ::inet_pton(AF_INET6, text.c_str(), gid.raw) == 1;
}

int PrefixBits(const uint8_t* mask, size_t bytes) {
  int bits = 0;
  for (size_t i = 0; i < bytes; ++i) bits += __builtin_popcount(mask[i]);
  return bits;
}

}  // namespace

bool GidSubnet::Contains(const ibv_gid& gid) const {
  for (int bit = 0; bit < bits; ++bit) {
    const uint8_t m = static_cast<uint8_t>(0x80 >> (bit % 8));
    if ((gid.raw[bit / 8] & m) != (prefix.raw[bit / 8] & m)) return false;
  }
  return true;
}

absl::StatusOr<std::vector<GidSubnet>> ResolveInterface(const std::string& interface) {
  std::vector<GidSubnet> out;
  if (const size_t slash = interface.find('/'); slash != std::string::npos) {
    GidSubnet net;
    int bits = 0;
    if (!ParseAddress(interface.substr(0, slash), net.prefix) ||
        !absl::SimpleAtoi(interface.substr(slash + 1), &bits)) {
      return absl::InvalidArgumentError(
          absl::StrCat("rdma.interface (STEPMESH_RDMA_INTERFACE) '", interface,
                       "' is neither an interface name nor an address/prefix-length subnet"));
    }
    const int family_bits = IsIpv4Mapped(net.prefix) ? 32 : 128;
    if (bits < 0 || bits > family_bits) {
      return absl::InvalidArgumentError(absl::StrCat("rdma.interface (STEPMESH_RDMA_INTERFACE) '",
                                                     interface, "': prefix length out of range"));
    }
    net.bits = bits + (128 - family_bits);
    out.push_back(net);
    return out;
  }
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return absl::InternalError(base::ErrnoMessage("getifaddrs", errno));
  std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> guard(list, ::freeifaddrs);
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_netmask == nullptr || interface != a->ifa_name) continue;
    GidSubnet net;
    if (a->ifa_addr->sa_family == AF_INET) {
      const auto* addr = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
      const auto* mask = reinterpret_cast<const sockaddr_in*>(a->ifa_netmask);
      net.prefix.raw[10] = 0xFF;
      net.prefix.raw[11] = 0xFF;
      std::memcpy(&net.prefix.raw[12], &addr->sin_addr, 4);
      net.bits = 96 + PrefixBits(reinterpret_cast<const uint8_t*>(&mask->sin_addr), 4);
    } else if (a->ifa_addr->sa_family == AF_INET6) {
      const auto* addr = reinterpret_cast<const sockaddr_in6*>(a->ifa_addr);
      const auto* mask = reinterpret_cast<const sockaddr_in6*>(a->ifa_netmask);
      std::memcpy(net.prefix.raw, &addr->sin6_addr, 16);
      net.bits = PrefixBits(reinterpret_cast<const uint8_t*>(&mask->sin6_addr), 16);
    } else {
      continue;
    }
    out.push_back(net);
  }
  if (out.empty()) {
    return absl::NotFoundError(absl::StrCat("rdma.interface (STEPMESH_RDMA_INTERFACE) '", interface,
                                            "': no such interface with an IP address"));
  }
  return out;
}

absl::StatusOr<PortChoice> OpenPort(VerbsApi& verbs, const MeshOptions& mesh) {
  const RdmaOptions& options = mesh.rdma;
  std::vector<GidSubnet> subnets;
  if (!options.interface.empty()) {
    STEPMESH_ASSIGN_OR_RETURN(subnets, ResolveInterface(options.interface));
  }
  int count = 0;
  std::unique_ptr<ibv_device*, std::function<void(ibv_device**)>> list(verbs.GetDeviceList(&count),
                                                                       [&verbs](ibv_device** l) {
                                                                         if (l != nullptr)
                                                                           verbs.FreeDeviceList(l);
                                                                       });
  if (list == nullptr || count == 0) return absl::UnavailableError("rdma: no RDMA device found");
  const std::string& gpu = options.gpu_pci_bus_id;
  const std::vector<std::string> allowed = absl::StrSplit(options.device, ',', absl::SkipEmpty());
  std::vector<Candidate> candidates;
  std::vector<std::string> refused;  // devices this transport cannot use, and why
  for (int i = 0; i < count; ++i) {
    ibv_device* device = list.get()[i];
    const std::string name = verbs.GetDeviceName(device);
    if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), name) == allowed.end()) {
      continue;
    }
    // Frames travel as RDMA_WRITE_WITH_IMM: iWARP (siw, cxgb, ...) has no
    // immediate data, so only InfiniBand-transport devices (IB, RoCE) qualify.
    if (device->transport_type != IBV_TRANSPORT_IB) {
      refused.push_back(absl::StrCat(name,
                                     " is an iWARP or other non-InfiniBand device "
                                     "(no immediate data)"));
      continue;
    }
    ContextHandle ctx(&verbs, verbs.OpenDevice(device));
    if (!ctx) continue;
    ibv_device_attr attr{};
    if (verbs.QueryDevice(ctx.get(), &attr) != 0) continue;
    for (uint8_t port = 1; port <= attr.phys_port_cnt; ++port) {
      if (options.port > 0 && port != options.port) continue;
      Candidate c;
      c.device = device;
      c.choice.device_name = name;
      if (!ChoosePortGid(verbs, ctx.get(), port, options, subnets, c)) continue;
      if (!gpu.empty()) c.placement = PlaceNic(options.sysfs_root, name, gpu);
      candidates.push_back(std::move(c));
    }
  }
  if (candidates.empty()) {
    std::string why = absl::StrCat(
        "rdma: no active port", options.device.empty() ? "" : " on ", options.device,
        options.port > 0 ? absl::StrCat(" port ", options.port) : "",
        options.gid_index >= 0 ? absl::StrCat(" with GID index ", options.gid_index) : "",
        options.interface.empty()
            ? ""
            : absl::StrCat(" with a GID in ", options.interface, "'s subnet"));
    for (const std::string& r : refused) absl::StrAppend(&why, "; ", r);
    return absl::UnavailableError(why);
  }
  // The best GID kind first, then the nearest to the GPU on the PCI tree;
  // among equals the first listed.
  Candidate* best = &candidates.front();
  for (Candidate& c : candidates) {
    const bool nearer = c.placement.Rank() < best->placement.Rank();
    if (c.score > best->score || (c.score == best->score && nearer)) best = &c;
  }
  PortChoice choice = std::move(best->choice);
  choice.context = ContextHandle(&verbs, verbs.OpenDevice(best->device));
  if (!choice.context) {
    return absl::UnavailableError(absl::StrCat("rdma: cannot open ", choice.device_name));
  }
  if (options.pkey != 0) {
    // As NCCL_IB_PKEY: the entry of the same partition, a full member first.
    std::vector<std::string> table;
    int found = -1;
    for (int index = 0; index < 128; ++index) {
      uint16_t key = 0;
      if (verbs.QueryPkey(choice.context.get(), choice.port, index, &key) != 0) break;
      table.push_back(absl::StrCat(index, ":0x", absl::Hex(key, absl::kZeroPad4)));
      if ((key & 0x7FFF) != (options.pkey & 0x7FFF)) continue;
      if (found < 0 || (key & 0x8000) != 0) found = index;
      if ((key & 0x8000) != 0) break;
    }
    if (found < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rdma.pkey=0x", absl::Hex(options.pkey, absl::kZeroPad4), " (STEPMESH_RDMA_PKEY): ",
          choice.device_name, " port ", int{choice.port}, " is not in that partition (P_Key table ",
          table.empty() ? "unreadable" : absl::StrJoin(table, " "), ")"));
    }
    choice.pkey_index = static_cast<uint16_t>(found);
    uint16_t key = 0;
    (void)verbs.QueryPkey(choice.context.get(), choice.port, found, &key);
    choice.pkey = key;
  }
  choice.nic_pci = best->placement.nic_pci;
  if (gpu.empty()) {
    choice.why = allowed.empty() ? "no GPU to be near (host memory): the best port found"
                 : allowed.size() == 1
                     ? "named by rdma.device (STEPMESH_RDMA_DEVICE)"
                     : absl::StrCat("the best port of those STEPMESH_RDMA_DEVICE=", options.device,
                                    " allows");
  } else {
    choice.why = absl::StrCat(
        "nearest to GPU ", gpu, ": ", PciAffinityName(best->placement.affinity),
        best->placement.hops >= 0 ? absl::StrCat(", ", best->placement.hops, " PCI hops") : "",
        candidates.size() > 1 ? absl::StrCat(" (of ", candidates.size(), " ports)") : "",
        allowed.empty() ? "" : absl::StrCat("; allowed by STEPMESH_RDMA_DEVICE=", options.device));
  }
  return choice;
}

std::string FormatBytes(uint64_t bytes) {
  if (bytes == UINT64_MAX) return "unlimited";
  if (bytes >= (uint64_t{1} << 30) && bytes % (uint64_t{1} << 30) == 0) {
    return absl::StrCat(bytes >> 30, " GiB");
  }
  if (bytes >= (uint64_t{1} << 20)) return absl::StrCat(bytes >> 20, " MiB");
  if (bytes >= 1024) return absl::StrCat(bytes >> 10, " KiB");
  return absl::StrCat(bytes, " bytes");
}

std::string MemlockAdvice(VerbsApi& verbs) {
  uint64_t limit = 0;
  if (verbs.GetMemlockLimit(&limit) != 0) return "";
  return absl::StrCat("; RLIMIT_MEMLOCK (ulimit -l) is ", FormatBytes(limit),
                      limit == UINT64_MAX ? " (so the NIC itself ran out)"
                                          : ", and every registration pins its pages against it: "
                                            "raise it (docker run --ulimit memlock=-1, systemd "
                                            "LimitMEMLOCK=infinity, limits.conf memlock)");
}

absl::Status CheckMemlock(VerbsApi& verbs, uint64_t needed, const std::string& what) {
  uint64_t limit = 0;
  if (verbs.GetMemlockLimit(&limit) != 0 || limit == UINT64_MAX || limit >= needed) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "rdma: RLIMIT_MEMLOCK (ulimit -l) is ", FormatBytes(limit), " but ", what, " pins at least ",
      FormatBytes(needed),
      " before any tensor is registered; raise it (docker run --ulimit memlock=-1, systemd "
      "LimitMEMLOCK=infinity, limits.conf memlock) or use STEPMESH_TRANSPORT=tcp"));
}

namespace {

constexpr const char* kGidTypeNames[] = {"IB", "RoCE v1", "RoCE v2"};  // from IBV_GID_TYPE_IB
static_assert(std::size(kGidTypeNames) == size_t{IBV_GID_TYPE_ROCE_V2} + 1);

// From IBV_WC_SUCCESS (ibv_poll_cq(3)); statuses past the table are
// "completion error".
constexpr const char* kWcStatusNames[] = {"success",
                                          "local length error",
                                          "local QP operation error",
                                          "local EE context operation error",
                                          "local protection error",
                                          "work request flushed",
                                          "memory window bind error",
                                          "bad response",
                                          "local access error",
                                          "remote invalid request",
                                          "remote access error",
                                          "remote operation error",
                                          "transport retry counter exceeded",
                                          "RNR retry counter exceeded",
                                          "local RDD violation",
                                          "remote invalid RD request",
                                          "remote aborted",
                                          "invalid EE context number",
                                          "invalid EE context state",
                                          "fatal error",
                                          "response timeout",
                                          "general error"};
static_assert(std::size(kWcStatusNames) == size_t{IBV_WC_GENERAL_ERR} + 1);

}  // namespace

const char* GidTypeName(ibv_gid_type type) { return base::NameOf(kGidTypeNames, type, "IB"); }

std::string GidToString(const ibv_gid& gid) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string text;
  text.reserve(32);
  for (uint8_t byte : gid.raw) {
    text.push_back(kHex[byte >> 4]);
    text.push_back(kHex[byte & 15]);
  }
  return text;
}

absl::StatusOr<ibv_gid> GidFromString(std::string_view text) {
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  ibv_gid gid{};
  if (text.size() != 2 * sizeof(gid.raw)) return absl::InvalidArgumentError("rdma: bad GID text");
  for (size_t i = 0; i < sizeof(gid.raw); ++i) {
    const int hi = nibble(text[2 * i]);
    const int lo = nibble(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return absl::InvalidArgumentError("rdma: bad GID text");
    gid.raw[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return gid;
}

const char* WcStatusName(ibv_wc_status status) {
  return base::NameOf(kWcStatusNames, status, "completion error");
}

}  // namespace stepmesh::rdma
