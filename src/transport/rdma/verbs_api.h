#pragma once
// The only door to ibverbs. Every verbs call the RDMA transport makes goes
// through a VerbsApi (the headers are compiled against; the library is
// opened at run time), so the transport runs in CI over an in-process fake
// (tests/rdma/fake_verbs.h) and on hardware over RealVerbsApi. The methods
// keep libibverbs' names, arguments and return conventions (pointers or null
// with errno; int 0 or an errno value) so the real implementation is a
// pass-through and the fake can be checked against the man pages.

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace stepmesh::rdma {

class VerbsApi {
 public:
  virtual ~VerbsApi() = default;

  // ibv_fork_init: makes registered memory safe across fork() (PyTorch's
  // DataLoader forks). Must come before the first registration; 0 or an errno.
  virtual int ForkInit() = 0;
  // ibv_is_fork_initialized: IBV_FORK_UNNEEDED where the kernel copies
  // registered pages on fork itself (5.13+ with rdma-core 35+): ibv_fork_init
  // is then not needed, and calling it would madvise(DONTFORK) every
  // registration, splitting mappings until vm.max_map_count runs out.
  virtual ibv_fork_status IsForkInitialized() = 0;
  // The process's RLIMIT_MEMLOCK soft limit in bytes (UINT64_MAX: unlimited),
  // which the kernel charges every registration's pages against, each MR on
  // its own; 0 or an errno. Not a verbs call, but the limit verbs live under.
  virtual int GetMemlockLimit(uint64_t* bytes) = 0;

  // Devices.
  virtual ibv_device** GetDeviceList(int* num_devices) = 0;
  virtual void FreeDeviceList(ibv_device** list) = 0;
  virtual const char* GetDeviceName(ibv_device* device) = 0;
  virtual ibv_context* OpenDevice(ibv_device* device) = 0;
  virtual int CloseDevice(ibv_context* context) = 0;
  virtual int QueryDevice(ibv_context* context, ibv_device_attr* attr) = 0;
  virtual int QueryPort(ibv_context* context, uint8_t port, ibv_port_attr* attr) = 0;
  // Fills `entry` (GID bytes and RoCE v1/v2/IB type); nonzero for an empty slot.
  virtual int QueryGidEx(ibv_context* context, uint8_t port, uint32_t index,
                         ibv_gid_entry* entry) = 0;
  // ibv_query_pkey, the P_Key in host byte order; nonzero past the table's end.
  virtual int QueryPkey(ibv_context* context, uint8_t port, int index, uint16_t* pkey) = 0;

  // Protection domains and memory regions.
  virtual ibv_pd* AllocPd(ibv_context* context) = 0;
  virtual int DeallocPd(ibv_pd* pd) = 0;
  virtual ibv_mr* RegMr(ibv_pd* pd, void* addr, size_t length, int access) = 0;
  virtual ibv_mr* RegDmabufMr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                              int access) = 0;
  virtual int DeregMr(ibv_mr* mr) = 0;

  // Completion queues and their event channel.
  virtual ibv_comp_channel* CreateCompChannel(ibv_context* context) = 0;
  virtual int DestroyCompChannel(ibv_comp_channel* channel) = 0;
  virtual ibv_cq* CreateCq(ibv_context* context, int cqe, void* cq_context,
                           ibv_comp_channel* channel, int comp_vector) = 0;
  virtual int DestroyCq(ibv_cq* cq) = 0;
  virtual int ReqNotifyCq(ibv_cq* cq, int solicited_only) = 0;
  virtual int GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) = 0;
  virtual void AckCqEvents(ibv_cq* cq, unsigned int nevents) = 0;
  virtual int PollCq(ibv_cq* cq, int num_entries, ibv_wc* wc) = 0;

  // Queue pairs.
  virtual ibv_qp* CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr) = 0;
  virtual int ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) = 0;
  virtual int DestroyQp(ibv_qp* qp) = 0;
  virtual int PostSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) = 0;
  virtual int PostRecv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) = 0;

  // mlx5 LAG (a bonded pair of RoCE ports behind one device), resolved from
  // libmlx5 at run time so that other providers, or none, still load.
  // Each returns 0 or an errno: EOPNOTSUPP when the device is not mlx5, the
  // library lacks the call, or the ports are not bonded.
  virtual int QueryLagPorts(ibv_context* context, uint8_t* num_lag_ports) = 0;
  // Pins `qp`'s traffic to LAG port `port` (1-based). Call in RTS: later state
  // changes may re-pick the port.
  virtual int ModifyQpLagPort(ibv_qp* qp, uint8_t port) = 0;
  virtual int QueryQpLagPort(ibv_qp* qp, uint8_t* port, uint8_t* active_port) = 0;

  // Asynchronous events (port changes, QP/CQ fatal errors). The context's
  // async_fd is what a poller waits on.
  virtual int GetAsyncEvent(ibv_context* context, ibv_async_event* event) = 0;
  virtual void AckAsyncEvent(ibv_async_event* event) = 0;
};

// The library RealVerbsApi opens.
inline constexpr char kVerbsLibrary[] = "libibverbs.so.1";

// Pass-through to libibverbs, opened at run time with dlopen and never linked,
// so that a library built with RDMA loads (and runs TCP) on a machine without
// rdma-core. UNAVAILABLE naming the library when it cannot be opened, or the
// entry point it lacks. `library`: another soname (tests).
absl::StatusOr<std::shared_ptr<VerbsApi>> MakeRealVerbsApi(const char* library = kVerbsLibrary);

}  // namespace stepmesh::rdma
