// A worker's TCP transport dials its servers side by side, a few at a time
// (src/transport/tcp_fallback/tcp_connections.cc): the connects and the
// authenticated handshakes overlap, so a mesh does not form in the sum of
// every server's answer time. The servers here are plain sockets on
// 127.0.0.1 that answer with the acceptor's side of the real handshake
// (core::AcceptHandshake) after a delay, refuse, stay silent or start late.

#include <sys/socket.h>

#include <catch2/catch.hpp>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/net.h"
#include "src/core/handshake.h"
#include "src/core/protocol.h"
#include "src/core/transport.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

using core::kNoNode;
using core::NodeId;

constexpr char kToken[] = "dial-test-token";

MeshOptions WorkerOptions(int servers) {
  MeshOptions o;
  o.transport = "tcp";
  o.timeout = absl::Seconds(10);
  o.num_workers = 1;
  o.num_servers = servers;
  o.auth_token = kToken;
  return o;
}

// One server's listener; Serve() answers the first connection on a thread.
struct FakeServer {
  NodeId id = kNoNode;
  base::UniqueFd listener;
  std::string endpoint;
  std::future<base::UniqueFd> served;  // the accepted connection, kept open

  // Waits `delay` after accepting, then runs the acceptor's handshake
  // expecting `expected` (a refusal when the dialler is not it); `answer`
  // false: never says anything.
  void Serve(absl::Duration delay, NodeId expected, bool answer = true) {
    served = std::async(std::launch::async, [this, delay, expected, answer] {
      const absl::Time deadline = absl::Now() + absl::Seconds(20);
      absl::StatusOr<base::UniqueFd> fd = base::AcceptTcp(listener.get(), deadline);
      if (!fd.ok()) return base::UniqueFd();
      absl::SleepFor(delay);
      if (answer) {
        (void)core::AcceptHandshake(fd->get(), id, {&expected, 1}, kToken, deadline);
      }
      return *std::move(fd);
    });
  }
};

std::vector<FakeServer> Listen(int n) {
  std::vector<FakeServer> servers(static_cast<size_t>(n));
  for (size_t i = 0; i < servers.size(); ++i) {
    FakeServer& s = servers[i];
    s.id = core::ServerId(static_cast<uint32_t>(i));
    absl::StatusOr<base::UniqueFd> l = base::ListenTcp("127.0.0.1", 0);
    REQUIRE_OK(l.status());
    s.listener = *std::move(l);
    absl::StatusOr<uint16_t> port = base::LocalPort(s.listener.get());
    REQUIRE_OK(port.status());
    s.endpoint = absl::StrCat("127.0.0.1:", *port);
  }
  return servers;
}

std::vector<core::PeerInfo> PeersOf(const std::vector<FakeServer>& servers) {
  std::vector<core::PeerInfo> peers;
  for (size_t i = 0; i < servers.size(); ++i) {
    peers.push_back(core::PeerInfo{servers[i].id, servers[i].endpoint});
  }
  return peers;
}

TEST_CASE("tcp dial: a worker dials its servers side by side when each answers 300 ms late") {
  constexpr int kServers = 8;
  constexpr absl::Duration kDelay = absl::Milliseconds(300);
  std::vector<FakeServer> servers = Listen(kServers);
  const NodeId self = core::WorkerId(0);
  for (FakeServer& s : servers) s.Serve(kDelay, self);
  absl::StatusOr<std::unique_ptr<core::Transport>> worker =
      tcp::CreateTcpTransport(WorkerOptions(kServers));
  REQUIRE_OK(worker.status());
  const std::vector<core::PeerInfo> peers = PeersOf(servers);
  const absl::Time start = absl::Now();
  REQUIRE_OK((*worker)->Connect(self, peers, start + absl::Seconds(20)));
  const absl::Duration took = absl::Now() - start;
  // One after another, the eight waits alone are 2.4 s; four at a time, 0.6 s.
  INFO("Connect took " << absl::FormatDuration(took));
  CHECK(took >= kDelay);
  CHECK(took < 4 * kDelay);
  for (FakeServer& s : servers) CHECK(s.served.get().valid());
}

TEST_CASE("tcp dial: a refusing server fails the dial naming it") {
  std::vector<FakeServer> servers = Listen(4);
  const NodeId self = core::WorkerId(0);
  for (size_t i = 0; i < servers.size(); ++i) {
    // Server 2 expects another worker, so it refuses this one.
    servers[i].Serve(absl::ZeroDuration(), i == 2 ? core::WorkerId(5) : self);
  }
  absl::StatusOr<std::unique_ptr<core::Transport>> worker =
      tcp::CreateTcpTransport(WorkerOptions(4));
  REQUIRE_OK(worker.status());
  const absl::Status dialled =
      (*worker)->Connect(self, PeersOf(servers), absl::Now() + absl::Seconds(20));
  INFO(dialled.ToString());
  CHECK(absl::IsPermissionDenied(dialled));
  CHECK(absl::StrContains(dialled.message(), "server 2"));
}

TEST_CASE("tcp dial: a silent server ends the dial at its deadline naming it") {
  std::vector<FakeServer> servers = Listen(3);
  const NodeId self = core::WorkerId(0);
  servers[0].Serve(absl::ZeroDuration(), self);
  servers[1].Serve(absl::ZeroDuration(), self, /*answer=*/false);
  servers[2].Serve(absl::ZeroDuration(), self);
  absl::StatusOr<std::unique_ptr<core::Transport>> worker =
      tcp::CreateTcpTransport(WorkerOptions(3));
  REQUIRE_OK(worker.status());
  const absl::Time start = absl::Now();
  const absl::Status dialled =
      (*worker)->Connect(self, PeersOf(servers), start + absl::Milliseconds(400));
  const absl::Duration took = absl::Now() - start;
  INFO(dialled.ToString() << " after " << absl::FormatDuration(took));
  CHECK(absl::IsDeadlineExceeded(dialled));
  CHECK(absl::StrContains(dialled.message(), "server 1"));
  CHECK_FALSE(absl::StrContains(dialled.message(), "server 0"));
  CHECK(took < absl::Seconds(5));
}

TEST_CASE("tcp dial: a server whose listener comes up late is dialled again until it answers") {
  std::vector<FakeServer> servers = Listen(2);
  // Server 1's port, closed for now: its connects are refused.
  const std::string late_endpoint = servers[1].endpoint;
  servers[1].listener.Reset();
  const NodeId self = core::WorkerId(0);
  servers[0].Serve(absl::ZeroDuration(), self);
  absl::StatusOr<std::unique_ptr<core::Transport>> worker =
      tcp::CreateTcpTransport(WorkerOptions(2));
  REQUIRE_OK(worker.status());
  std::vector<core::PeerInfo> peers = PeersOf(servers);
  peers[1].endpoint = late_endpoint;
  auto dialled = std::async(std::launch::async, [&] {
    return (*worker)->Connect(self, peers, absl::Now() + absl::Seconds(20));
  });
  absl::SleepFor(absl::Milliseconds(150));
  absl::StatusOr<base::HostPort> at = base::ParseHostPort(late_endpoint);
  REQUIRE_OK(at.status());
  absl::StatusOr<base::UniqueFd> l = base::ListenTcp("127.0.0.1", at->port);
  REQUIRE_OK(l.status());  // the port is ours again (nothing else binds it in 150 ms)
  servers[1].listener = *std::move(l);
  servers[1].Serve(absl::ZeroDuration(), self);
  REQUIRE_OK(dialled.get());
  for (FakeServer& s : servers) CHECK(s.served.get().valid());
}

}  // namespace
}  // namespace stepmesh
