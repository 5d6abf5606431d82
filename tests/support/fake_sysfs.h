#pragma once
// A fake /sys tree for NIC–GPU placement: a directory with
// devices/pci<domain>:<bus>/... (the PCI hierarchy, numa_node files),
// bus/pci/devices/<bdf> and class/infiniband/<name>/device symlinks, laid out
// as the kernel does. FakeSysfs::Hgx() builds an 8-GPU / 8-NIC two-socket
// host: each GPU shares a PCIe switch with one NIC, four switches per socket,
// each switch under its own host bridge.

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"

namespace stepmesh::testing {

class FakeSysfs {
 public:
  FakeSysfs() {
    char pattern[] = "/tmp/stepmesh_sysfs.XXXXXX";
    const char* made = ::mkdtemp(pattern);
    root_ = made != nullptr ? made : "/nonexistent";
  }
  ~FakeSysfs() {
    std::error_code ignored;
    std::filesystem::remove_all(root_, ignored);
  }
  FakeSysfs(const FakeSysfs&) = delete;
  FakeSysfs& operator=(const FakeSysfs&) = delete;

  const std::string& root() const { return root_; }

  // A PCI device at `chain` (root bus first: {"pci0000:17", "0000:17:01.0",
  // ...}, the device last), on NUMA node `numa`.
  void AddPci(const std::vector<std::string>& chain, int numa) {
    std::string dir = root_ + "/devices";
    for (const std::string& part : chain) dir += "/" + part;
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/numa_node") << numa << "\n";
    std::filesystem::create_directories(root_ + "/bus/pci/devices");
    std::string up = "../../..";
    std::string target = up + "/devices";
    for (const std::string& part : chain) target += "/" + part;
    std::filesystem::create_symlink(target, root_ + "/bus/pci/devices/" + chain.back());
  }
  // A verbs device `name` whose PCI function is the device at `chain`.
  void AddNic(const std::string& name, const std::vector<std::string>& chain, int numa) {
    AddPci(chain, numa);
    const std::string dir = root_ + "/class/infiniband/" + name;
    std::filesystem::create_directories(dir);
    std::string target = "../../../devices";
    for (const std::string& part : chain) target += "/" + part;
    std::filesystem::create_symlink(target, dir + "/device");
  }

  // GPU k's PCI address in Hgx(): upper case, as cudaDeviceGetPCIBusId gives it.
  static std::string HgxGpu(int k) { return absl::StrFormat("0000:%02X:00.0", Bus(k) + 3); }
  // The NIC sharing GPU k's switch is "mlx5_<7 - k>": listing order is not
  // placement order, so "the first NIC" is right for one GPU only.
  static std::string HgxNicFor(int k) { return absl::StrFormat("mlx5_%d", 7 - k); }

  void Hgx() {
    for (int k = 0; k < 8; ++k) {
      const int bus = Bus(k);
      const int numa = k / 4;
      const std::vector<std::string> sw = {absl::StrFormat("pci0000:%02x", bus),
                                           absl::StrFormat("0000:%02x:01.0", bus),
                                           absl::StrFormat("0000:%02x:00.0", bus + 1)};
      std::vector<std::string> gpu = sw;
      gpu.push_back(absl::StrFormat("0000:%02x:00.0", bus + 2));
      gpu.push_back(absl::StrFormat("0000:%02x:00.0", bus + 3));
      std::vector<std::string> nic = sw;
      nic.push_back(absl::StrFormat("0000:%02x:01.0", bus + 2));
      nic.push_back(absl::StrFormat("0000:%02x:00.0", bus + 4));
      AddPci(gpu, numa);
      AddNic(HgxNicFor(k), nic, numa);
    }
  }

 private:
  static int Bus(int k) { return 0x10 + 0x20 * k; }
  std::string root_;
};

}  // namespace stepmesh::testing
