#pragma once
// Phase 1 of the libfabric transport: loading libfabric, choosing a provider
// that has what the transport needs (an RDM endpoint, RMA writes, remote CQ
// data), and opening fabric, domain, address vector, completion queues and
// endpoint. Every libfabric object lives in a FidHandle (closed exactly once,
// in reverse order of opening).
//
// libfabric is loaded at run time (dlopen of libfabric.so.1): only five entry
// points are real symbols (FabricApi below); everything else is an inline
// call through the objects' ops tables. A machine without libfabric loads and
// runs stepmesh unchanged and gets a clear error only when it selects this
// transport.

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace stepmesh::libfabric {

// The exported entry points of libfabric.so.1.
struct FabricApi {
  int (*getinfo)(uint32_t version, const char* node, const char* service, uint64_t flags,
                 const fi_info* hints, fi_info** info) = nullptr;
  void (*freeinfo)(fi_info* info) = nullptr;
  fi_info* (*dupinfo)(const fi_info* info) = nullptr;
  int (*fabric)(fi_fabric_attr* attr, fid_fabric** fabric, void* context) = nullptr;
  const char* (*strerror)(int errnum) = nullptr;
};

// Loads libfabric once per process; an error says why (not installed).
absl::StatusOr<const FabricApi*> LoadFabricApi();

// Any libfabric object (`T` has a `fid` member), closed with fi_close.
template <typename T>
class FidHandle {
 public:
  FidHandle() = default;
  explicit FidHandle(T* p) : p_(p) {}
  FidHandle(FidHandle&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  FidHandle& operator=(FidHandle&& o) noexcept {
    if (this != &o) {
      Reset();
      p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  FidHandle(const FidHandle&) = delete;
  FidHandle& operator=(const FidHandle&) = delete;
  ~FidHandle() { Reset(); }
  void Reset() {
    if (p_ != nullptr) (void)fi_close(&std::exchange(p_, nullptr)->fid);
  }
  T* get() const { return p_; }
  T** out() {
    Reset();
    return &p_;
  }

 private:
  T* p_ = nullptr;
};

// The most rails (NICs) one transport drives: p5.48xlarge has 32 EFA devices.
inline constexpr int kMaxRails = 32;

struct EndpointConfig {
  std::string provider;  // "tcp", "shm", "efa", "tcp;ofi_rxm"; empty: the first that fits
  std::string host;      // the address a network provider binds (bind_host)
  // Rails to open: 0 one per NIC (distinct domain) the provider lists; N
  // more than it lists: the NICs again, round-robin (each rail still its own
  // fabric, domain, MRs, CQs and endpoint).
  int nics = 1;
  // Ask for a file-descriptor wait object on the receive CQ (blocking
  // progress); a provider without one (shm) gets FI_WAIT_NONE: wait_fd() -1.
  bool wait_fd = false;
  // Ask for FI_HMEM (device memory registered in place, FI_MR_HMEM); a
  // provider without it is opened without: hmem() false, device tensors are
  // staged through pinned host memory by the core.
  bool hmem = false;
};

// One rail: a NIC's fabric, domain, address vector, CQs and endpoint.
class FabricEndpoint {
 public:
  // Chooses the provider and opens one rail per NIC asked for; errors name
  // the provider and the capability it lacks (RMA, remote CQ data, ...), or
  // list the providers this machine has when the name is unknown.
  static absl::StatusOr<std::vector<std::unique_ptr<FabricEndpoint>>> OpenRails(
      const FabricApi& api, const EndpointConfig& config);
  // The first rail only.
  static absl::StatusOr<std::unique_ptr<FabricEndpoint>> Open(const FabricApi& api,
                                                              const EndpointConfig& config);
  ~FabricEndpoint();

  int rail() const { return rail_; }
  // The NIC: the domain's name ("rdmap16s27-rdm", "lo", "shm").
  const std::string& domain_name() const { return domain_name_; }
  // The receive CQ's wait fd (fi_control FI_GETWAIT), -1 without one.
  int wait_fd() const { return wait_fd_; }
  fid_fabric* fabric() const { return fabric_.get(); }
  const std::string& provider() const { return provider_; }
  // fi_getname: this endpoint's address, raw bytes (published hex-encoded).
  const std::string& address() const { return address_; }
  fid_ep* ep() const { return ep_.get(); }
  fid_domain* domain() const { return domain_.get(); }
  fid_cq* tx_cq() const { return tx_cq_.get(); }
  fid_cq* rx_cq() const { return rx_cq_.get(); }
  // Remote addresses are virtual addresses (FI_MR_VIRT_ADDR), else offsets
  // into the MR; keys are the provider's (FI_MR_PROV_KEY), else ours.
  bool virt_addr() const { return virt_addr_; }
  bool prov_key() const { return prov_key_; }
  size_t max_msg_size() const { return max_msg_size_; }
  size_t cq_data_size() const { return cq_data_size_; }
  bool hmem() const { return hmem_; }

  // The fi_addr_t of a peer's raw address (inserted once, then cached).
  absl::StatusOr<fi_addr_t> Resolve(const std::string& raw);
  // "<provider>: <what> failed: <fi_strerror>" (naming the rail when there
  // are several).
  std::string Error(absl::string_view what, int rc) const;
  // "rail 1 (lo)".
  std::string Name() const;

 private:
  explicit FabricEndpoint(const FabricApi& api) : api_(api) {}
  absl::Status OpenOn(const fi_info* info, bool wait_fd);

  const FabricApi& api_;
  int rail_ = 0;
  int rails_ = 1;
  int wait_fd_ = -1;
  std::string domain_name_;
  std::string provider_;
  std::string address_;
  bool virt_addr_ = false;
  bool prov_key_ = false;
  bool hmem_ = false;
  size_t max_msg_size_ = 0;
  size_t cq_data_size_ = 0;
  fi_info* info_ = nullptr;  // freed last
  FidHandle<fid_fabric> fabric_;
  FidHandle<fid_domain> domain_;
  FidHandle<fid_av> av_;
  FidHandle<fid_cq> tx_cq_;
  FidHandle<fid_cq> rx_cq_;
  FidHandle<fid_ep> ep_;
  absl::flat_hash_map<std::string, fi_addr_t> av_cache_;  // under the caller's lock
};

// Hex of raw bytes, and back (an error for anything else).
std::string HexEncode(absl::string_view raw);
absl::StatusOr<std::string> HexDecode(absl::string_view hex);

}  // namespace stepmesh::libfabric
