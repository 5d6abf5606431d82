#include "tests/libfabric/hmem_fabric.h"

#include <rdma/fi_errno.h>

namespace stepmesh::testing {

namespace {
HmemFabric* active = nullptr;  // the entry points' instance (one at a time)
}  // namespace

HmemFabric::HmemFabric(const libfabric::FabricApi& real, bool advertise)
    : real_(real), advertise_(advertise), api_(real) {
  api_.getinfo = &HmemFabric::GetInfo;
  api_.fabric = &HmemFabric::Fabric;
  active = this;
}

HmemFabric::~HmemFabric() { active = nullptr; }

std::vector<HmemRegistration> HmemFabric::registrations() {
  base::MutexLock lock(&mu_);
  return registrations_;
}

int HmemFabric::GetInfo(uint32_t version, const char* node, const char* service, uint64_t flags,
                        const fi_info* hints, fi_info** info) {
  const bool wants_hmem = hints != nullptr && (hints->caps & FI_HMEM) != 0;
  if (wants_hmem && !active->advertise_) return -FI_ENODATA;  // as tcp answers
  // Advertised: the real provider's own answer (shm has FI_HMEM).
  return active->real_.getinfo(version, node, service, flags, hints, info);
}

namespace {

// Points `*table` at `copy`: the real table (kept in `real`, taken the first
// time) with one entry replaced by `override_entry`.
template <typename Ops>
void Interpose(Ops*& table, Ops*& real, Ops& copy, void (*override_entry)(Ops&)) {
  if (real == nullptr) {
    real = table;
    copy = *table;
    override_entry(copy);
  }
  table = &copy;
}

}  // namespace

int HmemFabric::Fabric(fi_fabric_attr* attr, fid_fabric** fabric, void* context) {
  const int rc = active->real_.fabric(attr, fabric, context);
  if (rc != 0) return rc;
  base::MutexLock lock(&active->mu_);
  Interpose<fi_ops_fabric>((*fabric)->ops, active->real_fabric_ops_, active->fabric_ops_,
                           [](fi_ops_fabric& ops) { ops.domain = &HmemFabric::Domain; });
  return 0;
}

int HmemFabric::Domain(fid_fabric* fabric, fi_info* info, fid_domain** domain, void* context) {
  const int rc = active->real_fabric_ops_->domain(fabric, info, domain, context);
  if (rc != 0) return rc;
  base::MutexLock lock(&active->mu_);
  Interpose<fi_ops_mr>((*domain)->mr, active->real_mr_ops_, active->mr_ops_,
                       [](fi_ops_mr& ops) { ops.regattr = &HmemFabric::RegAttr; });
  return 0;
}

int HmemFabric::RegAttr(fid* fid, const fi_mr_attr* attr, uint64_t flags, fid_mr** mr) {
  HmemRegistration r;
  r.iface = attr->iface;
  r.cuda_device = attr->iface == FI_HMEM_CUDA ? attr->device.cuda : -1;
  r.access = attr->access;
  r.bytes = attr->iov_count > 0 ? attr->mr_iov[0].iov_len : 0;
  {
    base::MutexLock lock(&active->mu_);
    active->registrations_.push_back(r);
  }
  if (attr->iface == FI_HMEM_SYSTEM) return active->real_mr_ops_->regattr(fid, attr, flags, mr);
  if (attr->iface != FI_HMEM_CUDA || !active->advertise_) return -FI_ENOSYS;
  fi_mr_attr host = *attr;  // the "device" memory is host memory here
  host.iface = FI_HMEM_SYSTEM;
  host.device.reserved = 0;
  return active->real_mr_ops_->regattr(fid, &host, flags, mr);
}

}  // namespace stepmesh::testing
