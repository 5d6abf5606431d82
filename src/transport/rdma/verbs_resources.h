#pragma once
// RAII owners for verbs objects (every one is released through the VerbsApi
// that made it), plus device/port/GID selection.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/base/logging.h"
#include "src/transport/rdma/verbs_api.h"
#include "stepmesh/options.h"

namespace stepmesh::rdma {

// Owns one verbs object; the VerbsApi must outlive it (the transport keeps the
// shared_ptr as its first member).
template <typename T, int (VerbsApi::*kRelease)(T*)>
class VerbsHandle {
 public:
  VerbsHandle() = default;
  VerbsHandle(VerbsApi* api, T* object) : api_(api), object_(object) {}
  VerbsHandle(VerbsHandle&& other) noexcept
      : api_(other.api_), object_(std::exchange(other.object_, nullptr)) {}
  VerbsHandle& operator=(VerbsHandle&& other) noexcept {
    if (this != &other) {
      Reset();
      api_ = other.api_;
      object_ = std::exchange(other.object_, nullptr);
    }
    return *this;
  }
  VerbsHandle(const VerbsHandle&) = delete;
  VerbsHandle& operator=(const VerbsHandle&) = delete;
  ~VerbsHandle() { Reset(); }

  T* get() const { return object_; }
  T* operator->() const { return object_; }
  explicit operator bool() const { return object_ != nullptr; }
  void Reset() {
    if (object_ == nullptr) return;
    if (const int rc = (api_->*kRelease)(std::exchange(object_, nullptr)); rc != 0) {
      STEPMESH_LOG(kWarning, "rdma: releasing a verbs object failed (", rc, ")");
    }
  }

 private:
  VerbsApi* api_ = nullptr;
  T* object_ = nullptr;
};

using ContextHandle = VerbsHandle<ibv_context, &VerbsApi::CloseDevice>;
using PdHandle = VerbsHandle<ibv_pd, &VerbsApi::DeallocPd>;
using MrHandle = VerbsHandle<ibv_mr, &VerbsApi::DeregMr>;
using CqHandle = VerbsHandle<ibv_cq, &VerbsApi::DestroyCq>;
using ChannelHandle = VerbsHandle<ibv_comp_channel, &VerbsApi::DestroyCompChannel>;
using QpHandle = VerbsHandle<ibv_qp, &VerbsApi::DestroyQp>;

// The port and GID a transport uses.
struct PortChoice {
  ContextHandle context;
  std::string device_name;
  uint8_t port = 1;
  int gid_index = 0;
  ibv_gid gid{};
  ibv_mtu active_mtu = IBV_MTU_1024;
  uint8_t link_layer = IBV_LINK_LAYER_ETHERNET;
  uint16_t lid = 0;                         // InfiniBand: the port's LID, which peers address it by
  uint64_t max_msg_sz = uint64_t{1} << 30;  // the longest message one WR may carry
  ibv_gid_type gid_type = IBV_GID_TYPE_ROCE_V2;  // of the chosen GID (IB on InfiniBand)
  std::string nic_pci;                           // the NIC's PCI address, when sysfs knows it
  std::string why;                               // why this device (for logs and the doctor)
  uint16_t pkey_index = 0;                       // P_Key table entry the QPs use
  uint16_t pkey = 0;                             // its value (0: not looked up)
  bool roce() const { return link_layer != IBV_LINK_LAYER_INFINIBAND; }
};

// Opens the NIC named by options.rdma.device (a name or a comma-separated list;
// empty: every NIC), choosing the best: an active port with a RoCE v2
// IPv4-mapped GID first, then RoCE v2, then IB; among equals the one nearest
// options.rdma.gpu_pci_bus_id on the PCI tree (sysfs under
// options.rdma.sysfs_root, pci_topology.h). options.rdma.port / gid_index override.
// Never chosen: devices whose transport is not InfiniBand/RoCE (iWARP: no
// immediate data), link-local (fe80::/10) RoCE v2 GIDs (not routable), and
// with options.rdma.interface, RoCE GIDs outside that interface's subnets.
// With options.rdma.pkey set, the port's P_Key table must hold that partition
// (FAILED_PRECONDITION naming STEPMESH_RDMA_PKEY and the table otherwise).
absl::StatusOr<PortChoice> OpenPort(VerbsApi& verbs, const MeshOptions& options);

// "RoCE v2", "RoCE v1", "IB".
const char* GidTypeName(ibv_gid_type type);

// An IP subnet a RoCE GID must fall into (IPv4 as ::ffff:a.b.c.d).
struct GidSubnet {
  ibv_gid prefix{};
  int bits = 0;  // of the 128
  bool Contains(const ibv_gid& gid) const;
};
// "10.0.0.0/24", "2001:db8::/64", or a network interface's name (its
// addresses and netmasks, from getifaddrs).
absl::StatusOr<std::vector<GidSubnet>> ResolveInterface(const std::string& interface);

// RLIMIT_MEMLOCK, which every registration of host memory is charged against.
// MemlockAdvice: "; RLIMIT_MEMLOCK (ulimit -l) is 64 KiB: raise it ...", for
// appending to an ENOMEM. CheckMemlock: FAILED_PRECONDITION naming the limit
// when it is below `needed` bytes (`what` says what needs them).
std::string MemlockAdvice(VerbsApi& verbs);
absl::Status CheckMemlock(VerbsApi& verbs, uint64_t needed, const std::string& what);
std::string FormatBytes(uint64_t bytes);

std::string GidToString(const ibv_gid& gid);
absl::StatusOr<ibv_gid> GidFromString(std::string_view text);
// ibv_wc_status_str, without calling into libibverbs.
const char* WcStatusName(ibv_wc_status status);

}  // namespace stepmesh::rdma
