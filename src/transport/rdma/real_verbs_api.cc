// RealVerbsApi: each method is the libibverbs call of the same name; the mlx5
// LAG calls come from libmlx5, opened on first use (never linked).

#include <dlfcn.h>
#include <endian.h>
#include <infiniband/mlx5dv.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstdint>
#include <memory>
#include <mutex>

#include "src/transport/rdma/verbs_api.h"

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

class RealVerbsApi final : public VerbsApi {
 public:
  int ForkInit() override { return ibv_fork_init(); }
  ibv_fork_status IsForkInitialized() override { return ibv_is_fork_initialized(); }
  int GetMemlockLimit(uint64_t* bytes) override {
    rlimit limit{};
    if (::getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return errno;
    *bytes = limit.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(limit.rlim_cur);
    return 0;
  }
  ibv_device** GetDeviceList(int* num_devices) override { return ibv_get_device_list(num_devices); }
  void FreeDeviceList(ibv_device** list) override { ibv_free_device_list(list); }
  const char* GetDeviceName(ibv_device* device) override { return ibv_get_device_name(device); }
  ibv_context* OpenDevice(ibv_device* device) override { return ibv_open_device(device); }
  int CloseDevice(ibv_context* context) override { return ibv_close_device(context); }
  int QueryDevice(ibv_context* context, ibv_device_attr* attr) override {
    return ibv_query_device(context, attr);
  }
  int QueryPort(ibv_context* context, uint8_t port, ibv_port_attr* attr) override {
    return ibv_query_port(context, port, attr);
  }
  int QueryGidEx(ibv_context* context, uint8_t port, uint32_t index,
                 ibv_gid_entry* entry) override {
    return ibv_query_gid_ex(context, port, index, entry, 0);
  }
  int QueryPkey(ibv_context* context, uint8_t port, int index, uint16_t* pkey) override {
    __be16 raw = 0;
    if (const int rc = ibv_query_pkey(context, port, index, &raw); rc != 0) return rc;
    *pkey = be16toh(raw);
    return 0;
  }

  ibv_pd* AllocPd(ibv_context* context) override { return ibv_alloc_pd(context); }
  int DeallocPd(ibv_pd* pd) override { return ibv_dealloc_pd(pd); }
  ibv_mr* RegMr(ibv_pd* pd, void* addr, size_t length, int access) override {
    return ibv_reg_mr(pd, addr, length, access);
  }
  ibv_mr* RegDmabufMr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                      int access) override {
    return ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access);
  }
  int DeregMr(ibv_mr* mr) override { return ibv_dereg_mr(mr); }

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
    return ibv_create_comp_channel(context);
  }
  int DestroyCompChannel(ibv_comp_channel* channel) override {
    return ibv_destroy_comp_channel(channel);
  }
  ibv_cq* CreateCq(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel,
                   int comp_vector) override {
    return ibv_create_cq(context, cqe, cq_context, channel, comp_vector);
  }
  int DestroyCq(ibv_cq* cq) override { return ibv_destroy_cq(cq); }
  int ReqNotifyCq(ibv_cq* cq, int solicited_only) override {
    return ibv_req_notify_cq(cq, solicited_only);
  }
  int GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) override {
    return ibv_get_cq_event(channel, cq, cq_context);
  }
  void AckCqEvents(ibv_cq* cq, unsigned int nevents) override { ibv_ack_cq_events(cq, nevents); }
  int PollCq(ibv_cq* cq, int num_entries, ibv_wc* wc) override {
    return ibv_poll_cq(cq, num_entries, wc);
  }

  ibv_qp* CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr) override { return ibv_create_qp(pd, attr); }
  int ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) override {
    return ibv_modify_qp(qp, attr, attr_mask);
  }
  int DestroyQp(ibv_qp* qp) override { return ibv_destroy_qp(qp); }
  int PostSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) override {
    return ibv_post_send(qp, wr, bad_wr);
  }
  int PostRecv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) override {
    return ibv_post_recv(qp, wr, bad_wr);
  }

  int GetAsyncEvent(ibv_context* context, ibv_async_event* event) override {
    return ibv_get_async_event(context, event);
  }
  void AckAsyncEvent(ibv_async_event* event) override { ibv_ack_async_event(event); }

 private:
  Mlx5Calls mlx5_;
};

}  // namespace

std::shared_ptr<VerbsApi> MakeRealVerbsApi() { return std::make_shared<RealVerbsApi>(); }

}  // namespace stepmesh::rdma
