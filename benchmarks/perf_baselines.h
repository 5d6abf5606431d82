#pragma once
// The baselines stepmesh_perf interleaves with its own measurements, moving
// the same bytes between the same processes:
//   raw-tcp: TCP sockets written for the benchmark, TCP_NODELAY, the transport's
//            socket buffers, one connection per (worker, server): a small size
//            header + push bytes out, pull bytes back. Receives use the
//            transport's low-water mark (SO_RCVLOWAT = the rest of the message,
//            at most 256 KiB), so a receiver copies once per 256 KiB instead of
//            chasing the sender segment by segment. Three disciplines:
//              kSpin     readiness busy-polled (poll() with a zero timeout, as
//                        the library's epoll_wait(0) in its spin / adaptive
//                        modes), then a non-blocking recv of what is queued;
//              kBlock    blocking: poll() over every connection, MSG_WAITALL
//                        per 256 KiB once one reply is left (the library's
//                        blocking mode);
//              kNaive    the old row: one blocking thread that writes to each
//                        server in turn, then reads each reply in turn, no
//                        low-water mark. Not a floor (nothing overlaps); kept
//                        labelled as such.
//            kSpin and kBlock drive every server connection from one loop, so
//            sends and receives to different servers overlap, and the echo
//            side receives in the same discipline. The floor is the best of them.
//   zmq:     ZeroMQ as StepMesh's ZMQ van uses it: one DEALER socket per server
//            polled together (zmq_poll), the push sent zero-copy, the reply
//            received zero-copy (zmq_msg_recv), 8 MiB socket buffers; the echo
//            side is a ROUTER that answers a round only once every worker's
//            push arrived (the AF batch barrier).
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

// The ZeroMQ socket buffers (ZMQ_SNDBUF / ZMQ_RCVBUF) on both ends.
inline constexpr int kZmqSocketBuffer = 8 << 20;

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
// then receive `pull_bytes` from each. raw-tcp lands the replies in `pull[s]`;
// zmq leaves each in ZeroMQ's message (zero-copy) and checks its size and
// first byte.
class BaselineClient {
 public:
  virtual ~BaselineClient() = default;
  virtual absl::Status Exchange(const void* push, size_t push_bytes, absl::Span<void* const> pull,
                                size_t pull_bytes) = 0;
};

enum class RawMode : uint64_t { kBlock = 0, kSpin = 1, kNaive = 2 };

// `batch`: the number of workers; each server answers a round only once all of
// them pushed, as an FFN server must (the AF batch barrier).
absl::StatusOr<std::unique_ptr<BaselineClient>> ConnectRawTcp(
    const std::vector<base::HostPort>& servers, int sockbuf, absl::Duration timeout, int batch,
    RawMode mode);
absl::StatusOr<std::unique_ptr<BaselineClient>> ConnectZmq(
    const std::vector<base::HostPort>& servers, absl::Duration timeout, int batch);

}  // namespace stepmesh::bench
