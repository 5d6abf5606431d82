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

// Lands frame i (its request_id) in buffer i; records deliveries and losses.
class RecordingSink final : public core::TransportSink {
 public:
  explicit RecordingSink(std::vector<std::vector<std::byte>>* buffers) : buffers_(buffers) {}
  absl::Status Resolve(NodeId, const FrameHeader& header, core::Destination& out,
                       core::FrameContext*) override {
    if (header.request_id >= buffers_->size()) return absl::OutOfRangeError("no buffer");
    auto& b = (*buffers_)[header.request_id];
    out.data = b.data();
    out.capacity = b.size();
    return absl::OkStatus();
  }
  void OnFrame(NodeId, const FrameHeader& header, core::FrameContext,
               absl::Status status) override {
    delivered.push_back(header.request_id);
    statuses.push_back(std::move(status));
  }
  void OnPeerLost(NodeId peer, absl::Status why) override {
    lost.push_back(peer);
    reasons.push_back(std::move(why));
  }
  std::vector<uint64_t> delivered;
  std::vector<absl::Status> statuses;
  std::vector<NodeId> lost;
  std::vector<absl::Status> reasons;

 private:
  std::vector<std::vector<std::byte>>* buffers_;
};

struct Pair {
  std::unique_ptr<core::Transport> server;
  std::unique_ptr<core::Transport> worker;
  NodeId s = core::ServerId(0);
  NodeId w = core::WorkerId(0);
};

absl::StatusOr<Pair> Connect(absl::Duration timeout) {
  Pair p;
  STEPMESH_ASSIGN_OR_RETURN(p.server, tcp::CreateTcpTransport(Options(timeout)));
  STEPMESH_ASSIGN_OR_RETURN(p.worker, tcp::CreateTcpTransport(Options(timeout)));
  STEPMESH_ASSIGN_OR_RETURN(std::string server_at, p.server->LocalEndpoint());
  STEPMESH_ASSIGN_OR_RETURN(std::string worker_at, p.worker->LocalEndpoint());
  auto accepted = std::async(std::launch::async, [&] {
    const core::PeerInfo peer{p.w, worker_at};
    return p.server->Connect(p.s, {&peer, 1}, absl::Now() + absl::Seconds(5));
  });
  const core::PeerInfo peer{p.s, server_at};
  absl::Status dialled = p.worker->Connect(p.w, {&peer, 1}, absl::Now() + absl::Seconds(5));
  absl::Status accepted_status = accepted.get();
  STEPMESH_RETURN_IF_ERROR(dialled);
  STEPMESH_RETURN_IF_ERROR(accepted_status);
  return p;
}

std::vector<std::byte> Pattern(size_t bytes, uint64_t seed) {
  std::vector<std::byte> out(bytes);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < bytes; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    out[i] = static_cast<std::byte>(x);
  }
  return out;
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
  absl::StatusOr<Pair> pair = Connect(absl::Seconds(10));
  REQUIRE_OK(pair.status());
  Pair& p = *pair;
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
  const std::vector<std::byte> small = Pattern(256, 1);
  REQUIRE_OK(reader->Send(leaver_id, Frame(reader_id, leaver_id, 0, small.size()), small.data(), 1,
                          small.size()));
  const std::vector<std::byte> large = Pattern(kLarge, 2);
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
  RecordingSink sink(&landed);
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
  absl::StatusOr<Pair> pair = Connect(bound);
  REQUIRE_OK(pair.status());
  Pair& p = *pair;
  const size_t bytes = reads ? 1024 : kLarge;
  REQUIRE_OK(tcp::SetSocketBuffersForTesting(*p.server, p.w, kSmallBuffers));
  REQUIRE_OK(tcp::SetSocketBuffersForTesting(*p.worker, p.s, kSmallBuffers));
  const std::vector<std::byte> payload = Pattern(bytes, 3);
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
