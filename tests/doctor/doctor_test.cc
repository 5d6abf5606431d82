// stepmesh_doctor's checks on fake hosts: a healthy 8-GPU / 8-NIC node is
// ready, and each planted problem is reported as the failure (or warning) an
// operator must see before a job.

#include "src/tools/doctor/doctor.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#ifdef STEPMESH_HAVE_RDMA
#include "tests/rdma/fake_verbs.h"
#include "tests/support/fake_sysfs.h"
#endif
#ifdef STEPMESH_HAVE_CUDA
#include "tests/cuda/fake_cuda_api.h"
#endif

namespace stepmesh {
namespace {

using doctor::DoctorInputs;
using doctor::DoctorReport;
using doctor::RunDoctor;

bool Has(const DoctorReport& report, absl::string_view text) {
  return absl::StrContains(report.text, text);
}

TEST_CASE("doctor: a host with neither NIC nor GPU says so and fails", "[doctor]") {
  DoctorInputs in;
#ifdef STEPMESH_HAVE_RDMA
  testing::FakeFabric fabric;
  in.verbs = fabric.AddHost(std::vector<testing::FakeNicSpec>{});
#endif
#ifdef STEPMESH_HAVE_CUDA
  in.cuda = std::make_shared<cuda::testing::FakeCudaApi>(0);
#endif
  const DoctorReport report = RunDoctor(in);
  INFO(report.text);
  CHECK(Has(report, "FAIL  no GPU"));
  CHECK(Has(report, "FAIL  no RDMA device"));
  CHECK(report.failures == 2);
  CHECK(Has(report, "verdict: a run would FAIL"));
  // A TCP job on a host-memory run needs neither: warnings only.
  in.need_gpu = false;
  in.need_rdma = false;
  const DoctorReport tcp = RunDoctor(in);
  INFO(tcp.text);
  CHECK(tcp.failures == 0);
  CHECK(tcp.warnings == 2);
}

#if defined(STEPMESH_HAVE_RDMA) && defined(STEPMESH_HAVE_CUDA)

// An HGX-like host: 8 GPUs and 8 NICs (fake_sysfs.h), everything working
// unless a case plants a problem.
struct Host {
  struct Plant {
    uint64_t memlock = UINT64_MAX;
    bool nic_dmabuf = true;
    bool peer_memory = true;
    bool ordered_writes = true;  // the GPU orders NIC writes (else: host flush)
    bool flushable = true;
    ibv_port_state port_state = IBV_PORT_ACTIVE;
    bool copy_on_fork = true;
    std::vector<uint16_t> pkeys = {0xFFFF};
  };

  explicit Host(const Plant& plant) {
    sysfs.Hgx();
    std::filesystem::create_directories(sysfs.root() + "/module/nvidia_peermem");
    std::vector<std::string> physical;
    for (int k = 0; k < 8; ++k) physical.push_back(testing::FakeSysfs::HgxGpu(k));
    gpus = cuda::testing::FakeCudaApi::WithVisibleDevices(physical, "0,1,2,3,4,5,6,7");
    gpus->set_attribute(cudaDevAttrGPUDirectRDMASupported, 1);
    gpus->set_attribute(cudaDevAttrGPUDirectRDMAWritesOrdering,
                        plant.ordered_writes ? cudaGPUDirectRDMAWritesOrderingOwner
                                             : cudaGPUDirectRDMAWritesOrderingNone);
    gpus->set_attribute(cudaDevAttrGPUDirectRDMAFlushWritesOptions,
                        plant.flushable ? cudaFlushGPUDirectRDMAWritesOptionHost : 0);
    fabric.SetGpuDirect(plant.nic_dmabuf, plant.peer_memory);
    fabric.SetKernelCopyOnFork(plant.copy_on_fork);
    fabric.SetDeviceMemoryOracle(
        [api = gpus](const void* p, size_t n) { return api->IsDeviceMemory(p, n); });
    std::vector<testing::FakeNicSpec> nics;
    for (int i = 0; i < 8; ++i) {
      testing::FakeNicSpec nic;
      nic.name = absl::StrCat("mlx5_", i);
      nic.ipv4 = 0x0A000101 + static_cast<uint32_t>(i) * 0x100;
      nic.port_state = plant.port_state;
      nic.pkeys = plant.pkeys;
      nics.push_back(nic);
    }
    testing::FakeHostSpec host;
    host.memlock_limit = plant.memlock;
    in.verbs = fabric.AddHost(nics, host);
    in.cuda = gpus;
    in.sysfs_root = sysfs.root();
    in.options.transport = "rdma";
    in.options.num_servers = 4;
  }

  DoctorReport Run() { return RunDoctor(in); }

  testing::FakeSysfs sysfs;
  testing::FakeFabric fabric;
  std::shared_ptr<cuda::testing::FakeCudaApi> gpus;
  DoctorInputs in;
};

TEST_CASE("doctor: a healthy 8-GPU host is ready, every GPU with the NIC beside it", "[doctor]") {
  Host host({});
  const DoctorReport report = host.Run();
  INFO(report.text);
  CHECK(report.failures == 0);
  CHECK(Has(report, "verdict: ready"));
  for (int k = 0; k < 8; ++k) {
    CHECK(Has(report,
              absl::StrCat("GPU ", k, " (", absl::AsciiStrToLower(testing::FakeSysfs::HgxGpu(k)),
                           ") -> ", testing::FakeSysfs::HgxNicFor(k), " port 1")));
  }
  CHECK(Has(report, "same PCIe switch (PIX)"));
  CHECK(Has(report, "RLIMIT_MEMLOCK unlimited"));
  CHECK(Has(report, "ibv_fork_init is skipped"));
  CHECK(Has(report, "dma-buf MR of GPU memory on mlx5_7: works"));
  CHECK(Has(report, "peer-memory MR of GPU memory on mlx5_7: works"));
  CHECK(Has(report, "(RoCE v2)"));
  CHECK(Has(report, "active MTU 4096"));
  CHECK(Has(report, "NIC writes are ordered by the GPU itself"));
  CHECK(host.gpus->violations().empty());
}

TEST_CASE("doctor: planted problems are reported", "[doctor]") {
  // One problem each: the lines the report must have and its count of failures.
  struct Planted {
    const char* name;
    Host::Plant plant;
    std::vector<std::string> says;
    int failures;
  };
  const Planted planted[] = {
      {"RLIMIT_MEMLOCK of a container",
       {.memlock = 64 << 10},
       {"FAIL  rdma: RLIMIT_MEMLOCK (ulimit -l) is 64 KiB"},
       1},
      {"every port down",
       {.port_state = IBV_PORT_DOWN},
       {"mlx5_0 port 1: DOWN", "FAIL  GPU 0 (0000:13:00.0): rdma: no active port"},
       8},
      {"a GPU that neither orders nor can flush NIC writes",
       {.ordered_writes = false, .flushable = false},
       {"FAIL  the GPU neither orders NIC writes nor can flush them"},
       8},
      {"ibv_fork_init needed",
       {.copy_on_fork = false},
       {"fork: ibv_fork_init is needed on this kernel"},
       0},
  };
  for (const Planted& p : planted) {
    DYNAMIC_SECTION(p.name) {
      Host host(p.plant);
      const DoctorReport report = host.Run();
      INFO(report.text);
      for (const std::string& line : p.says) CHECK(Has(report, line));
      CHECK(report.failures == p.failures);
    }
  }
  SECTION("the NIC refuses dma-buf and peer memory is not loaded") {
    Host host({.nic_dmabuf = false, .peer_memory = false});
    const DoctorReport report = host.Run();
    INFO(report.text);
    CHECK(Has(report,
              "dma-buf MR of GPU memory on mlx5_7: refused (ibv_reg_dmabuf_mr: Operation "
              "not supported)"));
    CHECK(Has(report,
              "peer-memory MR of GPU memory on mlx5_7: refused (ibv_reg_mr: Bad address: "
              "nvidia-peermem not loaded?)"));
    CHECK(Has(report, "WARN  GPUDirect RDMA impossible on this NIC"));
    CHECK(report.failures == 0);  // staging works, slower
    host.in.options.rdma.gpudirect = GpuDirect::kRequire;
    const DoctorReport required = host.Run();
    CHECK(required.failures == 8);
  }
  SECTION("a P_Key the ports lack") {
    Host host({.pkeys = {0xFFFF, 0x8002}});
    host.in.options.rdma.pkey = 0x8001;
    const DoctorReport report = host.Run();
    INFO(report.text);
    CHECK(Has(report, "(STEPMESH_RDMA_PKEY): mlx5_7 port 1 is not in that partition"));
    CHECK(report.failures == 8);
  }
  SECTION("one NIC for all GPUs") {
    Host host({});
    host.in.options.rdma.device = "mlx5_5";
    const DoctorReport report = host.Run();
    INFO(report.text);
    CHECK(Has(report, "WARN  every GPU uses mlx5_5: all ranks share one port"));
    CHECK(Has(report, "WARN  GPU 7 (0000:f3:00.0): the nearest usable NIC is on another socket"));
  }
}

#endif  // STEPMESH_HAVE_RDMA && STEPMESH_HAVE_CUDA

}  // namespace
}  // namespace stepmesh
