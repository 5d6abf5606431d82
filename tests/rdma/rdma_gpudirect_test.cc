// GPUDirect RDMA through the core: device tensors of the CUDA backend (over
// FakeCudaApi, whose "device" memory is host memory the test can read) moved
// by the RDMA transport over fake verbs that treat that memory as a GPU's:
// a plain ibv_reg_mr on it fails unless peer memory is on, ibv_reg_dmabuf_mr
// checks the exported fd and offset. Each case runs a 1A1F exchange and checks
// every byte, then which path the bytes took.

#include <dirent.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "src/backends/cuda/cuda_backend.h"
#include "src/core/mesh.h"
#include "src/transport/rdma/rdma_transport.h"
#include "src/transport/rdma/verbs_resources.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "stepmesh/scheduler.h"
#include "stepmesh/status.h"
#include "tests/cuda/fake_cuda_api.h"
#include "tests/rdma/fake_verbs.h"
#include "tests/support/fake_fabric.h"
#include "tests/support/fake_sysfs.h"

namespace stepmesh {
namespace {

using cuda::testing::FakeCudaApi;
using testing::FakeFabric;

constexpr Key kPushKey = 7;
constexpr Key kPullKey = 8;
constexpr size_t kPushBytes = 3 * 4096 + 100;  // not page-sized: exports must round
constexpr size_t kPullBytes = 2 * kPushBytes;
constexpr int kIterations = 12;

uint8_t PushByte(int iteration, size_t j) { return static_cast<uint8_t>(iteration * 31 + j * 7); }
uint8_t ReplyByte(int iteration, size_t j) {
  return static_cast<uint8_t>(PushByte(iteration, j % kPushBytes) ^ 0x5A);
}

struct Setup {
  bool nic_dmabuf = true;         // the NIC and kernel take dma-buf MRs
  bool peer_memory = false;       // ibv_reg_mr works on GPU memory (nvidia-peermem)
  int dmabuf_errno = EOPNOTSUPP;  // what a NIC that refuses dma-buf MRs says
  bool driver_dmabuf = true;      // the CUDA driver exports dma-bufs
  bool ordered_writes = false;    // the GPU orders NIC writes itself (no flush needed)
  GpuDirect mode = GpuDirect::kAuto;
  bool tcp = false;  // the TCP fallback instead of RDMA (it never reaches device memory)
};

// What one participant's fake GPU saw.
struct SideCounts {
  int memcpys = 0;  // staging copies
  int flushes = 0;
  size_t exports = 0;
  std::vector<std::string> violations;
};

struct Outcome {
  absl::Status worker = absl::OkStatus();
  absl::Status server = absl::OkStatus();
  SideCounts worker_gpu;
  SideCounts server_gpu;
  uint64_t dmabuf_mrs = 0;
  uint64_t peer_memory_mrs = 0;
  uint64_t access_errors = 0;
};

std::shared_ptr<FakeCudaApi> MakeGpu(const Setup& setup) {
  auto api = std::make_shared<FakeCudaApi>(1);
  // The fake NIC and this test's stand-ins for kernels touch device memory directly.
  api->set_device_memory_host_accessible(true);
  api->set_has_dmabuf(setup.driver_dmabuf);
  api->set_attribute(cudaDevAttrGPUDirectRDMAFlushWritesOptions,
                     cudaFlushGPUDirectRDMAWritesOptionHost);
  api->set_attribute(cudaDevAttrGPUDirectRDMAWritesOrdering,
                     setup.ordered_writes ? cudaGPUDirectRDMAWritesOrderingOwner
                                          : cudaGPUDirectRDMAWritesOrderingNone);
  return api;
}

// `setup_memcpys`: the copies the backend made for itself when it was created.
int Memcpys(FakeCudaApi& api) { return api.Calls("cudaMemcpy") + api.Calls("cudaMemcpyAsync"); }

SideCounts Counts(FakeCudaApi& api, int setup_memcpys) {
  return {Memcpys(api) - setup_memcpys, api.Calls("cudaDeviceFlushGPUDirectRDMAWrites"),
          api.exported_ranges().size(), api.violations()};
}

absl::StatusOr<std::unique_ptr<Memory>> DeviceTensor(Backend& backend, FakeFabric& fabric,
                                                     size_t bytes) {
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<Memory> memory,
                            backend.Allocate(bytes, MemoryKind::kDevice));
  fabric.AddDeviceMemory(memory->data(), memory->bytes());
  return memory;
}

TensorView Bytes(Memory& memory, size_t bytes) {
  return memory.View(DType::kUInt8, Shape{1, static_cast<int64_t>(bytes)});
}

// A participant's part of the exchange, on two device tensors (kPushBytes and
// kPullBytes): `attach` registers them, then barrier, `step(i)` for every
// iteration, barrier, and the node shuts down before the tensors go.
template <typename Node, typename Attach, typename Step>
absl::Status RunNode(Node& node, Backend& backend, FakeFabric& fabric, Attach attach, Step step) {
  STEPMESH_ASSIGN_OR_RETURN(auto sent, DeviceTensor(backend, fabric, kPushBytes));
  STEPMESH_ASSIGN_OR_RETURN(auto replied, DeviceTensor(backend, fabric, kPullBytes));
  absl::Status status = [&]() -> absl::Status {
    STEPMESH_RETURN_IF_ERROR(attach(*sent, *replied));
    STEPMESH_RETURN_IF_ERROR(node.Barrier());
    for (int i = 0; i < kIterations; ++i) STEPMESH_RETURN_IF_ERROR(step(i, *sent, *replied));
    return node.Barrier();
  }();
  (void)node.Shutdown();
  return status;
}

absl::Status RunServer(AFTensorServer& server, Backend& backend, FakeFabric& fabric) {
  auto attach = [&](Memory& recv, Memory& reply) -> absl::Status {
    STEPMESH_RETURN_IF_ERROR(server.RegisterRecvTensor(kPushKey, Bytes(recv, kPushBytes)));
    return server.RegisterReplyTensor(kPullKey, Bytes(reply, kPullBytes));
  };
  auto step = [&](int i, Memory&, Memory& reply) -> absl::Status {
    STEPMESH_ASSIGN_OR_RETURN(Batch batch, server.GetBatch(absl::Seconds(10)));
    const auto* in = static_cast<const uint8_t*>(batch.tensors.at(0).region.data);
    for (size_t j = 0; j < kPushBytes; ++j) {
      if (in[j] != PushByte(i, j)) {
        return absl::DataLossError(absl::StrCat("server: iteration ", i, " byte ", j));
      }
    }
    auto* out = static_cast<uint8_t*>(reply.data());
    for (size_t j = 0; j < kPullBytes; ++j) out[j] = in[j % kPushBytes] ^ 0x5A;
    const Reply r{0};
    return server.Respond(batch, {&r, 1});
  };
  return RunNode(server, backend, fabric, attach, step);
}

absl::Status RunWorker(AFTensorWorker& worker, Backend& backend, FakeFabric& fabric) {
  auto attach = [&](Memory& push, Memory& pull) -> absl::Status {
    STEPMESH_RETURN_IF_ERROR(worker.RegisterPushTensor(kPushKey, Bytes(push, kPushBytes)));
    return worker.RegisterPullTensor(kPullKey, 0, Bytes(pull, kPullBytes));
  };
  auto step = [&](int i, Memory& push, Memory& pull) -> absl::Status {
    auto* in = static_cast<uint8_t*>(push.data());
    for (size_t j = 0; j < kPushBytes; ++j) in[j] = PushByte(i, j);
    const Push p{kPushKey};
    const Pull q{kPullKey, 0};
    STEPMESH_ASSIGN_OR_RETURN(RequestHandle handle, worker.PushPull({&p, 1}, {&q, 1}));
    STEPMESH_RETURN_IF_ERROR(worker.Wait(handle, absl::Seconds(10)));
    const auto* out = static_cast<const uint8_t*>(pull.data());
    for (size_t j = 0; j < kPullBytes; ++j) {
      if (out[j] != ReplyByte(i, j)) {
        return absl::DataLossError(absl::StrCat("worker: iteration ", i, " byte ", j, " is ",
                                                int{out[j]}, ", expected ", int{ReplyByte(i, j)}));
      }
    }
    return absl::OkStatus();
  };
  return RunNode(worker, backend, fabric, attach, step);
}

// One side on its own fake GPU: its backend (counting the copies it made for
// itself), `create(options, backend)`, then `run(node, backend)`.
template <typename Create, typename Run>
absl::Status RunSide(MeshOptions o, Role role, const std::shared_ptr<FakeCudaApi>& gpu,
                     std::atomic<int>& setup_memcpys, Create create, Run run) {
  o.role = role;
  o.rank = 0;
  auto backend = CreateCudaBackend(gpu, 0);
  setup_memcpys = Memcpys(*gpu);
  if (!backend.ok()) return backend.status();
  std::shared_ptr<Backend> shared = *std::move(backend);
  auto node = create(o, shared);
  return node.ok() ? run(**node, *shared) : node.status();
}

Outcome RunExchange(const Setup& setup) {
  Outcome outcome;
  auto fabric = std::make_shared<FakeFabric>();
  fabric->SetGpuDirect(setup.nic_dmabuf, setup.peer_memory, setup.dmabuf_errno);
  MeshOptions base;
  base.transport = "rdma";
  base.timeout = absl::Seconds(10);
  base.rdma.gpudirect = setup.mode;
  base.scheduler = "127.0.0.1:0";
  auto scheduler = Scheduler::Start(base);
  REQUIRE(scheduler.ok());
  base.scheduler = (*scheduler)->address();
  const core::TransportFactory factory = setup.tcp ? core::TransportFactory(tcp::CreateTcpTransport)
                                                   : testing::FakeRdmaFactory(fabric);

  auto worker_gpu = MakeGpu(setup);
  auto server_gpu = MakeGpu(setup);
  std::atomic<int> worker_setup_memcpys = 0, server_setup_memcpys = 0;
  {
    std::thread server_thread([&] {
      outcome.server = RunSide(
          base, Role::kServer, server_gpu, server_setup_memcpys,
          [&](const MeshOptions& o, std::shared_ptr<Backend> b) {
            return core::CreateServer(o, std::move(b), factory);
          },
          [&](AFTensorServer& server, Backend& b) { return RunServer(server, b, *fabric); });
    });
    outcome.worker = RunSide(
        base, Role::kWorker, worker_gpu, worker_setup_memcpys,
        [&](const MeshOptions& o, std::shared_ptr<Backend> b) {
          return core::CreateWorker(o, std::move(b), factory);
        },
        [&](AFTensorWorker& worker, Backend& b) { return RunWorker(worker, b, *fabric); });
    server_thread.join();
  }
  outcome.worker_gpu = Counts(*worker_gpu, worker_setup_memcpys);
  outcome.server_gpu = Counts(*server_gpu, server_setup_memcpys);
  outcome.dmabuf_mrs = fabric->stats().dmabuf_mrs;
  outcome.peer_memory_mrs = fabric->stats().peer_memory_mrs;
  outcome.access_errors = fabric->stats().access_errors;
  return outcome;
}

int OpenFds() {
  int n = 0;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (::readdir(dir) != nullptr) ++n;
    ::closedir(dir);
  }
  return n;
}

void CheckDelivered(const Outcome& o) {
  INFO("worker: " << o.worker.ToString() << " / server: " << o.server.ToString());
  CHECK(o.worker.ok());
  CHECK(o.server.ok());
  CHECK(o.access_errors == 0);
  for (const std::string& v : o.worker_gpu.violations) FAIL_CHECK("worker's GPU: " << v);
  for (const std::string& v : o.server_gpu.violations) FAIL_CHECK("server's GPU: " << v);
}

TEST_CASE("gpudirect: device tensors registered by dma-buf, no staging, flushed per arrival",
          "[rdma][gpudirect]") {
  const int fds_before = OpenFds();
  const Outcome o = RunExchange({});
  CheckDelivered(o);
  // Push, pull, recv and reply tensors each exported once; each MR'd by dma-buf
  // once (the two receive tensors by their one slot each, never as a whole too).
  CHECK(o.worker_gpu.exports == 2);
  CHECK(o.server_gpu.exports == 2);
  CHECK(o.dmabuf_mrs == 4);
  CHECK(o.worker_gpu.memcpys == 0);
  CHECK(o.server_gpu.memcpys == 0);
  // One flush per arrival: each pull on the worker, each push on the server.
  CHECK(o.worker_gpu.flushes == kIterations);
  CHECK(o.server_gpu.flushes == kIterations);
  // The exported fds were closed once registered (the MRs hold the buffers).
  CHECK(OpenFds() == fds_before);
}

TEST_CASE("gpudirect: a GPU that orders NIC writes itself is not flushed", "[rdma][gpudirect]") {
  const Outcome o = RunExchange({.ordered_writes = true});
  CheckDelivered(o);
  CHECK(o.dmabuf_mrs == 4);
  CHECK(o.worker_gpu.flushes == 0);
  CHECK(o.server_gpu.flushes == 0);
}

TEST_CASE("gpudirect: without dma-buf export, peer memory registers the device address",
          "[rdma][gpudirect]") {
  const Outcome o = RunExchange({.peer_memory = true, .driver_dmabuf = false});
  CheckDelivered(o);
  CHECK(o.dmabuf_mrs == 0);
  CHECK(o.worker_gpu.memcpys == 0);
  CHECK(o.server_gpu.memcpys == 0);
  CHECK(o.worker_gpu.flushes == kIterations);
}

TEST_CASE("gpudirect: CUDA exports a dma-buf, the NIC refuses it, peer memory registers instead",
          "[rdma][gpudirect]") {
  for (const int refusal : {EOPNOTSUPP, EPROTONOSUPPORT}) {
    INFO("ibv_reg_dmabuf_mr fails with errno " << refusal);
    const Outcome o =
        RunExchange({.nic_dmabuf = false, .peer_memory = true, .dmabuf_errno = refusal});
    CheckDelivered(o);
    CHECK(o.worker_gpu.exports >= 1);  // the driver did export
    CHECK(o.dmabuf_mrs == 0);
    CHECK(o.peer_memory_mrs == 4);  // push, pull's slot, recv's slot, reply: as by dma-buf
    CHECK(o.worker_gpu.memcpys == 0);
    CHECK(o.server_gpu.memcpys == 0);
    CHECK(o.worker_gpu.flushes == kIterations);
  }
}

TEST_CASE("gpudirect: a NIC that refuses device memory gets staged copies (auto)",
          "[rdma][gpudirect]") {
  // EOPNOTSUPP, and no peer memory: EFAULT
  const Outcome o = RunExchange({.nic_dmabuf = false});
  CheckDelivered(o);
  CHECK(o.dmabuf_mrs == 0);
  // Every push staged out and every reply staged in, on both sides.
  CHECK(o.worker_gpu.memcpys == 2 * kIterations);
  CHECK(o.server_gpu.memcpys == 2 * kIterations);
  CHECK(o.worker_gpu.flushes == 0);
}

TEST_CASE("gpudirect: off stages even where dma-buf would work", "[rdma][gpudirect]") {
  const Outcome o = RunExchange({.mode = GpuDirect::kOff});
  CheckDelivered(o);
  CHECK(o.worker_gpu.exports == 0);
  CHECK(o.dmabuf_mrs == 0);
  CHECK(o.worker_gpu.memcpys == 2 * kIterations);
}

TEST_CASE("gpudirect: require fails the registration instead of staging", "[rdma][gpudirect]") {
  const Outcome o = RunExchange({.nic_dmabuf = false, .mode = GpuDirect::kRequire});
  INFO(o.worker.ToString() << " / " << o.server.ToString());
  CHECK(absl::IsInternal(o.worker));
  CHECK(absl::StrContains(o.worker.message(), "dma-buf"));
  CHECK(o.worker_gpu.memcpys == 0);
  CHECK(o.access_errors == 0);
}

TEST_CASE("gpudirect: the TCP fallback stages device tensors, and refuses them under require",
          "[rdma][gpudirect]") {
  Setup setup;
  setup.tcp = true;
  Outcome o = RunExchange(setup);
  CheckDelivered(o);
  CHECK(o.worker_gpu.exports == 0);
  CHECK(o.worker_gpu.memcpys == 2 * kIterations);

  setup.mode = GpuDirect::kRequire;
  o = RunExchange(setup);
  CHECK(absl::IsFailedPrecondition(o.worker));
  CHECK(absl::StrContains(o.worker.message(), "tcp transport cannot reach cuda:0"));
}

TEST_CASE("topology: under CUDA_VISIBLE_DEVICES the NIC follows the physical GPU",
          "[rdma][topology]") {
  testing::FakeSysfs sysfs;
  sysfs.Hgx();
  std::vector<std::string> physical;
  for (int k = 0; k < 8; ++k) physical.push_back(testing::FakeSysfs::HgxGpu(k));
  // CUDA_VISIBLE_DEVICES=5,2: CUDA device 0 is physical GPU 5, device 1 is GPU 2.
  auto gpus = FakeCudaApi::WithVisibleDevices(physical, "5,2");
  for (const auto& [cuda_index, physical_gpu] : {std::pair{0, 5}, std::pair{1, 2}}) {
    INFO("CUDA device " << cuda_index << " = physical GPU " << physical_gpu);
    FakeFabric fabric;
    auto verbs = fabric.AddHost(testing::Mlx5Nics(8));
    auto backend = CreateCudaBackend(gpus, cuda_index);
    REQUIRE(backend.ok());
    std::string chosen, why, told;
    // The core's transport factory sees what the core made of the backend's
    // location; the test stops the worker there.
    const core::TransportFactory spy =
        [&](const MeshOptions& options) -> absl::StatusOr<std::unique_ptr<core::Transport>> {
      told = options.rdma.gpu_pci_bus_id;
      STEPMESH_ASSIGN_OR_RETURN(rdma::PortChoice port, rdma::OpenPort(*verbs, options));
      chosen = port.device_name;
      why = port.why;
      return absl::CancelledError("the test stops here");
    };
    MeshOptions o;
    o.role = Role::kWorker;
    o.rank = 0;
    o.transport = "rdma";
    o.backend = "cuda";
    o.device = cuda_index;
    o.rdma.sysfs_root = sysfs.root();
    auto worker = core::CreateWorker(o, std::shared_ptr<Backend>(*std::move(backend)), spy);
    CHECK(absl::IsCancelled(worker.status()));
    INFO(why);
    CHECK(told == absl::AsciiStrToLower(physical[static_cast<size_t>(physical_gpu)]));
    CHECK(chosen == testing::FakeSysfs::HgxNicFor(physical_gpu));
  }
}

}  // namespace
}  // namespace stepmesh
