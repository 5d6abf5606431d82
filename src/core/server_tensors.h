#pragma once
// The tensors a server registered: receive regions (one slot per worker, each
// slot busy from the push that fills it until the reply that frees it) and
// reply regions (slot w is worker w's reply).

#include <atomic>
#include <cstddef>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "src/core/payload_io.h"
#include "stepmesh/tensor.h"
#include "stepmesh/types.h"

namespace stepmesh::core {

struct RecvRegistration {
  TensorView view;
  WireTensor wire;
  size_t slot_bytes = 0;
  // Per worker: the slot holds data no reply has answered yet. Set by the
  // receive thread when it accepts a push; cleared when the reply goes out,
  // when the request fails, or when the worker is gone.
  std::unique_ptr<std::atomic<bool>[]> busy;
  // Per worker: the request id of the last push accepted into the slot (0:
  // none; ids are never 0). Receive thread only. A push carrying it again is a
  // copy of one this server already took (a sender or a link that duplicated
  // a frame), not a new request: it is dropped, and neither the original
  // request nor the next one under this key is failed for it.
  std::unique_ptr<uint64_t[]> last_request;
  // Per worker: the pull key its last push here named that had a reply tensor
  // (kNoPull: none yet). Receive thread, under the registrations' shared lock;
  // cleared under the exclusive lock when a reply tensor is unregistered.
  std::unique_ptr<Key[]> pull_checked;
};

struct ReplyRegistration {
  TensorView view;
  WireTensor wire;
  size_t slot_bytes = 0;
};

using ReplyTensors = absl::flat_hash_map<Key, std::unique_ptr<ReplyRegistration>>;

}  // namespace stepmesh::core
