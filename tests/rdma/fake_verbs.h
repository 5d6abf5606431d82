#pragma once
// An in-process RDMA fabric behind VerbsApi. Several fake hosts (each one
// VerbsApi with its own NIC) share one FakeFabric, so transports in the same
// process talk to each other through RC queue pairs that follow the verbs
// rules hardware enforces:
//   - QP state machine RESET -> INIT -> RTR -> RTS with the attribute masks the
//     kernel requires; post_recv from INIT, post_send only in RTS (ERR flushes);
//   - send-queue slots are freed only when a signalled completion is polled, so
//     an unsignalled-only sender runs out of slots (ENOMEM) as on hardware;
//   - lkey/rkey validity, protection-domain match, bounds and access flags
//     (the MR's and the responder QP's): violations complete with
//     IBV_WC_LOC_PROT_ERR / IBV_WC_REM_ACCESS_ERR and move the QPs to ERR;
//   - IBV_SEND_INLINE over the QP's granted max_inline_data is refused;
//   - RDMA_WRITE_WITH_IMM consumes a posted receive; none posted is an RNR,
//     reported as IBV_WC_RNR_RETRY_EXC_ERR (the fake never retries: a transport
//     that depends on RNR retry is broken under load anyway);
//   - PSN continuity between the two ends, peer QP existence and state;
//   - CQ overflow raises IBV_EVENT_CQ_ERR and errors the CQ's QPs;
//   - a QP in ERR flushes every outstanding and later WR with IBV_WC_WR_FLUSH_ERR;
//   - completions of one QP are delivered in posting order;
//   - destroying a CQ still used by a QP or with unacked events, or a PD with
//     MRs/QPs, fails with EBUSY (catches RAII ordering bugs);
//   - GPUDirect: plain MRs of device memory fail (EFAULT) unless peer memory
//     is on; dma-buf MRs need an open fd and an offset that maps back inside
//     device memory;
//   - mlx5 LAG: only a bonded NIC (spec.lag_ports > 1) pins QPs, only in RTS.
// Work requests execute synchronously inside PostSend (the wire is instant).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "src/transport/rdma/verbs_api.h"

namespace stepmesh::testing {

using ::stepmesh::rdma::VerbsApi;

struct FakeNicSpec {
  std::string name = "fake_mlx5_0";
  uint32_t ipv4 = 0x0A000001;  // RoCE v2 GID ::ffff:a.b.c.d
  ibv_port_state port_state = IBV_PORT_ACTIVE;
  ibv_mtu active_mtu = IBV_MTU_4096;
  uint32_t max_inline_data = 220;  // the most a QP may be granted
  int max_qp_wr = 8192;
  int max_cqe = 1 << 16;
  // mlx5 LAG: > 1 is a bonded device with that many ports; 0 is not mlx5
  // (the LAG calls fail with EOPNOTSUPP).
  uint8_t lag_ports = 0;
};

struct FakeFabricStats {
  uint64_t writes = 0;           // RDMA_WRITE(_WITH_IMM) executed
  uint64_t bytes_written = 0;
  uint64_t rnr_errors = 0;
  uint64_t access_errors = 0;    // local or remote protection/access faults
  uint64_t flushed = 0;          // IBV_WC_WR_FLUSH_ERR completions generated
  uint64_t cq_overflows = 0;
  uint64_t dmabuf_mrs = 0;       // MRs registered through ibv_reg_dmabuf_mr
};

class FakeFabric {
 public:
  FakeFabric();
  ~FakeFabric();
  FakeFabric(const FakeFabric&) = delete;
  FakeFabric& operator=(const FakeFabric&) = delete;

  // A host with one NIC on this fabric; the returned VerbsApi lists only it.
  std::shared_ptr<VerbsApi> AddHost(const FakeNicSpec& spec);
  // A host with several NICs (device selection tests).
  std::shared_ptr<VerbsApi> AddHost(const std::vector<FakeNicSpec>& nics);

  // Moves every QP of the NIC named `nic` to ERR (a cable pull / NIC reset).
  void FailNic(const std::string& nic);

  // GPUDirect. [base, base + bytes) stands for GPU memory (the test's fake GPU
  // keeps it in host memory). ibv_reg_mr refuses it with EFAULT, as the kernel
  // does without a peer-memory module, unless `peer_memory` is set.
  // ibv_reg_dmabuf_mr accepts only ranges of such memory, with an open fd and
  // an offset that maps the iova back to a page-aligned export; with
  // `dmabuf` unset it fails with EOPNOTSUPP (a kernel or NIC without dma-buf).
  void AddDeviceMemory(const void* base, size_t bytes);
  void SetGpuDirect(bool dmabuf, bool peer_memory);

  // The LAG port each live QP of NIC `nic` is pinned to (0: never pinned), in
  // QP-number order.
  std::vector<uint8_t> LagPorts(const std::string& nic) const;
  FakeFabricStats stats() const;

  struct State;  // opaque, shared with the hosts' VerbsApis

 private:
  std::shared_ptr<State> state_;
};

}  // namespace stepmesh::testing
