#pragma once
// Where a NIC sits relative to a GPU on the PCI tree, read from sysfs as NCCL
// does (no hwloc plugin needed): the GPU by its PCI bus id (which the CUDA
// runtime reports for a CUDA index, so CUDA_VISIBLE_DEVICES is already
// applied), the NIC by /sys/class/infiniband/<name>/device. Both resolve to a
// path under /sys/devices/pci<domain>:<bus>/...; the shorter the walk between
// them, the nearer.

#include <string>

namespace stepmesh::rdma {

// How near two PCI devices are, nearest first (NCCL's PIX/PXB/PHB/NODE/SYS).
enum class PciAffinity : int {
  kSameSwitch = 0,  // PIX: behind the same PCIe switch (at most one bridge between)
  kSwitches = 1,    // PXB: behind several switches, same host bridge
  kHostBridge = 2,  // PHB: only the host bridge (root complex) in common
  kSameNode = 3,    // NODE: other host bridges of the same NUMA node
  kOtherNode = 4,   // SYS: across the socket interconnect
  kUnknown = 5,     // a device not found in sysfs
};
const char* PciAffinityName(PciAffinity affinity);

struct PciPlacement {
  PciAffinity affinity = PciAffinity::kUnknown;
  int hops = -1;        // PCI links between the two (same host bridge only), else -1
  std::string nic_pci;  // the NIC's PCI address ("0000:3a:00.0"), empty when unknown
  // Smaller is nearer; orders candidates (affinity, then hops).
  int Rank() const { return static_cast<int>(affinity) * 1000 + (hops < 0 ? 999 : hops); }
};

// Placement of verbs device `ib_device` relative to the PCI device `gpu_bus_id`
// ("0000:3B:00.0", any case) under `sysfs_root` ("/sys", or a test's tree).
PciPlacement PlaceNic(const std::string& sysfs_root, const std::string& ib_device,
                      const std::string& gpu_bus_id);

// The canonical sysfs path of a PCI device (…/pci0000:17/0000:17:00.0/0000:18:00.0),
// empty when it is not there.
std::string PciDevicePath(const std::string& sysfs_root, const std::string& bus_id);
// The same for a verbs device, through class/infiniband/<name>/device.
std::string NicDevicePath(const std::string& sysfs_root, const std::string& ib_device);
// The NUMA node sysfs gives the device at `path`, -1 when unknown.
int NumaNodeOf(const std::string& path);

}  // namespace stepmesh::rdma
