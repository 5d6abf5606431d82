// FI_HMEM: the libfabric transport registers CUDA memory in place where the
// provider advertises FI_HMEM (fi_mr_regattr, iface FI_HMEM_CUDA, the
// tensor's device) and refuses it otherwise, so that the core stages the
// tensor through pinned host memory -- the RDMA path's rule. CI has no GPU:
// the provider is this machine's shm behind HmemFabric (hmem_fabric.h),
// which advertises FI_HMEM or not and records every registration; "device"
// memory is host memory that stands in for it. Not run on a GPU (no GPU
// program for this path yet: docs/libfabric.md, "Not done").

#include <rdma/fi_domain.h>
#include <rdma/fi_errno.h>

#include <catch2/catch.hpp>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "src/transport/libfabric/fabric_endpoint.h"
#include "src/transport/libfabric/libfabric_transport.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "tests/libfabric/fabric_pair.h"
#include "tests/libfabric/hmem_fabric.h"
#include "tests/support/status.h"

namespace stepmesh::testing {
namespace {

MeshOptions CudaOptions() {
  MeshOptions o;
  o.transport = "libfabric";
  o.fi_provider = "shm";
  o.backend = "cuda";  // only a CUDA participant asks for FI_HMEM
  o.timeout = absl::Seconds(10);
  o.fi_nics = 2;
  return o;
}

const libfabric::FabricApi& Real() {
  auto api = libfabric::LoadFabricApi();
  REQUIRE_OK(api.status());
  return **api;
}

int CudaRegistrations(const std::vector<HmemRegistration>& regs, int device) {
  int n = 0;
  for (const HmemRegistration& r : regs) {
    if (r.iface == FI_HMEM_CUDA && r.cuda_device == device) ++n;
  }
  return n;
}

TEST_CASE(
    "libfabric FI_HMEM: where the provider advertises it, CUDA memory is registered in place "
    "(FI_HMEM_CUDA, its device) on every rail",
    "[libfabric][hmem]") {
  HmemFabric fabric(Real(), /*advertise=*/true);
  libfabric::LibfabricHooks hooks;
  hooks.api = &fabric.api();
  auto made = FabricPair::Make(CudaOptions(), hooks, 64 << 10, Device::Cuda(3));
  REQUIRE_OK(made.status());
  FabricPair& pair = **made;
  CHECK(pair.worker().CanAccess(Device::Cuda(3)));
  CHECK(pair.worker().CanAccess(Device::Cpu()));
  const std::vector<HmemRegistration> regs = fabric.registrations();
  // Two rails: the worker's source once per rail; the server's region once
  // per rail and its slot once per rail (remote-writable).
  CHECK(CudaRegistrations(regs, 3) == 2 + 2 + 2);
  for (const HmemRegistration& r : regs) {
    if (r.iface != FI_HMEM_CUDA) continue;
    CHECK(r.bytes == (64u << 10));
    CHECK((r.access & (FI_READ | FI_WRITE | FI_REMOTE_WRITE)) != 0);
  }
  pair.StartPolling(absl::Milliseconds(1));
  REQUIRE_OK(pair.Push(1));
  REQUIRE(pair.AwaitFrames(1, absl::Seconds(10)));
  CHECK(pair.server_sink().delivered.load() == 1);
  CHECK(pair.SlotMatchesSource());
}

TEST_CASE(
    "libfabric FI_HMEM: a provider without it cannot register CUDA memory: the error names "
    "FI_HMEM and the core stages the tensor",
    "[libfabric][hmem]") {
  HmemFabric fabric(Real(), /*advertise=*/false);
  SECTION("the fake refuses FI_HMEM like a real provider") {
    fi_info* hints = fabric.api().dupinfo(nullptr);
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_RMA | FI_HMEM;
    fi_info* info = nullptr;
    CHECK(fabric.api().getinfo(FI_VERSION(1, 9), nullptr, nullptr, 0, hints, &info) == -FI_ENODATA);
    fabric.api().freeinfo(hints);
    auto e = libfabric::FabricEndpoint::Open(fabric.api(), {.provider = "shm", .hmem = true});
    REQUIRE_OK(e.status());
    CHECK_FALSE((*e)->hmem());  // opened without it
    std::vector<std::byte> buf(4096);
    const iovec iov{buf.data(), buf.size()};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_WRITE;
    attr.iface = FI_HMEM_CUDA;
    fid_mr* mr = nullptr;
    CHECK(fi_mr_regattr((*e)->domain(), &attr, 0, &mr) == -FI_ENOSYS);
  }
  SECTION("the transport") {
    libfabric::LibfabricHooks hooks;
    hooks.api = &fabric.api();
    const absl::Status s =
        FabricPair::Make(CudaOptions(), hooks, 64 << 10, Device::Cuda(1)).status();
    INFO(s.ToString());
    CHECK(absl::IsFailedPrecondition(s));
    CHECK(absl::StrContains(s.message(), "needs FI_HMEM, which this provider lacks"));
    CHECK(absl::StrContains(s.message(), "key 7"));
    CHECK(CudaRegistrations(fabric.registrations(), 1) == 0);  // never tried
  }
}

TEST_CASE(
    "libfabric FI_HMEM: STEPMESH_RDMA_GPUDIRECT=off and non-CUDA participants never ask for it",
    "[libfabric][hmem]") {
  HmemFabric fabric(Real(), /*advertise=*/true);
  libfabric::LibfabricHooks hooks;
  hooks.api = &fabric.api();
  MeshOptions o = CudaOptions();
  SECTION("gpudirect off") { o.rdma.gpudirect = GpuDirect::kOff; }
  SECTION("a host backend") { o.backend = "cpu_mock"; }
  auto t = libfabric::CreateLibfabricTransport(o, tcp::CreateTcpTransport, hooks);
  REQUIRE_OK(t.status());
  CHECK_FALSE((*t)->CanAccess(Device::Cuda(0)));
  core::RegionInfo r{.id = 1, .key = 9, .base = nullptr, .slot_bytes = 4096};
  std::vector<std::byte> buf(4096);
  r.base = buf.data();
  r.device = Device::Cuda(0);
  const absl::Status s = (*t)->RegisterRegion(r);
  CHECK(absl::IsFailedPrecondition(s));
  CHECK(CudaRegistrations(fabric.registrations(), 0) == 0);
}

}  // namespace
}  // namespace stepmesh::testing
