#include "src/transport/rdma/verbs_resources.h"

#include <hwloc.h>

#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
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

struct Candidate {
  ibv_device* device = nullptr;
  std::string name;
  uint8_t port = 1;
  int gid_index = 0;
  ibv_gid gid{};
  ibv_mtu mtu = IBV_MTU_1024;
  bool roce = true;
  int score = -1;
  int distance = -1;
};

// Fills the best GID of `port` into `out`; false when the port is unusable.
bool ChoosePortGid(VerbsApi& verbs, ibv_context* ctx, uint8_t port, int forced_gid,
                   Candidate& out) {
  ibv_port_attr attr{};
  if (verbs.QueryPort(ctx, port, &attr) != 0 || attr.state != IBV_PORT_ACTIVE) return false;
  out.port = port;
  out.mtu = attr.active_mtu;
  out.roce = attr.link_layer == IBV_LINK_LAYER_ETHERNET;
  for (int index = 0; index < attr.gid_tbl_len; ++index) {
    if (forced_gid >= 0 && index != forced_gid) continue;
    ibv_gid_entry entry{};
    if (verbs.QueryGidEx(ctx, port, static_cast<uint32_t>(index), &entry) != 0) continue;
    if (IsZeroGid(entry.gid)) continue;
    const int score = GidScore(entry);
    if (score > out.score) {  // the first of equals: lowest index
      out.score = score;
      out.gid_index = index;
      out.gid = entry.gid;
    }
  }
  return out.score >= 0;
}

}  // namespace

absl::StatusOr<PortChoice> OpenPort(VerbsApi& verbs, const MeshOptions& options) {
  int count = 0;
  std::unique_ptr<ibv_device*, std::function<void(ibv_device**)>> list(
      verbs.GetDeviceList(&count), [&verbs](ibv_device** l) {
        if (l != nullptr) verbs.FreeDeviceList(l);
      });
  if (list == nullptr || count == 0) return absl::UnavailableError("rdma: no RDMA device found");
  const int gpu = options.backend == "cuda" ? options.device : -1;
  std::vector<Candidate> candidates;
  for (int i = 0; i < count; ++i) {
    ibv_device* device = list.get()[i];
    const std::string name = verbs.GetDeviceName(device);
    if (!options.rdma_device.empty() && name != options.rdma_device) continue;
    ContextHandle ctx(&verbs, verbs.OpenDevice(device));
    if (!ctx) continue;
    ibv_device_attr attr{};
    if (verbs.QueryDevice(ctx.get(), &attr) != 0) continue;
    for (uint8_t port = 1; port <= attr.phys_port_cnt; ++port) {
      if (options.rdma_port > 0 && port != options.rdma_port) continue;
      Candidate c;
      c.device = device;
      c.name = name;
      if (!ChoosePortGid(verbs, ctx.get(), port, options.rdma_gid_index, c)) continue;
      if (gpu >= 0) c.distance = PciDistanceToGpu(name, gpu);
      candidates.push_back(c);
    }
  }
  if (candidates.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "rdma: no active port", options.rdma_device.empty() ? "" : " on ", options.rdma_device,
        options.rdma_gid_index >= 0 ? absl::StrCat(" with GID index ", options.rdma_gid_index)
                                    : ""));
  }
  const Candidate* best = &candidates.front();
  for (const Candidate& c : candidates) {
    const bool nearer =
        c.distance >= 0 && (best->distance < 0 || c.distance < best->distance);
    if (c.score > best->score || (c.score == best->score && nearer)) best = &c;
  }
  PortChoice choice;
  choice.context = ContextHandle(&verbs, verbs.OpenDevice(best->device));
  if (!choice.context) return absl::UnavailableError(absl::StrCat("rdma: cannot open ", best->name));
  choice.device_name = best->name;
  choice.port = best->port;
  choice.gid_index = best->gid_index;
  choice.gid = best->gid;
  choice.active_mtu = best->mtu;
  choice.roce = best->roce;
  return choice;
}

int PciDistanceToGpu(const std::string& ib_device, int gpu_index) {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return -1;
  std::unique_ptr<hwloc_topology, void (*)(hwloc_topology_t)> guard(topo, hwloc_topology_destroy);
  hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(topo) != 0) return -1;
  const std::string gpu_names[] = {absl::StrCat("cuda", gpu_index),
                                   absl::StrCat("nvml", gpu_index)};
  hwloc_obj_t nic = nullptr;
  hwloc_obj_t gpu = nullptr;
  for (hwloc_obj_t os = hwloc_get_next_osdev(topo, nullptr); os != nullptr;
       os = hwloc_get_next_osdev(topo, os)) {
    if (os->name == nullptr) continue;
    if (ib_device == os->name) nic = os;
    for (const std::string& g : gpu_names) {
      if (g == os->name) gpu = os;
    }
  }
  if (nic == nullptr || gpu == nullptr) return -1;
  hwloc_obj_t common = hwloc_get_common_ancestor_obj(topo, nic, gpu);
  int hops = 0;
  for (hwloc_obj_t o = nic; o != common && o != nullptr; o = o->parent) ++hops;
  for (hwloc_obj_t o = gpu; o != common && o != nullptr; o = o->parent) ++hops;
  return hops;
}

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
  switch (status) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_LEN_ERR: return "local length error";
    case IBV_WC_LOC_QP_OP_ERR: return "local QP operation error";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "work request flushed";
    case IBV_WC_REM_INV_REQ_ERR: return "remote invalid request";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error";
    case IBV_WC_REM_OP_ERR: return "remote operation error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    case IBV_WC_FATAL_ERR: return "fatal error";
    case IBV_WC_GENERAL_ERR: return "general error";
    default: return "completion error";
  }
}

}  // namespace stepmesh::rdma
