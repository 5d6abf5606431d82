#pragma once
// The server's outgoing side: checks a Respond against the batch it answers,
// sends each worker its own slot of the reply region (send thread, or inline
// on Respond's caller), and carries requests the receive path rejected back to
// their workers as kError frames through a ring of messages, so the receive
// thread only enqueues.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "src/base/sync.h"
#include "src/core/batch_assembler.h"
#include "src/core/lost_peers.h"
#include "src/core/payload_io.h"
#include "src/core/server_tensors.h"
#include "src/core/stats_recorder.h"
#include "src/core/trace_ring.h"
#include "src/core/transport.h"
#include "stepmesh/options.h"
#include "stepmesh/server.h"

namespace stepmesh::core {

class ReplyPath {
 public:
  // Every reference must outlive the reply path.
  // `stats` counts the frames sent and the server's stages; `trace` keeps
  // each reply's stamps when on.
  ReplyPath(const MeshOptions& options, const PayloadIo& io, const LostPeers& lost,
            StatsRecorder& stats, TraceRing& trace);

  // Application thread, `slot` handed out: checks `replies` (each pulling
  // worker of the batch exactly one, within its slot of the reply tensor its
  // pull key names) and points the slot's entries at their sources. Changes
  // nothing when it fails.
  absl::Status Prepare(BatchSlot& slot, absl::Span<const Reply> replies,
                       const ReplyTensors& reply_tensors) const;

  // Send thread, or Respond's caller sending inline (ServerLogic::Respond):
  // each worker of `slot` gets its reply (or `ready`'s failure as a kError
  // frame), its receive slots freed just before. `rank`: this server's, which
  // rotates the order.
  void SendReplies(Transport& transport, NodeId self, int rank, BatchSlot& slot,
                   const absl::Status& ready) const;

  // Any thread: keeps `status` for `worker`'s request `request_id`; the index
  // goes to the send thread, which sends it with SendError.
  uint32_t RecordError(NodeId worker, uint64_t request_id, const absl::Status& status);
  void SendError(Transport& transport, NodeId self, uint32_t index);

 private:
  struct ErrorRecord {
    NodeId worker = kNoNode;
    uint64_t request_id = 0;
    absl::StatusCode code = absl::StatusCode::kUnknown;
    std::string message;
  };

  const MeshOptions& options_;
  const PayloadIo& io_;
  const LostPeers& lost_;
  StatsRecorder& stats_;
  TraceRing& trace_;
  base::Mutex error_mu_;
  std::vector<ErrorRecord> errors_ ABSL_GUARDED_BY(error_mu_);
  uint64_t next_error_ ABSL_GUARDED_BY(error_mu_) = 0;
};

}  // namespace stepmesh::core
