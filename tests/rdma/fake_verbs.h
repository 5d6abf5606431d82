#pragma once
// An in-process RDMA fabric behind VerbsApi. Several fake hosts (each one
// VerbsApi with its own NICs) share one FakeFabric, so transports in the same
// process talk to each other through RC queue pairs that follow the verbs
// rules hardware enforces:
//   - QP state machine RESET -> INIT -> RTR -> RTS with the attribute masks the
//     kernel requires; post_recv from INIT, post_send only in RTS (ERR flushes);
//   - send-queue slots are freed only when a signalled completion is polled, so
//     an unsignalled-only sender runs out of slots (ENOMEM) as on hardware;
//   - lkey/rkey validity, protection-domain match, bounds and access flags
//     (the MR's and the responder QP's), checked when the work request
//     executes: an MR deregistered while a request using it is in flight
//     completes it with IBV_WC_LOC_PROT_ERR / IBV_WC_REM_ACCESS_ERR and moves
//     the QPs to ERR;
//   - IBV_SEND_INLINE over the QP's granted max_inline_data is refused;
//   - messages longer than the port's max_msg_sz complete with LOC_LEN_ERR;
//   - RDMA_WRITE_WITH_IMM consumes a posted receive; none posted is an RNR,
//     reported as IBV_WC_RNR_RETRY_EXC_ERR (the fake never retries RNR: a
//     transport that depends on RNR retry is broken under load anyway);
//   - PSN continuity between the two ends, peer QP existence and state; a
//     request nobody acknowledges (missing or dead responder, lost packets, a
//     downed port, a pause longer than the QP's retry budget) completes with
//     IBV_WC_RETRY_EXC_ERR after 4.096 us * 2^timeout * (retry_cnt + 1);
//   - CQ overflow raises IBV_EVENT_CQ_ERR and errors the CQ's QPs;
//   - a QP in ERR flushes every outstanding WR, signalled or not, and every
//     later one with IBV_WC_WR_FLUSH_ERR (as mlx5 does), plus its receives;
//   - completions of one QP are delivered in posting order;
//   - destroying a CQ still used by a QP or with unacked events, or a PD with
//     MRs/QPs, fails with EBUSY (catches RAII ordering bugs);
//   - mlx5-like grants: a QP gets at least the send WRs and inline bytes it
//     asked for, usually more (the WQE size and queue length are rounded up);
//   - InfiniBand ports route by LID: an address vector with dlid 0 is refused;
//     RoCE ports need a GRH (is_global) with a valid source GID index;
//   - dual-port devices; port and GID events carry the port number;
//   - iWARP devices (siw, ...) have no immediate data: WRITE_WITH_IMM fails;
//   - ibv_fork_init must run before the first registration (counted); a
//     kernel with copy-on-fork (SetKernelCopyOnFork) makes
//     ibv_is_fork_initialized say IBV_FORK_UNNEEDED, and registrations made
//     under an ibv_fork_init that was needed are counted (each one is a
//     madvise(DONTFORK) that splits the process's mappings);
//   - RLIMIT_MEMLOCK (FakeHostSpec::memlock_limit): every host-memory MR
//     pins its pages on its own (overlapping MRs are charged again, as the
//     kernel's pinned_vm is); past the limit ibv_reg_mr fails with ENOMEM.
//     dma-buf and peer-memory MRs are not charged;
//   - P_Keys: a QP's pkey_index must lie inside the port's table, and two QPs
//     talk only within one partition (same low 15 bits) with at least one
//     full member (bit 15); otherwise nothing is acknowledged (RETRY_EXC);
//   - GID types: a GRH names the sender's GID entry, and a packet reaches a
//     responder only through a GID entry of the same type (RoCE v1 and v2
//     are different packets); a mismatch is never acknowledged;
//   - IBV_ACCESS_RELAXED_ORDERING (an optional flag) is accepted and counted;
//   - GPUDirect: plain MRs of device memory fail (EFAULT) unless peer memory
//     is on; dma-buf MRs need an open fd and an offset that maps back inside
//     device memory;
//   - mlx5 LAG: only a bonded NIC (spec.lag_ports > 1) pins QPs, only in RTS.
//
// Two modes. Asynchronous (the default): work requests execute on a fabric
// thread after a random delay, FIFO within a QP and randomly interleaved across
// QPs; source memory is read (and inline data was copied) as real hardware
// does, so a sender that scribbles on a buffer after posting is caught; both
// completions are generated at execution. Synchronous: every work request
// executes inside PostSend (the wire is instant), for micro-benchmarks that
// want no fabric thread in the measurement.

#include <cerrno>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "src/transport/rdma/verbs_api.h"

namespace stepmesh::testing {

using ::stepmesh::rdma::VerbsApi;

// One entry of a port's GID table.
struct FakeGid {
  ibv_gid gid{};
  ibv_gid_type type = IBV_GID_TYPE_ROCE_V2;
};

struct FakeNicSpec {
  std::string name = "fake_mlx5_0";
  uint32_t ipv4 = 0x0A000001;  // port p's RoCE GIDs hold ipv4 + (p - 1) * 256
  ibv_port_state port_state = IBV_PORT_ACTIVE;
  ibv_mtu active_mtu = IBV_MTU_4096;
  uint32_t max_inline_data = 220;  // the most a QP may be granted
  int max_qp_wr = 8192;
  int max_cqe = 1 << 16;
  uint64_t max_msg_sz = uint64_t{1} << 30;       // mlx5: 1 GiB
  uint8_t ports = 1;                             // 2: a dual-port HCA
  uint8_t link_layer = IBV_LINK_LAYER_ETHERNET;  // or IBV_LINK_LAYER_INFINIBAND
  uint16_t lid = 0;           // InfiniBand: port p's LID is lid + p - 1 (0: the fabric assigns)
  bool iwarp = false;         // an iWARP device: no immediate data
  bool exact_grants = false;  // true: grant exactly what a QP asks for (not mlx5)
  // RoCE GID table of every port; empty: mlx5's usual four entries
  // {v1 fe80::, v2 fe80::, v1 ::ffff:ip, v2 ::ffff:ip}. InfiniBand ports
  // always have one IB GID, fe80::<guid>.
  std::vector<FakeGid> gids;
  // mlx5 LAG: > 1 is a bonded device with that many ports; 0 is not mlx5
  // (the LAG calls fail with EOPNOTSUPP).
  uint8_t lag_ports = 0;
  // Every port's P_Key table (host byte order); 0xFFFF is the default
  // partition, full membership.
  std::vector<uint16_t> pkeys = {0xFFFF};
};

// mlx5_0 .. mlx5_{count - 1} in name order, NIC i at 10.0.(i + 1).1 (an HGX
// host has eight).
inline std::vector<FakeNicSpec> Mlx5Nics(int count) {
  std::vector<FakeNicSpec> nics;
  for (int i = 0; i < count; ++i) {
    FakeNicSpec spec;
    spec.name = "mlx5_" + std::to_string(i);
    spec.ipv4 = 0x0A000101 + static_cast<uint32_t>(i) * 0x100;
    nics.push_back(spec);
  }
  return nics;
}

// What a fake host (one process's view) adds to its NICs.
struct FakeHostSpec {
  uint64_t memlock_limit = UINT64_MAX;  // RLIMIT_MEMLOCK soft limit, bytes (MAX: unlimited)
};

struct FakeFabricOptions {
  bool asynchronous = true;
  // Each work request waits a uniformly random 0..max_delay before it may
  // execute (never before the QP's previous one).
  absl::Duration max_delay = absl::Microseconds(40);
  uint64_t seed = 0;  // 0: a random seed
};

struct FakeFabricStats {
  uint64_t writes = 0;  // RDMA_WRITE(_WITH_IMM) executed
  uint64_t bytes_written = 0;
  uint64_t rnr_errors = 0;
  uint64_t access_errors = 0;  // local or remote protection/access faults
  uint64_t length_errors = 0;  // messages over max_msg_sz
  uint64_t retry_errors = 0;   // requests nobody acknowledged in time
  uint64_t flushed = 0;        // IBV_WC_WR_FLUSH_ERR completions generated
  uint64_t cq_overflows = 0;
  uint64_t dmabuf_mrs = 0;       // MRs registered through ibv_reg_dmabuf_mr
  uint64_t peer_memory_mrs = 0;  // plain ibv_reg_mr MRs of device memory (peer memory)
  uint64_t fork_init_calls = 0;
  uint64_t registrations_before_fork_init = 0;
  uint64_t dontfork_registrations = 0;  // registrations under a needed ibv_fork_init
  uint64_t relaxed_ordering_mrs = 0;    // MRs registered with IBV_ACCESS_RELAXED_ORDERING
  uint64_t memlock_refusals = 0;        // registrations refused (ENOMEM) by RLIMIT_MEMLOCK
  uint64_t peak_pinned_bytes = 0;       // the most host memory any host had pinned
};

class FakeFabric {
 public:
  explicit FakeFabric(FakeFabricOptions options = {});
  ~FakeFabric();
  FakeFabric(const FakeFabric&) = delete;
  FakeFabric& operator=(const FakeFabric&) = delete;

  bool asynchronous() const;

  // A host with one NIC on this fabric; the returned VerbsApi lists only it.
  std::shared_ptr<VerbsApi> AddHost(const FakeNicSpec& spec);
  // A host with several NICs (device selection tests).
  std::shared_ptr<VerbsApi> AddHost(const std::vector<FakeNicSpec>& nics,
                                    const FakeHostSpec& host = {});
  // The kernel copies registered pages on fork (Linux 5.13+):
  // ibv_is_fork_initialized says IBV_FORK_UNNEEDED.
  void SetKernelCopyOnFork(bool copy_on_fork);

  // Moves every QP of the NIC named `nic` to ERR (a NIC reset).
  void FailNic(const std::string& nic);
  // An asynchronous event on `port` of `nic`, delivered to every open context
  // of it. IBV_EVENT_PORT_ERR also takes the port down (its traffic is no
  // longer acknowledged), IBV_EVENT_PORT_ACTIVE brings it back.
  void InjectPortEvent(const std::string& nic, uint8_t port, ibv_event_type type);
  // Replaces GID `index` of `port` (an address change) and raises
  // IBV_EVENT_GID_CHANGE on that port.
  void ChangeGid(const std::string& nic, uint8_t port, uint32_t index, const ibv_gid& gid);
  // Asynchronous mode only. A PFC pause: traffic to and from `nic` waits for
  // `duration`; requests whose retry budget runs out first fail RETRY_EXC.
  void PauseNic(const std::string& nic, absl::Duration duration);
  // Every packet QP `qpn` sends is lost (until `drop` is false again): its
  // requests fail with RETRY_EXC once the QP's retry budget is spent (at once
  // in synchronous mode).
  void DropTraffic(uint32_t qpn, bool drop);
  // Asynchronous mode only. QP `qpn`'s requests wait (a slow path, within
  // the retry budget) until released.
  void HoldQp(uint32_t qpn, bool hold);
  // The live QPs of `nic`, in creation order.
  std::vector<uint32_t> QpNumbers(const std::string& nic) const;
  // The capacity of the CQ that QP `qpn` sends to, and the send WRs it was granted.
  int SendCqCapacity(uint32_t qpn) const;
  uint32_t GrantedSendWr(uint32_t qpn) const;
  // Work requests posted to `qpn` that have not executed yet.
  size_t Outstanding(uint32_t qpn) const;

  // GPUDirect. [base, base + bytes) stands for GPU memory (the test's fake GPU
  // keeps it in host memory). ibv_reg_mr refuses it with EFAULT, as the kernel
  // does without a peer-memory module, unless `peer_memory` is set.
  // ibv_reg_dmabuf_mr accepts only ranges of such memory, with an open fd and
  // an offset that maps the iova back to a page-aligned export; with
  // `dmabuf` unset it fails with EOPNOTSUPP (a kernel or NIC without dma-buf).
  void AddDeviceMemory(const void* base, size_t bytes);
  // `dmabuf_errno` is what a refused ibv_reg_dmabuf_mr sets: EOPNOTSUPP
  // (kernel without dma-buf MRs) or EPROTONOSUPPORT (MLNX_OFED's; errno 93
  // in perftest#280 on an H100 host).
  void SetGpuDirect(bool dmabuf, bool peer_memory, int dmabuf_errno = EOPNOTSUPP);
  // Device memory the fabric cannot be told of range by range (a fake GPU's
  // cudaMalloc inside the code under test): `is_device(p, n)` says whether
  // [p, p + n) is GPU memory, besides the ranges AddDeviceMemory named.
  void SetDeviceMemoryOracle(std::function<bool(const void*, size_t)> is_device);

  // The LAG port each live QP of NIC `nic` is pinned to (0: never pinned), in
  // QP-number order.
  std::vector<uint8_t> LagPorts(const std::string& nic) const;
  FakeFabricStats stats() const;

  struct State;  // opaque, shared with the hosts' VerbsApis

 private:
  std::shared_ptr<State> state_;
};

}  // namespace stepmesh::testing
