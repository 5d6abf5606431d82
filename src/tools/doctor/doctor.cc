#include "src/tools/doctor/doctor.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/base/enum_names.h"
#include "src/base/net.h"

#ifdef STEPMESH_HAVE_RDMA
#include "src/transport/rdma/pci_topology.h"
#include "src/transport/rdma/peer_setup.h"
#include "src/transport/rdma/verbs_api.h"
#include "src/transport/rdma/verbs_resources.h"
#endif
#ifdef STEPMESH_HAVE_CUDA
#include "src/backends/cuda/cuda_api.h"
#endif

namespace stepmesh::doctor {
namespace {

class Report {
 public:
  void Title(const std::string& line) { out_.text += line + "\n"; }
  void Ok(const std::string& line) { out_.text += "  ok    " + line + "\n"; }
  void Info(const std::string& line) { out_.text += "        " + line + "\n"; }
  void Warn(const std::string& line) {
    out_.text += "  WARN  " + line + "\n";
    ++out_.warnings;
  }
  void Fail(const std::string& line) {
    out_.text += "  FAIL  " + line + "\n";
    ++out_.failures;
  }
  // FAIL when `needed`, else WARN.
  void Missing(bool needed, const std::string& line) { needed ? Fail(line) : Warn(line); }
  DoctorReport Take() { return std::move(out_); }

 private:
  DoctorReport out_;
};

struct Gpu {
  int index = 0;       // CUDA index (CUDA_VISIBLE_DEVICES applied)
  std::string bus_id;  // its PCI address, lower case
};

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// ---- GPUs ------------------------------------------------------------------

#ifdef STEPMESH_HAVE_CUDA
std::string CudaError(cuda::CudaApi& api, cudaError_t error) {
  return absl::StrCat(api.GetErrorName(error), " (", api.GetErrorString(error), ")");
}

int Attribute(cuda::CudaApi& api, cudaDeviceAttr attr, int device) {
  int value = 0;
  return api.DeviceGetAttribute(&value, attr, device) == cudaSuccess ? value : -1;
}

std::vector<Gpu> CheckGpus(const DoctorInputs& in, Report& r) {
  std::vector<Gpu> gpus;
  cuda::CudaApi& api = *in.cuda;
  int count = 0;
  const cudaError_t error = api.GetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    r.Missing(in.need_gpu, absl::StrCat("no GPU: ",
                                        error != cudaSuccess ? CudaError(api, error)
                                                             : std::string("0 CUDA devices"),
                                        in.need_gpu ? "" : " (not needed: --no-gpu)"));
    return gpus;
  }
  r.Ok(absl::StrCat(count, " CUDA device(s) visible"));
  for (int d = 0; d < count; ++d) {
    Gpu gpu;
    gpu.index = d;
    char bus[32] = {};
    if (api.DeviceGetPCIBusId(bus, sizeof(bus), d) == cudaSuccess) {
      gpu.bus_id = bus;
      for (char& c : gpu.bus_id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    r.Title(absl::StrCat("GPU ", d, " (PCI ", gpu.bus_id.empty() ? "unknown" : gpu.bus_id, ")"));
    const int rdma = Attribute(api, cudaDevAttrGPUDirectRDMASupported, d);
    const int ordering = Attribute(api, cudaDevAttrGPUDirectRDMAWritesOrdering, d);
    const int flush_options = Attribute(api, cudaDevAttrGPUDirectRDMAFlushWritesOptions, d);
    const int can_flush = Attribute(api, cudaDevAttrCanFlushRemoteWrites, d);
    const bool direct = in.options.rdma.gpudirect != GpuDirect::kOff;
    if (rdma == 1) {
      r.Ok("GPUDirect RDMA supported (cudaDevAttrGPUDirectRDMASupported)");
    } else {
      r.Missing(in.options.rdma.gpudirect == GpuDirect::kRequire,
                "GPUDirect RDMA not supported: device tensors are staged through host memory");
    }
    const bool ordered = ordering >= cudaGPUDirectRDMAWritesOrderingOwner;
    const bool host_flush =
        flush_options > 0 && (flush_options & cudaFlushGPUDirectRDMAWritesOptionHost);
    r.Info(absl::StrCat("GPUDirect write ordering: ",
                        ordering == cudaGPUDirectRDMAWritesOrderingAllDevices ? "all devices"
                        : ordering == cudaGPUDirectRDMAWritesOrderingOwner    ? "owner"
                                                                              : "none",
                        "; flush options: ", host_flush ? "host" : "none",
                        "; cudaDevAttrCanFlushRemoteWrites: ", can_flush));
    if (!ordered && !host_flush) {
      if (direct) {
        r.Fail(
            "the GPU neither orders NIC writes nor can flush them: FlushRemoteWrites fails, "
            "so GPUDirect arrivals cannot be reported (STEPMESH_RDMA_GPUDIRECT=off stages)");
      } else {
        r.Info("no ordering or flush, but STEPMESH_RDMA_GPUDIRECT=off stages anyway");
      }
    } else {
      r.Ok(ordered ? "NIC writes are ordered by the GPU itself: no flush per arrival"
                   : "NIC writes are flushed per arrival (cudaDeviceFlushGPUDirectRDMAWrites)");
    }
    const int queues =
        in.options.cuda_device_max_connections > 0 ? in.options.cuda_device_max_connections : 8;
    if (api.HasStreamMemOps()) {
      r.Ok(absl::StrCat("stream memory operations (cuStreamWaitValue32); ", queues,
                        " hardware queue(s) (CUDA_DEVICE_MAX_CONNECTIONS): memop waits while "
                        "the backend has at most ",
                        queues - 3, " stream(s), wait kernels beyond"));
    } else {
      r.Warn("no stream memory operations: GPU waits use a one-thread kernel (an SM slot each)");
    }
    if (api.HasDmabufExport()) {
      r.Ok("dma-buf export (cuMemGetHandleForAddressRange) resolved");
    } else {
      r.Warn("no dma-buf export (driver < CUDA 11.7): GPUDirect needs peer memory");
    }
    gpus.push_back(gpu);
  }
  return gpus;
}
#endif  // STEPMESH_HAVE_CUDA

// ---- RDMA ------------------------------------------------------------------

#ifdef STEPMESH_HAVE_RDMA
// From IBV_PORT_NOP; ACTIVE_DEFER and anything past the table: "not active".
constexpr const char* kPortStateNames[] = {"not active", "DOWN", "INIT (no subnet manager?)",
                                           "ARMED", "ACTIVE"};
static_assert(std::size(kPortStateNames) == size_t{IBV_PORT_ACTIVE} + 1);

const char* PortStateName(ibv_port_state state) {
  return base::NameOf(kPortStateNames, state, "not active");
}

int MtuBytes(ibv_mtu mtu) { return 128 << static_cast<int>(mtu); }

bool IsIpv4Mapped(const ibv_gid& gid) {
  for (int i = 0; i < 10; ++i) {
    if (gid.raw[i] != 0) return false;
  }
  return gid.raw[10] == 0xFF && gid.raw[11] == 0xFF;
}

std::string GidText(const ibv_gid& gid) {
  char text[INET6_ADDRSTRLEN] = {};
  if (IsIpv4Mapped(gid)) {
    ::inet_ntop(AF_INET, &gid.raw[12], text, sizeof(text));
  } else {
    ::inet_ntop(AF_INET6, gid.raw, text, sizeof(text));
  }
  return text;
}

// The local interface holding the GID's address, "eth2 10.0.0.1/24"; empty: none.
std::string InterfaceOf(const ibv_gid& gid) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> guard(list, ::freeifaddrs);
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_netmask == nullptr) continue;
    int bits = 0;
    bool same = false;
    if (a->ifa_addr->sa_family == AF_INET && IsIpv4Mapped(gid)) {
      const auto* addr = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
      const auto* mask = reinterpret_cast<const sockaddr_in*>(a->ifa_netmask);
      same = std::memcmp(&addr->sin_addr, &gid.raw[12], 4) == 0;
      bits = __builtin_popcount(mask->sin_addr.s_addr);
    } else if (a->ifa_addr->sa_family == AF_INET6 && !IsIpv4Mapped(gid)) {
      const auto* addr = reinterpret_cast<const sockaddr_in6*>(a->ifa_addr);
      const auto* mask = reinterpret_cast<const sockaddr_in6*>(a->ifa_netmask);
      same = std::memcmp(&addr->sin6_addr, gid.raw, 16) == 0;
      for (int i = 0; i < 16; ++i) bits += __builtin_popcount(mask->sin6_addr.s6_addr[i]);
    }
    if (same) return absl::StrCat(a->ifa_name, " ", GidText(gid), "/", bits);
  }
  return "";
}

void ListDevices(rdma::VerbsApi& verbs, Report& r, int* usable_transport) {
  int count = 0;
  ibv_device** list = verbs.GetDeviceList(&count);
  std::vector<std::string> lines;
  for (int i = 0; list != nullptr && i < count; ++i) {
    ibv_device* device = list[i];
    const std::string name = verbs.GetDeviceName(device);
    if (device->transport_type != IBV_TRANSPORT_IB) {
      lines.push_back(absl::StrCat(name,
                                   ": iWARP or other non-InfiniBand transport (refused: no "
                                   "immediate data)"));
      continue;
    }
    ++*usable_transport;
    ibv_context* ctx = verbs.OpenDevice(device);
    if (ctx == nullptr) {
      lines.push_back(absl::StrCat(name, ": cannot be opened (", std::strerror(errno), ")"));
      continue;
    }
    ibv_device_attr attr{};
    if (verbs.QueryDevice(ctx, &attr) == 0) {
      for (uint8_t p = 1; p <= attr.phys_port_cnt; ++p) {
        ibv_port_attr port{};
        if (verbs.QueryPort(ctx, p, &port) != 0) continue;
        lines.push_back(absl::StrCat(
            name, " port ", int{p}, ": ", PortStateName(port.state), ", ",
            port.link_layer == IBV_LINK_LAYER_INFINIBAND ? "InfiniBand" : "Ethernet (RoCE)",
            ", active MTU ", MtuBytes(port.active_mtu), ", ", port.gid_tbl_len, " GID entries"));
      }
    }
    (void)verbs.CloseDevice(ctx);
  }
  if (list != nullptr) verbs.FreeDeviceList(list);
  for (const std::string& line : lines) r.Info(line);
}

// A registration probe of device memory on the chosen NIC: what the
// transport will try for a device tensor, in the same order.
void ProbeGpuDirect(const DoctorInputs& in, const Gpu& gpu, rdma::PortChoice& port, Report& r) {
#ifdef STEPMESH_HAVE_CUDA
  if (in.cuda == nullptr || in.options.rdma.gpudirect == GpuDirect::kOff) return;
  cuda::CudaApi& api = *in.cuda;
  rdma::VerbsApi& verbs = *in.verbs;
  constexpr size_t kBytes = 2 << 20;
  if (api.SetDevice(gpu.index) != cudaSuccess) return;
  void* memory = nullptr;
  if (const cudaError_t e = api.Malloc(&memory, kBytes); e != cudaSuccess) {
    r.Warn(absl::StrCat("probe: cudaMalloc failed: ", CudaError(api, e)));
    return;
  }
  ibv_pd* pd = verbs.AllocPd(port.context.get());
  bool dmabuf_ok = false, peer_ok = false;
  std::string dmabuf_why = "no dma-buf export in the driver", peer_why;
  if (pd != nullptr) {
    if (api.HasDmabufExport()) {
      int fd = -1;
      const CUresult result =
          api.MemGetHandleForAddressRange(&fd, reinterpret_cast<CUdeviceptr>(memory), kBytes,
                                          CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
      if (result != CUDA_SUCCESS) {
        dmabuf_why =
            absl::StrCat("cuMemGetHandleForAddressRange: ", api.GetDriverErrorName(result));
      } else {
        ibv_mr* mr = verbs.RegDmabufMr(pd, 0, kBytes, reinterpret_cast<uintptr_t>(memory), fd,
                                       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
        if (mr != nullptr) {
          dmabuf_ok = true;
          (void)verbs.DeregMr(mr);
        } else {
          dmabuf_why = base::ErrnoMessage("ibv_reg_dmabuf_mr", errno);
        }
        ::close(fd);
      }
    }
    ibv_mr* mr = verbs.RegMr(pd, memory, kBytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (mr != nullptr) {
      peer_ok = true;
      (void)verbs.DeregMr(mr);
    } else {
      const int error = errno;
      peer_why = base::ErrnoMessage("ibv_reg_mr", error);
      if (error == EFAULT) absl::StrAppend(&peer_why, ": nvidia-peermem not loaded?");
    }
    (void)verbs.DeallocPd(pd);
  } else {
    dmabuf_why = peer_why = base::ErrnoMessage("ibv_alloc_pd", errno);
  }
  (void)api.Free(memory);
  dmabuf_ok ? r.Ok(absl::StrCat("dma-buf MR of GPU memory on ", port.device_name, ": works"))
            : r.Info(absl::StrCat("dma-buf MR of GPU memory on ", port.device_name, ": refused (",
                                  dmabuf_why, ")"));
  peer_ok ? r.Ok(absl::StrCat("peer-memory MR of GPU memory on ", port.device_name, ": works"))
          : r.Info(absl::StrCat("peer-memory MR of GPU memory on ", port.device_name, ": refused (",
                                peer_why, ")"));
  if (!dmabuf_ok && !peer_ok) {
    r.Missing(in.options.rdma.gpudirect == GpuDirect::kRequire,
              "GPUDirect RDMA impossible on this NIC: device tensors are staged through pinned "
              "host memory (STEPMESH_RDMA_GPUDIRECT=require would fail)");
  }
#else
  (void)in, (void)gpu, (void)port, (void)r;
#endif
}

void CheckRdma(const DoctorInputs& in, const std::vector<Gpu>& gpus, Report& r) {
  r.Title("RDMA");
  rdma::VerbsApi& verbs = *in.verbs;
  int usable_transport = 0;
  int count = 0;
  if (ibv_device** list = verbs.GetDeviceList(&count); list != nullptr) {
    verbs.FreeDeviceList(list);
  }
  if (count == 0) {
    r.Missing(in.need_rdma, absl::StrCat("no RDMA device (libibverbs lists none)",
                                         in.need_rdma ? "" : " (not needed for this run)"));
    return;
  }
  ListDevices(verbs, r, &usable_transport);
  // The process: locked memory and fork handling.
  const MeshOptions& o = in.options;
  const int peers = o.role == Role::kWorker ? o.num_servers : o.num_workers;
  const uint64_t pinned = uint64_t(std::max(peers, 1)) *
                          rdma::ControlBlockBytes(static_cast<uint32_t>(o.rdma.qps_per_peer),
                                                  static_cast<uint32_t>(o.rdma.recv_depth));
  uint64_t limit = 0;
  if (verbs.GetMemlockLimit(&limit) == 0) {
    const absl::Status memlock = rdma::CheckMemlock(
        verbs, pinned, absl::StrCat("a ", RoleName(o.role), " with ", peers, " peer(s)"));
    if (memlock.ok()) {
      r.Ok(absl::StrCat("RLIMIT_MEMLOCK ", rdma::FormatBytes(limit), " (the control blocks of ",
                        peers, " peer(s) pin ", rdma::FormatBytes(pinned),
                        ", host tensors and staging come on top)"));
    } else {
      r.Fail(std::string(memlock.message()));
    }
  }
  switch (verbs.IsForkInitialized()) {
    case IBV_FORK_UNNEEDED:
      r.Ok("fork: the kernel copies pinned pages on fork; ibv_fork_init is skipped");
      break;
    default:
      r.Info(absl::StrCat("fork: ibv_fork_init is needed on this kernel",
                          o.rdma.fork_init == "off"
                              ? " but STEPMESH_RDMA_FORK_INIT=off skips it: nothing may fork "
                                "while registered memory is in use"
                              : "; every registration is madvise(DONTFORK)ed (many small "
                                "registrations can exhaust vm.max_map_count)"));
      break;
  }
  const bool peermem = Exists(in.sysfs_root + "/module/nvidia_peermem") ||
                       Exists(in.sysfs_root + "/module/nv_peer_mem");
  r.Info(absl::StrCat("peer memory kernel module (nvidia_peermem): ",
                      peermem ? "loaded" : "not loaded"));
  if (usable_transport == 0) {
    r.Missing(in.need_rdma, "no InfiniBand/RoCE device: only iWARP (no immediate data)");
    return;
  }
  // One entry per GPU, or the host's choice without one.
  std::vector<Gpu> targets = gpus;
  if (targets.empty()) targets.push_back(Gpu{-1, ""});
  std::vector<std::string> chosen;
  for (const Gpu& gpu : targets) {
    MeshOptions options = o;
    options.rdma.gpu_pci_bus_id = gpu.bus_id;
    options.rdma.sysfs_root = in.sysfs_root;
    const std::string who = gpu.index < 0 ? std::string("host memory")
                                          : absl::StrCat("GPU ", gpu.index, " (", gpu.bus_id, ")");
    absl::StatusOr<rdma::PortChoice> port = rdma::OpenPort(verbs, options);
    if (!port.ok()) {
      r.Missing(in.need_rdma, absl::StrCat(who, ": ", port.status().message()));
      continue;
    }
    r.Ok(absl::StrCat(who, " -> ", port->device_name, " port ", int{port->port},
                      port->nic_pci.empty() ? "" : absl::StrCat(" (PCI ", port->nic_pci, ")"), ": ",
                      port->why));
    chosen.push_back(port->device_name);
    if (!gpu.bus_id.empty()) {
      const rdma::PciPlacement where = rdma::PlaceNic(in.sysfs_root, port->device_name, gpu.bus_id);
      if (where.affinity == rdma::PciAffinity::kOtherNode) {
        r.Warn(absl::StrCat(who,
                            ": the nearest usable NIC is on another socket; GPUDirect "
                            "traffic crosses the inter-socket link"));
      } else if (where.affinity == rdma::PciAffinity::kUnknown) {
        r.Warn(absl::StrCat(who, ": no PCI placement in ", in.sysfs_root,
                            " (NIC or GPU not found): the NIC was not chosen by topology"));
      }
    }
    r.Info(absl::StrCat("port: ", port->roce() ? "Ethernet (RoCE)" : "InfiniBand", ", active MTU ",
                        MtuBytes(port->active_mtu),
                        port->roce() ? "" : absl::StrCat(", LID ", port->lid),
                        o.rdma.path_mtu > 0 ? absl::StrCat(", capped at ", o.rdma.path_mtu) : ""));
    const std::string interface = InterfaceOf(port->gid);
    r.Info(absl::StrCat("GID index ", port->gid_index, ": ", GidText(port->gid), " (",
                        rdma::GidTypeName(port->gid_type), ")",
                        interface.empty() ? "" : absl::StrCat(", on ", interface)));
    if (port->roce() && interface.empty()) {
      r.Warn(absl::StrCat(who, ": GID ", GidText(port->gid),
                          " is no address of this host's interfaces (off the fabric? set "
                          "STEPMESH_RDMA_INTERFACE or STEPMESH_RDMA_GID_INDEX)"));
    }
    r.Info(absl::StrCat("traffic class ", o.rdma.traffic_class, " (DSCP ",
                        o.rdma.traffic_class >> 2, "), service level ", o.rdma.service_level,
                        port->pkey != 0 ? absl::StrCat(", P_Key 0x", absl::Hex(port->pkey),
                                                       " at index ", port->pkey_index)
                                        : ""));
    if (port->roce() && o.rdma.traffic_class == 0) {
      r.Info(
          "traffic class 0 is the lossy class on DSCP-trust fabrics; set "
          "STEPMESH_RDMA_DSCP to the lossless one (e.g. 26, traffic class 104)");
    }
    if (gpu.index >= 0) ProbeGpuDirect(in, gpu, *port, r);
  }
  std::sort(chosen.begin(), chosen.end());
  if (gpus.size() > 1 && std::unique(chosen.begin(), chosen.end()) - chosen.begin() == 1) {
    r.Warn(absl::StrCat("every GPU uses ", chosen.front(), ": all ranks share one port"));
  }
}
#endif  // STEPMESH_HAVE_RDMA

}  // namespace

DoctorReport RunDoctor(const DoctorInputs& in) {
  Report r;
  r.Title(absl::StrCat("stepmesh doctor: transport ", in.options.transport, ", GPUDirect ",
                       GpuDirectName(in.options.rdma.gpudirect)));
  std::vector<Gpu> gpus;
  r.Title("GPUs");
#ifdef STEPMESH_HAVE_CUDA
  if (in.cuda != nullptr) {
    gpus = CheckGpus(in, r);
  } else {
    r.Missing(in.need_gpu, "no GPU: no CUDA API given");
  }
#else
  r.Missing(in.need_gpu, "no GPU: this build of stepmesh has no CUDA backend");
#endif
#ifdef STEPMESH_HAVE_RDMA
  if (in.verbs != nullptr) {
    CheckRdma(in, gpus, r);
  } else {
    r.Missing(in.need_rdma, "no RDMA device: no verbs API given");
  }
#else
  r.Title("RDMA");
  r.Missing(in.need_rdma, "no RDMA device: this build of stepmesh has no RDMA transport");
#endif
  DoctorReport out = r.Take();
  absl::StrAppend(&out.text, out.failures == 0 ? "verdict: ready" : "verdict: a run would FAIL",
                  " (", out.failures, " failure(s), ", out.warnings, " warning(s))\n");
  return out;
}

}  // namespace stepmesh::doctor
