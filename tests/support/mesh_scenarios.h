#pragma once
// The AF exchange every transport must pass: workers push distinct data for
// several micro-batches in flight, servers answer each worker with a function
// of the whole batch, workers check every reply byte. Used by the in-process
// tests (any TransportFactory: tcp, rdma-on-fake-verbs, fault injection) and
// by the multi-process node program.

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "src/core/transport.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"

namespace stepmesh::testing {

struct Scenario {
  int workers = 2;
  int servers = 2;
  int micro_batches = 3;
  int iterations = 200;                // per micro-batch ("layers")
  size_t push_bytes = 128 * 7168;      // fp8 activations of 128 tokens
  size_t pull_bytes = 128 * 7168 * 2;  // bf16 outputs
  absl::Duration step_timeout = absl::Seconds(20);
};

// Registers the scenario's tensors and runs it; the tensors live inside, so
// both end by shutting the participant down.
absl::Status RunWorker(AFTensorWorker& worker, const Scenario& scenario);
absl::Status RunServer(AFTensorServer& server, const Scenario& scenario);

// A scheduler, the workers and the servers as threads of this process.
absl::Status RunInProcess(const Scenario& scenario, MeshOptions base,
                          const core::TransportFactory& transport);

// Keys used by the scenario (micro-batch m).
inline Key PushKey(int m) { return 1000 + m; }
inline Key PullKey(int m) { return 2000 + m; }

}  // namespace stepmesh::testing
