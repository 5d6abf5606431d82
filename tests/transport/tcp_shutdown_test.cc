// An orderly TCP shutdown never resets the peer's stream. One end sends a
// frame far larger than the peer's socket buffers (64 KiB here) and shuts
// down at once, with a frame from the peer still unread; the peer starts
// reading later. The peer must get every byte and then see a departure
// (CANCELLED), not a reset; both directions. A peer that never reads, or never closes its end, does
// not hold Shutdown past its bound, and the warning names it. docs/tcp.md
// ("Shutdown") describes the close.

#include <catch2/catch.hpp>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/core/protocol.h"
#include "src/core/transport.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "stepmesh/status.h"
#include "tests/support/status.h"
#include "tests/support/stderr_capture.h"
#include "tests/transport/tcp_pair.h"

namespace stepmesh {
namespace {

using core::FrameHeader;
using core::NodeId;

constexpr int kSmallBuffers = 64 << 10;
constexpr size_t kLarge = 4 << 20;  // 4 MiB

MeshOptions Options(absl::Duration timeout) {
  MeshOptions o;
  o.transport = "tcp";
  o.timeout = timeout;
  o.num_workers = 1;
  o.num_servers = 1;
  return o;
}

absl::StatusOr<testing::TcpPair> Connect(absl::Duration timeout) {
  return testing::ConnectTcpPair(Options(timeout), Options(timeout));
}

// A push (worker to server) or a reply (server to worker) of `bytes`.
FrameHeader Frame(NodeId from, NodeId to, uint64_t id, size_t bytes) {
  FrameHeader h;
  h.type = core::IsWorker(from) ? core::FrameType::kPush : core::FrameType::kReply;
  h.src = from;
  h.dst = to;
  h.key = 7;
  h.request_id = id;
  h.payload_bytes = bytes;
  h.part_count = 1;
  return h;
}

std::vector<std::string> WarningsAndErrors(const std::string& log) {
  std::vector<std::string> bad;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StartsWith(line, "[stepmesh W") || absl::StartsWith(line, "[stepmesh E")) {
      bad.emplace_back(line);
    }
  }
  return bad;
}

TEST_CASE(
    "tcp shutdown: the slow reader of a frame larger than the socket buffers gets every byte "
    "and then a departure",
    "[tcp][shutdown]") {
  const bool server_leaves = GENERATE(true, false);
  INFO((server_leaves ? "the server leaves after a reply" : "the worker leaves after a push"));
  testing::StderrCapture capture("tcp_shutdown");
  absl::StatusOr<testing::TcpPair> pair = Connect(absl::Seconds(10));
  REQUIRE_OK(pair.status());
  testing::TcpPair& p = *pair;
  std::unique_ptr<core::Transport>& leaver = server_leaves ? p.server : p.worker;
  std::unique_ptr<core::Transport>& reader = server_leaves ? p.worker : p.server;
  const NodeId leaver_id = server_leaves ? p.s : p.w;
  const NodeId reader_id = server_leaves ? p.w : p.s;

  // The reader takes 64 KiB at a time; the leaver's 8 MiB send buffer holds
  // the rest of the frame, so that Send queues nothing in the transport and
  // the bytes wait in the kernel for the reader.
  REQUIRE_OK(tcp::SetSocketBuffersForTesting(*reader, leaver_id, kSmallBuffers));
  // The reader's frame is never read by the leaver (it does not poll): a
  // close with it unread is what turns into a reset.
  const std::vector<std::byte> small = testing::Pattern(256, 1);
  REQUIRE_OK(reader->Send(leaver_id, Frame(reader_id, leaver_id, 0, small.size()), small.data(), 1,
                          small.size()));
  const std::vector<std::byte> large = testing::Pattern(kLarge, 2);
  REQUIRE_OK(
      leaver->Send(reader_id, Frame(leaver_id, reader_id, 0, kLarge), large.data(), 1, kLarge));

  // The leaver shuts down and closes (is destroyed) at once; the reader
  // starts reading only 100 ms later.
  auto left = std::async(std::launch::async, [&leaver] {
    leaver->Shutdown();
    leaver.reset();
  });
  absl::SleepFor(absl::Milliseconds(100));
  std::vector<std::vector<std::byte>> landed(1, std::vector<std::byte>(kLarge));
  testing::BufferSink sink(&landed);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (sink.lost.empty() && absl::Now() < deadline) {
    REQUIRE_OK(reader->Poll(sink, absl::Milliseconds(1)));
  }
  left.get();
  const std::vector<std::string> bad = WarningsAndErrors(capture.Finish());
  for (const std::string& line : bad) UNSCOPED_INFO(line);
  CHECK(bad.empty());
  REQUIRE(sink.lost.size() == 1);
  CHECK(sink.lost[0] == leaver_id);
  INFO("the reader saw: " << sink.reasons[0].ToString());
  CHECK(sink.reasons[0].code() == absl::StatusCode::kCancelled);
  REQUIRE(sink.delivered.size() == 1);
  CHECK_OK(sink.statuses[0]);
  CHECK(std::memcmp(landed[0].data(), large.data(), kLarge) == 0);
}

TEST_CASE(
    "tcp shutdown: a peer that never reads or never closes its end does not hold Shutdown past "
    "its bound and is named",
    "[tcp][shutdown]") {
  // Never reads: a frame larger than the buffers stays queued. Never closes:
  // a small one fits, the goodbye goes out, and the peer never answers it.
  const bool reads = GENERATE(false, true);
  INFO((reads ? "the frame fits: the peer never closes its end" : "the peer never reads"));
  const absl::Duration bound = absl::Milliseconds(800);
  testing::StderrCapture capture("tcp_shutdown_silent");
  absl::StatusOr<testing::TcpPair> pair = Connect(bound);
  REQUIRE_OK(pair.status());
  testing::TcpPair& p = *pair;
  const size_t bytes = reads ? 1024 : kLarge;
  REQUIRE_OK(tcp::SetSocketBuffersForTesting(*p.server, p.w, kSmallBuffers));
  REQUIRE_OK(tcp::SetSocketBuffersForTesting(*p.worker, p.s, kSmallBuffers));
  const std::vector<std::byte> payload = testing::Pattern(bytes, 3);
  REQUIRE_OK(p.server->Send(p.w, Frame(p.s, p.w, 0, bytes), payload.data(), 1, bytes));
  const absl::Time start = absl::Now();
  p.server->Shutdown();
  const absl::Duration took = absl::Now() - start;
  const std::string log = capture.Finish();
  INFO("Shutdown took " << absl::FormatDuration(took) << "; log:\n" << log);
  CHECK(took >= bound - absl::Milliseconds(50));  // it waited for the peer
  CHECK(took < bound + absl::Seconds(1));         // and not longer than its bound
  const std::vector<std::string> bad = WarningsAndErrors(log);
  REQUIRE(bad.size() == 1);
  CHECK(absl::StrContains(bad[0], "worker 0"));
  CHECK(absl::StrContains(bad[0], reads ? "did not close its end" : "did not read its socket"));
}

}  // namespace
}  // namespace stepmesh
