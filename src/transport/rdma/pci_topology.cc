#include "src/transport/rdma/pci_topology.h"

#include <limits.h>
#include <stdlib.h>

#include <cctype>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "src/base/enum_names.h"

namespace stepmesh::rdma {
namespace {

std::string RealPath(const std::string& path) {
  std::unique_ptr<char, void (*)(void*)> resolved(::realpath(path.c_str(), nullptr), ::free);
  return resolved == nullptr ? std::string() : std::string(resolved.get());
}

// The components after ".../devices/": {"pci0000:17", "0000:17:00.0", ...}.
std::vector<std::string> PciComponents(const std::string& path) {
  const size_t at = path.rfind("/devices/pci");
  if (at == std::string::npos) return {};
  return absl::StrSplit(path.substr(at + 9), '/', absl::SkipEmpty());
}

}  // namespace

namespace {

constexpr const char* kPciAffinityNames[] = {
    "same PCIe switch (PIX)",
    "same host bridge through several switches (PXB)",
    "same host bridge only (PHB)",
    "same NUMA node, another host bridge (NODE)",
    "another NUMA node, across the socket link (SYS)",
};
static_assert(std::size(kPciAffinityNames) == static_cast<size_t>(PciAffinity::kUnknown));

}  // namespace

const char* PciAffinityName(PciAffinity affinity) {
  return base::NameOf(kPciAffinityNames, affinity, "unknown (not in sysfs)");
}

std::string PciDevicePath(const std::string& sysfs_root, const std::string& bus_id) {
  std::string id = bus_id;
  for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // CUDA gives "00000000:3B:00.0" on some versions: sysfs has a 4-digit domain.
  if (const size_t colon = id.find(':'); colon != std::string::npos && colon > 4) {
    id = id.substr(colon - 4);
  }
  return RealPath(absl::StrCat(sysfs_root, "/bus/pci/devices/", id));
}

std::string NicDevicePath(const std::string& sysfs_root, const std::string& ib_device) {
  return RealPath(absl::StrCat(sysfs_root, "/class/infiniband/", ib_device, "/device"));
}

int NumaNodeOf(const std::string& path) {
  std::ifstream file(absl::StrCat(path, "/numa_node"));
  std::string line;
  int node = -1;
  if (!file || !std::getline(file, line) ||
      !absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &node)) {
    return -1;
  }
  return node;
}

PciPlacement PlaceNic(const std::string& sysfs_root, const std::string& ib_device,
                      const std::string& gpu_bus_id) {
  PciPlacement out;
  const std::string nic_path = NicDevicePath(sysfs_root, ib_device);
  const std::vector<std::string> nic = PciComponents(nic_path);
  if (!nic.empty()) out.nic_pci = nic.back();
  const std::string gpu_path = PciDevicePath(sysfs_root, gpu_bus_id);
  const std::vector<std::string> gpu = PciComponents(gpu_path);
  if (nic.size() < 2 || gpu.size() < 2) return out;
  if (nic.front() != gpu.front()) {
    // Different host bridges: the NUMA nodes tell a socket crossing.
    const int a = NumaNodeOf(nic_path);
    const int b = NumaNodeOf(gpu_path);
    out.affinity = a >= 0 && a == b ? PciAffinity::kSameNode : PciAffinity::kOtherNode;
    return out;
  }
  size_t common = 0;
  while (common < nic.size() && common < gpu.size() && nic[common] == gpu[common]) ++common;
  out.hops = static_cast<int>((nic.size() - common) + (gpu.size() - common));
  // common == 1: only the root bus; 2: the same root port; deeper: a switch.
  if (common <= 2) {
    out.affinity = PciAffinity::kHostBridge;
  } else if (out.hops <= 4) {
    out.affinity = PciAffinity::kSameSwitch;
  } else {
    out.affinity = PciAffinity::kSwitches;
  }
  return out;
}

}  // namespace stepmesh::rdma
