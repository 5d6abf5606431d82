// NIC choice by PCI topology: on a fake 8-GPU / 8-NIC two-socket sysfs tree
// every GPU gets the NIC behind its own PCIe switch, not the first one listed.

#include <algorithm>
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "src/transport/rdma/pci_topology.h"
#include "src/transport/rdma/verbs_resources.h"
#include "tests/rdma/fake_verbs.h"
#include "tests/support/fake_sysfs.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

using testing::FakeFabric;
using testing::FakeSysfs;

// One host with mlx5_0..mlx5_7, listed in name order.
std::shared_ptr<rdma::VerbsApi> EightNics(FakeFabric& fabric) {
  return fabric.AddHost(testing::Mlx5Nics(8));
}

TEST_CASE("topology: sysfs placement classes (PIX, NODE, SYS, unknown)", "[rdma][topology]") {
  FakeSysfs sysfs;
  sysfs.Hgx();
  const rdma::PciPlacement own =
      rdma::PlaceNic(sysfs.root(), FakeSysfs::HgxNicFor(2), FakeSysfs::HgxGpu(2));
  CHECK(own.affinity == rdma::PciAffinity::kSameSwitch);
  CHECK(own.hops == 4);
  CHECK(own.nic_pci == "0000:54:00.0");
  CHECK(rdma::PlaceNic(sysfs.root(), FakeSysfs::HgxNicFor(3), FakeSysfs::HgxGpu(2)).affinity ==
        rdma::PciAffinity::kSameNode);
  CHECK(rdma::PlaceNic(sysfs.root(), FakeSysfs::HgxNicFor(5), FakeSysfs::HgxGpu(2)).affinity ==
        rdma::PciAffinity::kOtherNode);
  CHECK(rdma::PlaceNic(sysfs.root(), "no_such_nic", FakeSysfs::HgxGpu(2)).affinity ==
        rdma::PciAffinity::kUnknown);
  // CUDA's 8-digit domain spelling finds the same device.
  CHECK(rdma::PlaceNic(sysfs.root(), FakeSysfs::HgxNicFor(2), "00000000:53:00.0").affinity ==
        rdma::PciAffinity::kSameSwitch);
}

TEST_CASE("topology: each of 8 GPUs gets the NIC behind its own switch", "[rdma][topology]") {
  FakeSysfs sysfs;
  sysfs.Hgx();
  FakeFabric fabric;
  auto verbs = EightNics(fabric);
  std::vector<std::string> chosen;
  for (int gpu = 0; gpu < 8; ++gpu) {
    MeshOptions o;
    o.backend = "cuda";
    o.device = gpu;
    o.rdma.sysfs_root = sysfs.root();
    o.rdma.gpu_pci_bus_id = FakeSysfs::HgxGpu(gpu);
    auto port = rdma::OpenPort(*verbs, o);
    REQUIRE_OK(port.status());
    INFO("GPU " << gpu << ": " << port->device_name << " (" << port->why << ")");
    CHECK(port->device_name == FakeSysfs::HgxNicFor(gpu));
    CHECK(absl::StrContains(port->why, "PIX"));
    chosen.push_back(port->device_name);
  }
  std::sort(chosen.begin(), chosen.end());
  CHECK(std::unique(chosen.begin(), chosen.end()) == chosen.end());  // 8 different NICs
}

TEST_CASE("topology: STEPMESH_RDMA_DEVICE still decides, a list narrows the choice",
          "[rdma][topology]") {
  FakeSysfs sysfs;
  sysfs.Hgx();
  FakeFabric fabric;
  auto verbs = EightNics(fabric);
  MeshOptions o;
  o.rdma.sysfs_root = sysfs.root();
  o.rdma.gpu_pci_bus_id = FakeSysfs::HgxGpu(6);  // beside mlx5_1
  o.rdma.device = "mlx5_3";
  auto port = rdma::OpenPort(*verbs, o);
  REQUIRE_OK(port.status());
  CHECK(port->device_name == "mlx5_3");
  o.rdma.device = "mlx5_0,mlx5_1";
  port = rdma::OpenPort(*verbs, o);
  REQUIRE_OK(port.status());
  CHECK(port->device_name == "mlx5_1");
  // Without sysfs (or a GPU) the first listed of equals, as before.
  o.rdma.sysfs_root = "/nonexistent";
  port = rdma::OpenPort(*verbs, o);
  REQUIRE_OK(port.status());
  CHECK(port->device_name == "mlx5_0");
}

}  // namespace
}  // namespace stepmesh
