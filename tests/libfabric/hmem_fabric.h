#pragma once
// libfabric behind the FabricApi seam with FI_HMEM as a test chooses: a
// provider that advertises FI_HMEM (EFA or shm built with CUDA) or one that
// does not (tcp, or shm without CUDA). It sits in front of this machine's
// real providers and changes only the FI_HMEM part, as a real provider has it:
//   * fi_getinfo with FI_HMEM in the hints: -FI_ENODATA unless advertised,
//     else the real provider's answer (shm 1.17 has FI_HMEM; use shm);
//   * fi_mr_regattr with iface FI_HMEM_CUDA: -FI_ENOSYS unless advertised,
//     else recorded and registered -- on the host memory that stands in for
//     the device's here (CI has no GPU), as FI_HMEM_SYSTEM.
// Every registration's attributes are recorded, so a test can check what the
// transport asked for. One instance at a time (the entry points are plain C
// functions).

#include <cstdint>
#include <vector>

#include "src/base/sync.h"
#include "src/transport/libfabric/fabric_endpoint.h"

namespace stepmesh::testing {

struct HmemRegistration {
  fi_hmem_iface iface = FI_HMEM_SYSTEM;
  int cuda_device = -1;  // iface FI_HMEM_CUDA only
  uint64_t access = 0;
  size_t bytes = 0;
};

class HmemFabric {
 public:
  HmemFabric(const libfabric::FabricApi& real, bool advertise);
  ~HmemFabric();
  HmemFabric(const HmemFabric&) = delete;
  HmemFabric& operator=(const HmemFabric&) = delete;

  const libfabric::FabricApi& api() const { return api_; }
  std::vector<HmemRegistration> registrations();

 private:
  static int GetInfo(uint32_t version, const char* node, const char* service, uint64_t flags,
                     const fi_info* hints, fi_info** info);
  static int Fabric(fi_fabric_attr* attr, fid_fabric** fabric, void* context);
  static int Domain(fid_fabric* fabric, fi_info* info, fid_domain** domain, void* context);
  static int RegAttr(fid* fid, const fi_mr_attr* attr, uint64_t flags, fid_mr** mr);

  const libfabric::FabricApi& real_;
  const bool advertise_;
  libfabric::FabricApi api_;
  base::Mutex mu_;
  // The provider's own ops (one provider per test), and ours in front of them.
  fi_ops_fabric* real_fabric_ops_ = nullptr;
  fi_ops_fabric fabric_ops_{};
  fi_ops_mr* real_mr_ops_ = nullptr;
  fi_ops_mr mr_ops_{};
  std::vector<HmemRegistration> registrations_;
};

}  // namespace stepmesh::testing
