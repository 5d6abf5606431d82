#pragma once
// Meeting through a key-value store the framework already runs: the shape of
// torch.distributed.Store (set / get / add / wait), e.g. the TCPStore vLLM and
// PyTorch start. The mesh then needs no scheduler process: joins, the roster
// and barriers go through the store, and liveness is our own heartbeat (a
// counter per participant in the store, docs/deployment.md).
//
// The store must outlive the participants created on it, and be safe to call
// from several threads (the library calls it from its rendezvous threads).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "stepmesh/backend.h"
#include "stepmesh/export.h"
#include "stepmesh/options.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"

namespace stepmesh {

class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // The value of a key that exists (callers Wait for it first).
  virtual absl::StatusOr<std::string> Get(const std::string& key) = 0;
  // Adds `delta` to the integer at `key` (absent: 0) and returns the sum;
  // Add(key, 0) reads a counter without blocking.
  virtual absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) = 0;
  // Returns once every key exists; DEADLINE_EXCEEDED after `timeout`.
  virtual absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) = 0;
};

// A worker / server that meets its mesh through `store` (options.rendezvous
// is ignored; keys under "stepmesh/<mesh_id or default>/").
STEPMESH_EXPORT absl::StatusOr<std::unique_ptr<AFTensorWorker>> CreateWorkerWithStore(
    const MeshOptions& options, std::shared_ptr<RendezvousStore> store,
    std::shared_ptr<Backend> backend = nullptr);
STEPMESH_EXPORT absl::StatusOr<std::unique_ptr<AFTensorServer>> CreateServerWithStore(
    const MeshOptions& options, std::shared_ptr<RendezvousStore> store,
    std::shared_ptr<Backend> backend = nullptr);

}  // namespace stepmesh
