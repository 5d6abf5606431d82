#pragma once
// Building a peer's verbs resources and bringing its QPs to RTS: the control
// block, CQs sized from what the NIC granted, QPs with the inline cap the
// provider grants, and address vectors for RoCE (a GRH) or InfiniBand (the
// peer's LID; a GRH only across subnets).

#include <cstdint>
#include <random>

#include "absl/status/status.h"
#include "src/transport/rdma/rdma_peer.h"
#include "src/transport/rdma/rdma_wire.h"
#include "src/transport/rdma/verbs_api.h"
#include "src/transport/rdma/verbs_resources.h"
#include "stepmesh/options.h"

namespace stepmesh::rdma {

struct SetupContext {
  VerbsApi* verbs = nullptr;
  const PortChoice* port = nullptr;
  const RdmaOptions* options = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;  // the receive CQs' completion channel
  uint32_t max_qp_wr = 0;               // device limits
  uint32_t max_cqe = 0;
  uint8_t lag_ports = 0;  // > 1: a bonded device, QPs pinned per port
  core::NodeId self = core::kNoNode;
};

// Host bytes one peer's control block pins (rings, mailboxes; both halves).
size_t ControlBlockBytes(uint32_t num_qps, uint32_t depth);

// Allocates the control block, the receive CQ and the QPs (in INIT, receives
// posted) of `peer` (id, num_qps and depth set), and fills `hello`.
absl::Status BuildPeer(const SetupContext& ctx, std::mt19937& rng, Peer& peer, rdma::Hello& hello);

// Checks the peer's hello against ours and drives our QPs to RTS.
absl::Status BringUp(const SetupContext& ctx, Peer& peer, const rdma::Hello& theirs);

}  // namespace stepmesh::rdma
