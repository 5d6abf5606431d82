#include "src/transport/libfabric/fabric_endpoint.h"

#include <dlfcn.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "stepmesh/status.h"

namespace stepmesh::libfabric {
namespace {

constexpr uint32_t kApiVersion = FI_VERSION(1, 9);

template <typename F>
bool Bind(void* lib, const char* name, F*& out) {
  out = reinterpret_cast<F*>(::dlsym(lib, name));
  return out != nullptr;
}

// fi_info lists from fi_getinfo, freed with fi_freeinfo.
class InfoList {
 public:
  explicit InfoList(const FabricApi& api) : api_(api) {}
  ~InfoList() {
    if (p_ != nullptr) api_.freeinfo(p_);
  }
  InfoList(const InfoList&) = delete;
  InfoList& operator=(const InfoList&) = delete;
  fi_info** out() { return &p_; }
  fi_info* get() const { return p_; }
  fi_info* release() { return std::exchange(p_, nullptr); }

 private:
  const FabricApi& api_;
  fi_info* p_ = nullptr;
};

// Every provider name this machine's libfabric offers (for error messages).
std::string ProviderList(const FabricApi& api) {
  InfoList all(api);
  if (api.getinfo(kApiVersion, nullptr, nullptr, 0, nullptr, all.out()) != 0) return "none";
  std::set<std::string> names;
  for (const fi_info* i = all.get(); i != nullptr; i = i->next) {
    if (i->fabric_attr != nullptr && i->fabric_attr->prov_name != nullptr) {
      names.insert(i->fabric_attr->prov_name);
    }
  }
  return names.empty() ? "none" : absl::StrJoin(names, ", ");
}

}  // namespace

absl::StatusOr<const FabricApi*> LoadFabricApi() {
  static const absl::StatusOr<const FabricApi*> loaded = []() -> absl::StatusOr<const FabricApi*> {
    void* lib = ::dlopen("libfabric.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("libfabric: cannot load libfabric.so.1 (", ::dlerror(),
                       "); install libfabric1 (scripts/install-deps.sh)"));
    }
    static FabricApi api;
    if (!Bind(lib, "fi_getinfo", api.getinfo) || !Bind(lib, "fi_freeinfo", api.freeinfo) ||
        !Bind(lib, "fi_dupinfo", api.dupinfo) || !Bind(lib, "fi_fabric", api.fabric) ||
        !Bind(lib, "fi_strerror", api.strerror)) {
      return absl::UnavailableError("libfabric: libfabric.so.1 lacks fi_getinfo/fi_fabric");
    }
    return &api;
  }();
  return loaded;
}

std::string FabricEndpoint::Error(absl::string_view what, int rc) const {
  return absl::StrCat("libfabric ", provider_, rails_ > 1 ? absl::StrCat(" ", Name()) : "", ": ",
                      what, " failed: ", api_.strerror(-rc), " (", rc, ")");
}

std::string FabricEndpoint::Name() const {
  return absl::StrCat("rail ", rail_, " (", domain_name_, ")");
}

absl::StatusOr<std::vector<std::unique_ptr<FabricEndpoint>>> FabricEndpoint::OpenRails(
    const FabricApi& api, const EndpointConfig& config) {
  const std::string& want = config.provider;
  const std::string shown = want.empty() ? "(any)" : want;
  const bool local_only = absl::StartsWith(want, "shm");
  const char* node = (local_only || config.host.empty()) ? nullptr : config.host.c_str();
  const uint64_t flags = node != nullptr ? FI_SOURCE : 0;

  InfoList hints_holder(api);
  fi_info* hints = api.dupinfo(nullptr);
  *hints_holder.out() = hints;
  if (hints == nullptr) return absl::ResourceExhaustedError("libfabric: fi_allocinfo failed");
  hints->ep_attr->type = FI_EP_RDM;
  if (!want.empty()) hints->fabric_attr->prov_name = ::strdup(want.c_str());

  // Step by step, so that the error names what is missing.
  {
    InfoList found(api);
    const int rc = api.getinfo(kApiVersion, node, nullptr, flags, hints, found.out());
    if (rc != 0 || found.get() == nullptr) {
      return absl::NotFoundError(absl::StrCat(
          "libfabric: no provider '", shown, "' with a reliable-datagram endpoint (FI_EP_RDM)",
          node != nullptr ? absl::StrCat(" on ", node) : "", " (", api.strerror(-rc),
          "); providers on this machine: ", ProviderList(api)));
    }
  }
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
  {
    InfoList found(api);
    const int rc = api.getinfo(kApiVersion, node, nullptr, flags, hints, found.out());
    if (rc != 0 || found.get() == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("libfabric: provider '", shown,
                       "' lacks FI_RMA (one-sided writes), which this transport needs"));
    }
  }
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->domain_attr->threading = FI_THREAD_SAFE;
  InfoList found(api);
  int rc = -FI_ENODATA;
  if (config.hmem) {
    // Device memory in place where the provider can (EFA with CUDA, shm);
    // tcp has no FI_HMEM and is opened without it.
    hints->caps |= FI_HMEM;
    hints->domain_attr->mr_mode |= FI_MR_HMEM;
    rc = api.getinfo(kApiVersion, node, nullptr, flags, hints, found.out());
    hints->caps &= ~FI_HMEM;
    hints->domain_attr->mr_mode &= ~FI_MR_HMEM;
  }
  if (rc != 0 || found.get() == nullptr) {
    rc = api.getinfo(kApiVersion, node, nullptr, flags, hints, found.out());
  }
  if (rc != 0 || found.get() == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "libfabric: provider '", shown,
        "' has RMA but not with a thread-safe domain and the memory-registration modes this "
        "transport handles (FI_MR_LOCAL|VIRT_ADDR|ALLOCATED|PROV_KEY)"));
  }
  // The NICs: the first entry of each distinct domain that has enough CQ
  // data, all of the first such entry's provider (one provider per transport).
  std::vector<const fi_info*> nics;
  std::set<std::string> domains;
  size_t best_cq_data = 0;
  for (const fi_info* i = found.get(); i != nullptr; i = i->next) {
    best_cq_data = std::max(best_cq_data, i->domain_attr->cq_data_size);
    if (i->domain_attr->cq_data_size < 4) continue;
    if (!nics.empty() &&
        std::strcmp(i->fabric_attr->prov_name, nics[0]->fabric_attr->prov_name) != 0) {
      continue;
    }
    const std::string domain = i->domain_attr->name != nullptr ? i->domain_attr->name : "";
    if (domains.insert(domain).second) nics.push_back(i);
  }
  if (nics.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "libfabric: provider '", shown, "' lacks remote CQ data (FI_REMOTE_CQ_DATA: cq_data_size ",
        best_cq_data, " < 4 bytes), which counts a frame's writes"));
  }
  const int rails = config.nics <= 0 ? static_cast<int>(std::min<size_t>(nics.size(), kMaxRails))
                                     : std::min(config.nics, kMaxRails);
  std::vector<std::unique_ptr<FabricEndpoint>> out;
  for (int r = 0; r < rails; ++r) {
    std::unique_ptr<FabricEndpoint> e(new FabricEndpoint(api));
    e->rail_ = r;
    e->rails_ = rails;
    STEPMESH_RETURN_IF_ERROR(e->OpenOn(nics[r % nics.size()], config.wait_fd));
    out.push_back(std::move(e));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<FabricEndpoint>> FabricEndpoint::Open(const FabricApi& api,
                                                                     const EndpointConfig& config) {
  EndpointConfig one = config;
  one.nics = 1;
  STEPMESH_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<FabricEndpoint>> rails,
                            OpenRails(api, one));
  return std::move(rails.front());
}

absl::Status FabricEndpoint::OpenOn(const fi_info* chosen, bool wait_fd) {
  info_ = api_.dupinfo(chosen);
  if (info_ == nullptr) return absl::ResourceExhaustedError("libfabric: fi_dupinfo failed");
  provider_ = info_->fabric_attr->prov_name;
  domain_name_ = info_->domain_attr->name != nullptr ? info_->domain_attr->name : "";
  virt_addr_ = (info_->domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0;
  prov_key_ = (info_->domain_attr->mr_mode & FI_MR_PROV_KEY) != 0;
  hmem_ = (info_->caps & FI_HMEM) != 0;
  max_msg_size_ = info_->ep_attr->max_msg_size;
  cq_data_size_ = info_->domain_attr->cq_data_size;

  int rc;
  if ((rc = api_.fabric(info_->fabric_attr, fabric_.out(), nullptr)) != 0) {
    return absl::UnavailableError(Error("fi_fabric", rc));
  }
  if ((rc = fi_domain(fabric_.get(), info_, domain_.out(), nullptr)) != 0) {
    return absl::UnavailableError(Error("fi_domain", rc));
  }
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  if ((rc = fi_av_open(domain_.get(), &av_attr, av_.out(), nullptr)) != 0) {
    return absl::UnavailableError(Error("fi_av_open", rc));
  }
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.wait_obj = FI_WAIT_NONE;
  if ((rc = fi_cq_open(domain_.get(), &cq_attr, tx_cq_.out(), nullptr)) != 0) {
    return absl::UnavailableError(Error("fi_cq_open", rc));
  }
  if (wait_fd) {
    // Blocking progress where the provider has a wait object (tcp: its
    // progress epoll); shm has none (-FI_ENOSYS) and is polled instead.
    fi_cq_attr waitable = cq_attr;
    waitable.wait_obj = FI_WAIT_FD;
    int fd = -1;
    if (fi_cq_open(domain_.get(), &waitable, rx_cq_.out(), nullptr) == 0 &&
        fi_control(&rx_cq_.get()->fid, FI_GETWAIT, &fd) == 0 && fd >= 0) {
      wait_fd_ = fd;
    } else {
      rx_cq_.Reset();
    }
  }
  if (rx_cq_.get() == nullptr &&
      (rc = fi_cq_open(domain_.get(), &cq_attr, rx_cq_.out(), nullptr)) != 0) {
    return absl::UnavailableError(Error("fi_cq_open", rc));
  }
  if ((rc = fi_endpoint(domain_.get(), info_, ep_.out(), nullptr)) != 0) {
    return absl::UnavailableError(Error("fi_endpoint", rc));
  }
  if ((rc = fi_ep_bind(ep_.get(), &av_.get()->fid, 0)) != 0 ||
      (rc = fi_ep_bind(ep_.get(), &tx_cq_.get()->fid, FI_TRANSMIT)) != 0 ||
      (rc = fi_ep_bind(ep_.get(), &rx_cq_.get()->fid, FI_RECV)) != 0) {
    return absl::UnavailableError(Error("fi_ep_bind", rc));
  }
  if ((rc = fi_enable(ep_.get())) != 0) return absl::UnavailableError(Error("fi_enable", rc));
  std::string name(256, '\0');
  size_t len = name.size();
  if ((rc = fi_getname(&ep_.get()->fid, name.data(), &len)) != 0) {
    return absl::UnavailableError(Error("fi_getname", rc));
  }
  name.resize(len);
  address_ = std::move(name);
  return absl::OkStatus();
}

FabricEndpoint::~FabricEndpoint() {
  ep_.Reset();
  rx_cq_.Reset();
  tx_cq_.Reset();
  av_.Reset();
  domain_.Reset();
  fabric_.Reset();
  if (info_ != nullptr) api_.freeinfo(info_);
}

absl::StatusOr<fi_addr_t> FabricEndpoint::Resolve(const std::string& raw) {
  auto it = av_cache_.find(raw);
  if (it != av_cache_.end()) return it->second;
  fi_addr_t addr = FI_ADDR_UNSPEC;
  const int rc = fi_av_insert(av_.get(), raw.data(), 1, &addr, 0, nullptr);
  if (rc != 1) return absl::UnavailableError(Error("fi_av_insert", rc < 0 ? rc : -FI_EINVAL));
  av_cache_.emplace(raw, addr);
  return addr;
}

std::string HexEncode(absl::string_view raw) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(raw.size() * 2);
  for (unsigned char c : raw) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

absl::StatusOr<std::string> HexDecode(absl::string_view hex) {
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  if (hex.size() % 2 != 0 || hex.empty()) {
    return absl::InvalidArgumentError("libfabric: a fabric address is not hex");
  }
  std::string out;
  out.reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = digit(hex[i]), lo = digit(hex[i + 1]);
    if (hi < 0 || lo < 0)
      return absl::InvalidArgumentError("libfabric: a fabric address is not hex");
    out.push_back(static_cast<char>(hi << 4 | lo));
  }
  return out;
}

}  // namespace stepmesh::libfabric
