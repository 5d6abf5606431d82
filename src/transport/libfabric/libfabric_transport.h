#pragma once
// The libfabric transport (docs/libfabric.md): payloads move by one-sided
// RMA writes with remote CQ data over an FI_EP_RDM endpoint (EFA's SRD,
// libfabric's tcp and shm providers), counted at the receiver, never
// ordered; frame descriptors, region adverts and goodbyes travel in order on
// a control connection (a TCP transport the composition root supplies), which
// also gives the handshake, authentication and liveness of the TCP path.

#include <rdma/fabric.h>

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/core/transport.h"
#include "stepmesh/options.h"

namespace stepmesh::libfabric {

// One RMA write as posted.
struct WriteOp {
  fi_addr_t dest = FI_ADDR_UNSPEC;
  const void* src = nullptr;
  size_t len = 0;
  void* desc = nullptr;
  uint64_t remote_addr = 0;
  uint64_t mr_key = 0;
  uint64_t imm = 0;
  bool signal = true;  // carries FI_REMOTE_CQ_DATA
  void* context = nullptr;
  uint32_t rail = 0;  // which rail (NIC) posts it: `ep` of Post is that rail's
};

// Where writes are posted: fi_writemsg, or (tests) a decorator that holds
// and reorders them. Thread-safe.
class WritePoster {
 public:
  virtual ~WritePoster() = default;
  // 0, -FI_EAGAIN, or another negative libfabric error.
  virtual ssize_t Post(fid_ep* ep, const WriteOp& op) = 0;
  // Called from the progress loop; true while it still holds writes.
  virtual bool Progress() { return false; }
};

std::unique_ptr<WritePoster> MakeDirectPoster();
// Holds every write, then posts them newest first, one per `gap`: a frame's
// last chunk lands first and its others after it, as on an unordered fabric.
std::unique_ptr<WritePoster> MakeReorderingPoster(absl::Duration gap);

struct FabricApi;

struct LibfabricHooks {
  // libfabric's entry points; null: libfabric.so.1 (tests: a fake in front of it).
  const FabricApi* api = nullptr;
  std::function<std::unique_ptr<WritePoster>()> poster;  // null: fi_writemsg
  size_t chunk_bytes = 0;                                // 0: the default chunk
  // Test only, the order-dependent design this transport must not be: only a
  // frame's last write carries immediate data, and its landing is taken to
  // mean that the earlier ones landed (true on ordered RC, false on SRD).
  bool signal_last_chunk_only = false;
};

// `control`: the ordered control connection's transport (TCP).
absl::StatusOr<std::unique_ptr<core::Transport>> CreateLibfabricTransport(
    const MeshOptions& options, core::TransportFactory control, LibfabricHooks hooks = {});

}  // namespace stepmesh::libfabric
