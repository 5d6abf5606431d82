// TCP rails in one process over two loopback addresses (127.0.0.1 and
// 127.0.0.2 are both on lo): a worker and a server transport with two rails
// each, frames around the stripe threshold and at 1.75 MiB byte-exact, the
// pieces really on both rails, a rail shut mid-transfer (every frame still
// delivered exactly once, in order, every byte checked) and the peer lost
// only with its last rail. docs/tcp.md describes the protocol.

#include <catch2/catch.hpp>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/core/protocol.h"
#include "src/core/transport.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "stepmesh/status.h"
#include "tests/support/status.h"
#include "tests/transport/tcp_pair.h"

namespace stepmesh {
namespace {

using core::FrameHeader;
using core::NodeId;
using testing::BufferSink;
using testing::Pattern;
using testing::TcpPair;

constexpr size_t kStripeMin = 256 << 10;
constexpr size_t kReply = 1835008;  // 1.75 MiB

MeshOptions RailOptions(const std::string& rails) {
  MeshOptions o;
  o.transport = "tcp";
  o.timeout = absl::Seconds(5);
  o.num_workers = 1;
  o.num_servers = 1;
  o.tcp_rails = rails;
  o.tcp_stripe_min_bytes = kStripeMin;
  return o;
}

absl::StatusOr<TcpPair> Connect(const std::string& server_rails, const std::string& worker_rails) {
  return testing::ConnectTcpPair(RailOptions(server_rails), RailOptions(worker_rails));
}

FrameHeader Push(const TcpPair& p, uint64_t id, size_t bytes) {
  FrameHeader h;
  h.type = core::FrameType::kPush;
  h.src = p.w;
  h.dst = p.s;
  h.key = 7;
  h.request_id = id;
  h.payload_bytes = bytes;
  h.part_count = 1;
  return h;
}

// Polls both ends until the server delivered `frames` or lost its peer.
void PollUntil(TcpPair& p, BufferSink& server_sink, BufferSink& worker_sink, size_t frames,
               absl::Duration within) {
  const absl::Time deadline = absl::Now() + within;
  while (server_sink.delivered.size() < frames && server_sink.lost.empty() &&
         absl::Now() < deadline) {
    REQUIRE_OK(p.server->Poll(server_sink, absl::Milliseconds(1)));
    REQUIRE_OK(p.worker->Poll(worker_sink, absl::ZeroDuration()));
  }
}

TEST_CASE("tcp rails: frames around the stripe threshold and 1.75 MiB are byte-exact over 2 rails",
          "[rails]") {
  absl::StatusOr<TcpPair> pair = Connect("127.0.0.1,127.0.0.2", "127.0.0.1,127.0.0.2");
  REQUIRE_OK(pair.status());
  TcpPair& p = *pair;
  const std::vector<size_t> sizes = {
      0, 1, 4095, kStripeMin - 1, kStripeMin, kStripeMin + 1, kReply, kReply + 3};
  std::vector<std::vector<std::byte>> sources;
  std::vector<std::vector<std::byte>> landed;
  for (size_t i = 0; i < sizes.size(); ++i) {
    sources.push_back(Pattern(sizes[i], i + 1));
    landed.emplace_back(sizes[i] + 64, std::byte{0});
  }
  BufferSink server_sink(&landed);
  std::vector<std::vector<std::byte>> none;
  BufferSink worker_sink(&none);
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::vector<uint64_t> before = *tcp::RailBytesForTesting(*p.worker, p.s);
    REQUIRE_OK(p.worker->Send(p.s, Push(p, i, sizes[i]), sources[i].data(), 1, sizes[i]));
    PollUntil(p, server_sink, worker_sink, i + 1, absl::Seconds(10));
    REQUIRE(server_sink.delivered.size() == i + 1);
    CHECK(server_sink.delivered[i] == i);
    CHECK_OK(server_sink.statuses[i]);
    INFO("size " << sizes[i]);
    CHECK(std::memcmp(landed[i].data(), sources[i].data(), sizes[i]) == 0);
    // Nothing past the payload was written.
    for (size_t b = sizes[i]; b < landed[i].size(); ++b) CHECK(landed[i][b] == std::byte{0});
    // Striped frames left on both rails; smaller ones whole on one.
    const std::vector<uint64_t> after = *tcp::RailBytesForTesting(*p.worker, p.s);
    REQUIRE(after.size() == 2);
    const uint64_t on0 = after[0] - before[0];
    const uint64_t on1 = after[1] - before[1];
    CHECK(on0 + on1 == sizes[i]);
    if (sizes[i] >= kStripeMin) {
      CHECK(on0 > 0);
      CHECK(on1 > 0);
    } else {
      CHECK(on1 == 0);
    }
  }
  CHECK(server_sink.lost.empty());
  CHECK(worker_sink.lost.empty());
}

TEST_CASE("tcp rails: a peer with one rail meets one with two on the common count", "[rails]") {
  absl::StatusOr<TcpPair> pair = Connect("127.0.0.1,127.0.0.2", "127.0.0.1");
  REQUIRE_OK(pair.status());
  TcpPair& p = *pair;
  std::vector<std::byte> source = Pattern(kReply, 9);
  std::vector<std::vector<std::byte>> landed(1, std::vector<std::byte>(kReply));
  BufferSink server_sink(&landed);
  std::vector<std::vector<std::byte>> none;
  BufferSink worker_sink(&none);
  REQUIRE_OK(p.worker->Send(p.s, Push(p, 0, kReply), source.data(), 1, kReply));
  PollUntil(p, server_sink, worker_sink, 1, absl::Seconds(10));
  REQUIRE(server_sink.delivered.size() == 1);
  CHECK(landed[0] == source);
  CHECK(tcp::RailBytesForTesting(*p.worker, p.s)->size() == 1);
}

TEST_CASE(
    "tcp rails: a rail shut mid-transfer moves its traffic to the other rail and every "
    "frame arrives once",
    "[rails]") {
  const int dead = GENERATE(0, 1);
  INFO("rail " << dead << " is shut");
  absl::StatusOr<TcpPair> pair = Connect("127.0.0.1,127.0.0.2", "127.0.0.1,127.0.0.2");
  REQUIRE_OK(pair.status());
  TcpPair& p = *pair;
  constexpr size_t kFrames = 24;
  std::vector<std::vector<std::byte>> sources;
  std::vector<std::vector<std::byte>> landed;
  for (size_t i = 0; i < kFrames; ++i) {
    // Striped replies and small frames between them.
    const size_t bytes = i % 3 == 2 ? 1000 + i : kReply;
    sources.push_back(Pattern(bytes, 100 + i));
    landed.emplace_back(bytes, std::byte{0});
  }
  BufferSink server_sink(&landed);
  std::vector<std::vector<std::byte>> none;
  BufferSink worker_sink(&none);
  for (size_t i = 0; i < kFrames; ++i) {
    REQUIRE_OK(p.worker->Send(p.s, Push(p, i, sources[i].size()), sources[i].data(), 1,
                              sources[i].size()));
  }
  // Some frames in, most still in the queues and the sockets: the rail goes.
  PollUntil(p, server_sink, worker_sink, 3, absl::Seconds(10));
  REQUIRE(server_sink.delivered.size() >= 3);
  REQUIRE(server_sink.delivered.size() < kFrames);
  REQUIRE_OK(tcp::ShutdownRailForTesting(*p.worker, p.s, dead));
  PollUntil(p, server_sink, worker_sink, kFrames, absl::Seconds(20));
  CHECK(server_sink.lost.empty());
  CHECK(worker_sink.lost.empty());
  REQUIRE(server_sink.delivered.size() == kFrames);
  for (size_t i = 0; i < kFrames; ++i) {
    INFO("frame " << i);
    CHECK(server_sink.delivered[i] == i);  // once each, in order
    CHECK_OK(server_sink.statuses[i]);
    CHECK(landed[i] == sources[i]);
  }
  // More traffic after the failover goes on the rail that is left.
  std::vector<std::byte> more = Pattern(kReply, 999);
  landed.emplace_back(kReply, std::byte{0});
  REQUIRE_OK(p.worker->Send(p.s, Push(p, kFrames, kReply), more.data(), 1, kReply));
  PollUntil(p, server_sink, worker_sink, kFrames + 1, absl::Seconds(10));
  REQUIRE(server_sink.delivered.size() == kFrames + 1);
  CHECK(landed[kFrames] == more);
}

TEST_CASE("tcp rails: the peer is lost only with its last rail and only once", "[rails]") {
  absl::StatusOr<TcpPair> pair = Connect("127.0.0.1,127.0.0.2", "127.0.0.1,127.0.0.2");
  REQUIRE_OK(pair.status());
  TcpPair& p = *pair;
  std::vector<std::vector<std::byte>> landed(2, std::vector<std::byte>(64));
  BufferSink server_sink(&landed);
  std::vector<std::vector<std::byte>> none;
  BufferSink worker_sink(&none);
  REQUIRE_OK(tcp::ShutdownRailForTesting(*p.worker, p.s, 1));
  const absl::Time settle = absl::Now() + absl::Milliseconds(300);
  while (absl::Now() < settle) {
    REQUIRE_OK(p.server->Poll(server_sink, absl::Milliseconds(1)));
    REQUIRE_OK(p.worker->Poll(worker_sink, absl::ZeroDuration()));
  }
  CHECK(server_sink.lost.empty());
  CHECK(worker_sink.lost.empty());
  std::vector<std::byte> small = Pattern(64, 5);
  REQUIRE_OK(p.worker->Send(p.s, Push(p, 0, 64), small.data(), 1, 64));
  PollUntil(p, server_sink, worker_sink, 1, absl::Seconds(5));
  REQUIRE(server_sink.delivered.size() == 1);
  CHECK(landed[0] == small);
  REQUIRE_OK(tcp::ShutdownRailForTesting(*p.worker, p.s, 0));
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while ((server_sink.lost.empty() || worker_sink.lost.empty()) && absl::Now() < deadline) {
    REQUIRE_OK(p.server->Poll(server_sink, absl::Milliseconds(1)));
    REQUIRE_OK(p.worker->Poll(worker_sink, absl::ZeroDuration()));
  }
  REQUIRE(server_sink.lost.size() == 1);
  CHECK(server_sink.lost[0] == p.w);
  REQUIRE(worker_sink.lost.size() == 1);
  CHECK(worker_sink.lost[0] == p.s);
  CHECK_STATUS(p.worker->Send(p.s, Push(p, 1, 64), small.data(), 1, 64), kUnavailable);
}

TEST_CASE("tcp rails: a bad rail list is refused naming the entry", "[rails]") {
  absl::StatusOr<std::unique_ptr<core::Transport>> t =
      tcp::CreateTcpTransport(RailOptions("127.0.0.1,no-such-interface0"));
  CHECK_STATUS(t.status(), kInvalidArgument);
  CHECK(absl::StrContains(t.status().message(), "no-such-interface0"));
  t = tcp::CreateTcpTransport(RailOptions("127.0.0.1,127.0.0.1"));
  CHECK_STATUS(t.status(), kInvalidArgument);
  t = tcp::CreateTcpTransport(RailOptions("127.0.0.1,127.0.0.2,127.0.0.3,127.0.0.4,127.0.0.5"));
  CHECK_STATUS(t.status(), kInvalidArgument);
}

}  // namespace
}  // namespace stepmesh
