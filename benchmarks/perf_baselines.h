#pragma once
// The baselines stepmesh_perf interleaves with its own measurements, moving
// the same bytes between the same processes:
//   raw-tcp: blocking TCP sockets written for the benchmark, TCP_NODELAY, one
//            connection per (worker, server): a 16-byte size header + push
//            bytes out, pull bytes back. The floor for a TCP transport.
//   zmq:     ZeroMQ REQ/REP (StepMesh's own TCP fallback is a ZMQ van), the
//            push sent zero-copy as a second message part.
// Each server process runs BaselineServers next to its AFTensorServer; each
// worker process owns one client per baseline.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/base/net.h"

namespace stepmesh::bench {

bool ZmqAvailable();

// The echo side of both baselines. Serves any number of clients until destroyed.
class BaselineServers {
 public:
  // `zmq_port` 0 skips ZeroMQ. `sockbuf` > 0 sets SO_SNDBUF/SO_RCVBUF (the TCP
  // transport sets the same, so the floor runs with the same socket config).
  static absl::StatusOr<std::unique_ptr<BaselineServers>> Start(const std::string& host,
                                                                uint16_t raw_port,
                                                                uint16_t zmq_port, int sockbuf);
  virtual ~BaselineServers() = default;
};

// One iteration of a baseline: push `push_bytes` from `push` to every server,
// then receive `pull_bytes` from each into `pull[s]`.
class BaselineClient {
 public:
  virtual ~BaselineClient() = default;
  virtual absl::Status Exchange(const void* push, size_t push_bytes,
                                absl::Span<void* const> pull, size_t pull_bytes) = 0;
};

// `batch`: the number of workers; each raw server answers a round only once all
// of them pushed, as an FFN server must (the AF batch barrier).
absl::StatusOr<std::unique_ptr<BaselineClient>> ConnectRawTcp(
    const std::vector<base::HostPort>& servers, int sockbuf, absl::Duration timeout, int batch);
absl::StatusOr<std::unique_ptr<BaselineClient>> ConnectZmq(
    const std::vector<base::HostPort>& servers, absl::Duration timeout);

}  // namespace stepmesh::bench
