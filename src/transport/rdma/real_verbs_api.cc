// RealVerbsApi: each method is the libibverbs call of the same name, from
// libibverbs.so.1 opened with dlopen when the API is made (never linked: the
// NEEDED entries of libstepmesh.so name no rdma-core library, checked by the
// ctest rdma_verbs_loaded_at_run_time). verbs.h makes some calls static inline
// functions through the context's ops (ibv_post_send, ibv_post_recv,
// ibv_poll_cq, ibv_req_notify_cq): those are called as they are, needing no
// symbol. Others are inline wrappers around an exported entry point
// (ibv_query_port, ibv_query_gid_ex, ibv_reg_mr): their body is repeated here
// over the resolved one. The mlx5 LAG calls come from libmlx5, opened on first
// use.

#include <dlfcn.h>
#include <endian.h>
#include <infiniband/mlx5dv.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/transport/rdma/verbs_api.h"
#include "stepmesh/status.h"

namespace stepmesh::rdma {
namespace {

// The mlx5 direct-verbs entry points the LAG calls need; null where missing.
// Opened by the first LAG call of a RealVerbsApi, closed with it.
class Mlx5Calls {
 public:
  Mlx5Calls() = default;
  Mlx5Calls(const Mlx5Calls&) = delete;
  Mlx5Calls& operator=(const Mlx5Calls&) = delete;
  ~Mlx5Calls() {
    if (library_ != nullptr) ::dlclose(library_);
  }

  // The calls, if `context` is an mlx5 device and libmlx5 has them.
  const Mlx5Calls* For(ibv_context* context) {
    std::call_once(once_, [this] { Open(); });
    if (is_supported == nullptr || context == nullptr || !is_supported(context->device)) {
      return nullptr;
    }
    return this;
  }

  bool (*is_supported)(ibv_device*) = nullptr;
  int (*query_device)(ibv_context*, mlx5dv_context*) = nullptr;
  int (*modify_qp_lag_port)(ibv_qp*, uint8_t) = nullptr;
  int (*query_qp_lag_port)(ibv_qp*, uint8_t*, uint8_t*) = nullptr;

 private:
  template <typename Fn>
  void Resolve(Fn*& fn, const char* name) {
    fn = reinterpret_cast<Fn*>(::dlsym(library_, name));
  }
  void Open() {
    library_ = ::dlopen("libmlx5.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library_ == nullptr) return;
    Resolve(is_supported, "mlx5dv_is_supported");
    Resolve(query_device, "mlx5dv_query_device");
    Resolve(modify_qp_lag_port, "mlx5dv_modify_qp_lag_port");
    Resolve(query_qp_lag_port, "mlx5dv_query_qp_lag_port");
  }

  std::once_flag once_;
  void* library_ = nullptr;
};

// The exported libibverbs entry points RealVerbsApi calls.
struct VerbsCalls {
  int (*fork_init)() = nullptr;
  ibv_fork_status (*is_fork_initialized)() = nullptr;
  ibv_device** (*get_device_list)(int*) = nullptr;
  void (*free_device_list)(ibv_device**) = nullptr;
  const char* (*get_device_name)(ibv_device*) = nullptr;
  ibv_context* (*open_device)(ibv_device*) = nullptr;
  int (*close_device)(ibv_context*) = nullptr;
  int (*query_device)(ibv_context*, ibv_device_attr*) = nullptr;
  int (*query_port)(ibv_context*, uint8_t, _compat_ibv_port_attr*) = nullptr;
  int (*query_gid_ex)(ibv_context*, uint32_t, uint32_t, ibv_gid_entry*, uint32_t, size_t) = nullptr;
  int (*query_pkey)(ibv_context*, uint8_t, int, __be16*) = nullptr;
  ibv_pd* (*alloc_pd)(ibv_context*) = nullptr;
  int (*dealloc_pd)(ibv_pd*) = nullptr;
  ibv_mr* (*reg_mr)(ibv_pd*, void*, size_t, int) = nullptr;
  ibv_mr* (*reg_mr_iova2)(ibv_pd*, void*, size_t, uint64_t, unsigned int) = nullptr;
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd*, uint64_t, size_t, uint64_t, int, int) = nullptr;
  int (*dereg_mr)(ibv_mr*) = nullptr;
  ibv_comp_channel* (*create_comp_channel)(ibv_context*) = nullptr;
  int (*destroy_comp_channel)(ibv_comp_channel*) = nullptr;
  ibv_cq* (*create_cq)(ibv_context*, int, void*, ibv_comp_channel*, int) = nullptr;
  int (*destroy_cq)(ibv_cq*) = nullptr;
  int (*get_cq_event)(ibv_comp_channel*, ibv_cq**, void**) = nullptr;
  void (*ack_cq_events)(ibv_cq*, unsigned int) = nullptr;
  ibv_qp* (*create_qp)(ibv_pd*, ibv_qp_init_attr*) = nullptr;
  int (*modify_qp)(ibv_qp*, ibv_qp_attr*, int) = nullptr;
  int (*destroy_qp)(ibv_qp*) = nullptr;
  int (*get_async_event)(ibv_context*, ibv_async_event*) = nullptr;
  void (*ack_async_event)(ibv_async_event*) = nullptr;
};

// The opened library; closed with the last RealVerbsApi using it.
class VerbsLibrary {
 public:
  static absl::StatusOr<std::unique_ptr<VerbsLibrary>> Open(const char* soname) {
    void* handle = ::dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = ::dlerror();
      return absl::UnavailableError(absl::StrCat(
          "rdma: cannot load ", soname, " (", why != nullptr ? why : "not found",
          "): the RDMA transport needs rdma-core's libibverbs (Debian: libibverbs1 and "
          "ibverbs-providers, scripts/install-deps.sh); transport=tcp needs none"));
    }
    auto library = std::unique_ptr<VerbsLibrary>(new VerbsLibrary(handle));
    VerbsCalls& c = library->calls_;
    absl::Status missing = absl::OkStatus();
    auto bind = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(handle, name));
      if (fn == nullptr && missing.ok()) {
        missing = absl::UnavailableError(absl::StrCat(
            "rdma: ", soname, " has no ", name,
            " (rdma-core 35 or newer is needed: ibv_reg_dmabuf_mr, ibv_is_fork_initialized)"));
      }
    };
    bind(c.fork_init, "ibv_fork_init");
    bind(c.is_fork_initialized, "ibv_is_fork_initialized");
    bind(c.get_device_list, "ibv_get_device_list");
    bind(c.free_device_list, "ibv_free_device_list");
    bind(c.get_device_name, "ibv_get_device_name");
    bind(c.open_device, "ibv_open_device");
    bind(c.close_device, "ibv_close_device");
    bind(c.query_device, "ibv_query_device");
    bind(c.query_port, "ibv_query_port");
    bind(c.query_gid_ex, "_ibv_query_gid_ex");
    bind(c.query_pkey, "ibv_query_pkey");
    bind(c.alloc_pd, "ibv_alloc_pd");
    bind(c.dealloc_pd, "ibv_dealloc_pd");
    bind(c.reg_mr, "ibv_reg_mr");
    bind(c.reg_mr_iova2, "ibv_reg_mr_iova2");
    bind(c.reg_dmabuf_mr, "ibv_reg_dmabuf_mr");
    bind(c.dereg_mr, "ibv_dereg_mr");
    bind(c.create_comp_channel, "ibv_create_comp_channel");
    bind(c.destroy_comp_channel, "ibv_destroy_comp_channel");
    bind(c.create_cq, "ibv_create_cq");
    bind(c.destroy_cq, "ibv_destroy_cq");
    bind(c.get_cq_event, "ibv_get_cq_event");
    bind(c.ack_cq_events, "ibv_ack_cq_events");
    bind(c.create_qp, "ibv_create_qp");
    bind(c.modify_qp, "ibv_modify_qp");
    bind(c.destroy_qp, "ibv_destroy_qp");
    bind(c.get_async_event, "ibv_get_async_event");
    bind(c.ack_async_event, "ibv_ack_async_event");
    if (!missing.ok()) return missing;
    return library;
  }

  VerbsLibrary(const VerbsLibrary&) = delete;
  VerbsLibrary& operator=(const VerbsLibrary&) = delete;
  ~VerbsLibrary() { ::dlclose(handle_); }

  const VerbsCalls& calls() const { return calls_; }

 private:
  explicit VerbsLibrary(void* handle) : handle_(handle) {}

  void* handle_;
  VerbsCalls calls_;
};

class RealVerbsApi final : public VerbsApi {
 public:
  explicit RealVerbsApi(std::unique_ptr<VerbsLibrary> library)
      : library_(std::move(library)), v_(library_->calls()) {}

  int ForkInit() override { return v_.fork_init(); }
  ibv_fork_status IsForkInitialized() override { return v_.is_fork_initialized(); }
  int GetMemlockLimit(uint64_t* bytes) override {
    rlimit limit{};
    if (::getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return errno;
    *bytes = limit.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(limit.rlim_cur);
    return 0;
  }
  ibv_device** GetDeviceList(int* num_devices) override { return v_.get_device_list(num_devices); }
  void FreeDeviceList(ibv_device** list) override { v_.free_device_list(list); }
  const char* GetDeviceName(ibv_device* device) override { return v_.get_device_name(device); }
  ibv_context* OpenDevice(ibv_device* device) override { return v_.open_device(device); }
  int CloseDevice(ibv_context* context) override { return v_.close_device(context); }
  int QueryDevice(ibv_context* context, ibv_device_attr* attr) override {
    return v_.query_device(context, attr);
  }
  // verbs.h's ___ibv_query_port: the provider's extended query when it has
  // one, else the exported call on the compatible (shorter) attributes.
  int QueryPort(ibv_context* context, uint8_t port, ibv_port_attr* attr) override {
    verbs_context* vctx = verbs_get_ctx_op(context, query_port);
    if (vctx == nullptr) {
      std::memset(attr, 0, sizeof(*attr));
      return v_.query_port(context, port, reinterpret_cast<_compat_ibv_port_attr*>(attr));
    }
    return vctx->query_port(context, port, attr, sizeof(*attr));
  }
  int QueryGidEx(ibv_context* context, uint8_t port, uint32_t index,
                 ibv_gid_entry* entry) override {
    return v_.query_gid_ex(context, port, index, entry, 0, sizeof(*entry));  // ibv_query_gid_ex
  }
  int QueryPkey(ibv_context* context, uint8_t port, int index, uint16_t* pkey) override {
    __be16 raw = 0;
    if (const int rc = v_.query_pkey(context, port, index, &raw); rc != 0) return rc;
    *pkey = be16toh(raw);
    return 0;
  }

  ibv_pd* AllocPd(ibv_context* context) override { return v_.alloc_pd(context); }
  int DeallocPd(ibv_pd* pd) override { return v_.dealloc_pd(pd); }
  // verbs.h's ibv_reg_mr: optional access flags (relaxed ordering) go by
  // ibv_reg_mr_iova2, which drops them where the kernel lacks them.
  ibv_mr* RegMr(ibv_pd* pd, void* addr, size_t length, int access) override {
    if ((static_cast<unsigned int>(access) & IBV_ACCESS_OPTIONAL_RANGE) == 0) {
      return v_.reg_mr(pd, addr, length, access);
    }
    return v_.reg_mr_iova2(pd, addr, length, reinterpret_cast<uintptr_t>(addr),
                           static_cast<unsigned int>(access));
  }
  ibv_mr* RegDmabufMr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                      int access) override {
    return v_.reg_dmabuf_mr(pd, offset, length, iova, fd, access);
  }
  int DeregMr(ibv_mr* mr) override { return v_.dereg_mr(mr); }

  int QueryLagPorts(ibv_context* context, uint8_t* num_lag_ports) override {
    const Mlx5Calls* mlx5 = mlx5_.For(context);
    if (mlx5 == nullptr || mlx5->query_device == nullptr) return EOPNOTSUPP;
    mlx5dv_context attributes{};
    attributes.comp_mask = MLX5DV_CONTEXT_MASK_NUM_LAG_PORTS;
    if (const int rc = mlx5->query_device(context, &attributes); rc != 0) return rc;
    if (!(attributes.comp_mask & MLX5DV_CONTEXT_MASK_NUM_LAG_PORTS)) return EOPNOTSUPP;
    *num_lag_ports = attributes.num_lag_ports;
    return 0;
  }
  int ModifyQpLagPort(ibv_qp* qp, uint8_t port) override {
    const Mlx5Calls* mlx5 = mlx5_.For(qp->context);
    if (mlx5 == nullptr || mlx5->modify_qp_lag_port == nullptr) return EOPNOTSUPP;
    return mlx5->modify_qp_lag_port(qp, port);
  }
  int QueryQpLagPort(ibv_qp* qp, uint8_t* port, uint8_t* active_port) override {
    const Mlx5Calls* mlx5 = mlx5_.For(qp->context);
    if (mlx5 == nullptr || mlx5->query_qp_lag_port == nullptr) return EOPNOTSUPP;
    return mlx5->query_qp_lag_port(qp, port, active_port);
  }

  ibv_comp_channel* CreateCompChannel(ibv_context* context) override {
    return v_.create_comp_channel(context);
  }
  int DestroyCompChannel(ibv_comp_channel* channel) override {
    return v_.destroy_comp_channel(channel);
  }
  ibv_cq* CreateCq(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel,
                   int comp_vector) override {
    return v_.create_cq(context, cqe, cq_context, channel, comp_vector);
  }
  int DestroyCq(ibv_cq* cq) override { return v_.destroy_cq(cq); }
  // Inline in verbs.h (the provider's ops): no symbol.
  int ReqNotifyCq(ibv_cq* cq, int solicited_only) override {
    return ibv_req_notify_cq(cq, solicited_only);
  }
  int GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) override {
    return v_.get_cq_event(channel, cq, cq_context);
  }
  void AckCqEvents(ibv_cq* cq, unsigned int nevents) override { v_.ack_cq_events(cq, nevents); }
  int PollCq(ibv_cq* cq, int num_entries, ibv_wc* wc) override {
    return ibv_poll_cq(cq, num_entries, wc);  // inline: the provider's ops
  }

  ibv_qp* CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr) override { return v_.create_qp(pd, attr); }
  int ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) override {
    return v_.modify_qp(qp, attr, attr_mask);
  }
  int DestroyQp(ibv_qp* qp) override { return v_.destroy_qp(qp); }
  // Inline in verbs.h (the provider's ops): no symbol.
  int PostSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) override {
    return ibv_post_send(qp, wr, bad_wr);
  }
  int PostRecv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) override {
    return ibv_post_recv(qp, wr, bad_wr);
  }

  int GetAsyncEvent(ibv_context* context, ibv_async_event* event) override {
    return v_.get_async_event(context, event);
  }
  void AckAsyncEvent(ibv_async_event* event) override { v_.ack_async_event(event); }

 private:
  const std::unique_ptr<VerbsLibrary> library_;
  const VerbsCalls& v_;
  Mlx5Calls mlx5_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<VerbsApi>> MakeRealVerbsApi(const char* library) {
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<VerbsLibrary> opened, VerbsLibrary::Open(library));
  return std::make_shared<RealVerbsApi>(std::move(opened));
}

}  // namespace stepmesh::rdma
