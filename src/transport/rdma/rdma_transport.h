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

// The knobs are MeshOptions::rdma (stepmesh/options.h); `verbs` null: libibverbs.
absl::StatusOr<std::unique_ptr<core::Transport>> CreateRdmaTransport(
    const MeshOptions& options, std::shared_ptr<VerbsApi> verbs = nullptr);

// True when libibverbs lists a device with an active port.
bool RdmaDeviceAvailable();

}  // namespace stepmesh::rdma
