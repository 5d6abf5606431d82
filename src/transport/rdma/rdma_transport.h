#pragma once
// The RDMA transport: RC queue pairs per peer, payloads by RDMA_WRITE straight
// into the peer's registered receive slot, frames by RDMA_WRITE_WITH_IMM into a
// per-peer header ring, credit-based flow control, and a small TCP bootstrap
// connection per peer for QP addresses, region adverts and liveness.
// docs/rdma.md describes the protocol and how to run it on RoCE.

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "src/core/transport.h"
#include "src/transport/rdma/verbs_api.h"
#include "stepmesh/options.h"

namespace stepmesh::rdma {

// Knobs MeshOptions does not (yet) carry; the defaults suit RoCE v2 fabrics.
struct RdmaTuning {
  uint32_t recv_depth = 256;   // receives (= credits = header-ring slots) per QP
  int path_mtu = 0;            // enum ibv_mtu; 0: the smaller active MTU of both ends
  uint8_t timeout = 14;        // local ACK timeout, 4.096 us * 2^timeout
  uint8_t retry_cnt = 7;
  uint8_t rnr_retry = 3;       // credits make RNR a bug; never 7 (= retry forever)
  uint8_t min_rnr_timer = 12;
  size_t stripe_min_bytes = 64 << 10;  // with 2 QPs per peer, stripe payloads this large
};

absl::StatusOr<std::unique_ptr<core::Transport>> CreateRdmaTransport(
    const MeshOptions& options, std::shared_ptr<VerbsApi> verbs = nullptr /*real*/);
absl::StatusOr<std::unique_ptr<core::Transport>> CreateRdmaTransport(
    const MeshOptions& options, std::shared_ptr<VerbsApi> verbs, const RdmaTuning& tuning);

// True when libibverbs lists a device with an active port.
bool RdmaDeviceAvailable();

}  // namespace stepmesh::rdma
