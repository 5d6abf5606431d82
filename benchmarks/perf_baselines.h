#pragma once
// The baselines stepmesh_perf interleaves with its own measurements, moving
// the same bytes between the same processes:
//   raw-tcp: TCP sockets written for the benchmark, TCP_NODELAY, the transport's
//            socket buffers, one connection per (worker, server): a small size
//            header + push bytes out, pull bytes back. Receive disciplines:
//              kSpin     readiness busy-polled, then a non-blocking recv of what
//                        is queued (the library's spin / adaptive modes);
//              kBlock    blocking: poll() over every connection, and with one
//                        reply left, sleep on that one (the library's blocking
//                        mode);
//              kNaive    the old row: one blocking thread that writes to each
//                        server in turn, then reads each reply in turn, no
//                        low-water mark. Nothing overlaps, which costs nothing
//                        with one server: it is a floor candidate when measured.
//              kTwoThreads  the library's shape: a send thread writes the push
//                        to every server while the caller receives every
//                        reply (spinning, with the mark), two cores at work.
//            kSpin and kBlock drive every server connection from one loop, so
//            sends and receives to different servers overlap, and the echo
//            side receives in the same discipline. Each runs with and without
//            the transport's receive low-water mark (SO_RCVLOWAT = the rest of
//            the message, at most 256 KiB: a receiver copies once per 256 KiB
//            instead of chasing the sender segment by segment); without it,
//            kSpin recv()s blindly and kBlock sleeps in recv(MSG_WAITALL).
//            The floor is the best of these five (kRawFloorDisciplines) and of
//            kNaive when it was measured too.
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

enum class RawMode : uint64_t { kBlock = 0, kSpin = 1, kNaive = 2, kTwoThreads = 3 };

// A raw-tcp row: its method name in stepmesh_perf's report, its discipline,
// and whether receives use the transport's low-water mark.
struct RawDiscipline {
  const char* method;
  RawMode mode;
  bool low_water;
};
// The rows the raw-tcp floor is the best of.
inline constexpr RawDiscipline kRawFloorDisciplines[] = {
    {"raw-spin", RawMode::kSpin, true},          {"raw-block", RawMode::kBlock, true},
    {"raw-spin-plain", RawMode::kSpin, false},   {"raw-block-plain", RawMode::kBlock, false},
    {"raw-2thread", RawMode::kTwoThreads, true},
};
// The old row (--baseline raw-naive); a floor candidate when measured.
inline constexpr RawDiscipline kRawNaive = {"raw-naive", RawMode::kNaive, false};

// `batch`: the number of workers; each server answers a round only once all of
// them pushed, as an FFN server must (the AF batch barrier).
absl::StatusOr<std::unique_ptr<BaselineClient>> ConnectRawTcp(
    const std::vector<base::HostPort>& servers, int sockbuf, absl::Duration timeout, int batch,
    const RawDiscipline& discipline);
absl::StatusOr<std::unique_ptr<BaselineClient>> ConnectZmq(
    const std::vector<base::HostPort>& servers, absl::Duration timeout, int batch);

}  // namespace stepmesh::bench
