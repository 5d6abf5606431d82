// The pieces that keep one connection from stalling a mesh, on their own:
// control messages reassembled from any split, the acceptor's handshake as a
// state machine, per-peer send queues, descriptors closed once per lost
// connection, the mesh shape checked at the join, frames of the wrong type
// answered, and loss messages with a single prefix. The same properties
// against real processes: tests/hostile/.

#include <sys/socket.h>

#include <catch2/catch.hpp>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "src/base/net.h"
#include "src/compose/transports.h"
#include "src/core/control_message.h"
#include "src/core/handshake.h"
#include "src/core/protocol.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "stepmesh/scheduler.h"
#include "stepmesh/status.h"
#include "tests/reliability/harness.h"
#include "tests/support/forwarding_transport.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

using testing::Harness;
using testing::HarnessConfig;
using testing::OpenFdCount;

absl::Span<const std::byte> Bytes(const std::string& s) {
  return absl::MakeConstSpan(reinterpret_cast<const std::byte*>(s.data()), s.size());
}

core::ControlMessage SampleJoin() {
  core::ControlMessage join;
  join.type = core::ControlType::kJoin;
  join.role = static_cast<uint8_t>(Role::kServer);
  join.rank = 1;
  join.text = "10.0.0.7:4242";
  join.num_workers = 3;
  join.num_servers = 2;
  join.mesh_id = "step3-prod";
  join.join_flags = core::kJoinResume;
  join.sequence = 17;
  join.barrier_released = 16;
  return join;
}

TEST_CASE("hardening: control messages are reassembled from any split of the stream",
          "[hardening]") {
  core::ControlMessage ping;
  ping.type = core::ControlType::kPing;
  ping.sequence = 99;
  const std::string stream = core::EncodeControl(SampleJoin()) + core::EncodeControl(ping);
  for (size_t cut = 0; cut <= stream.size(); ++cut) {
    core::ControlAssembler in;
    in.Feed(Bytes(stream.substr(0, cut)));
    std::vector<core::ControlMessage> got;
    auto drain = [&] {
      for (;;) {
        auto m = in.Next();
        REQUIRE_OK(m);
        if (!m->has_value()) return;
        got.push_back(**m);
      }
    };
    drain();
    in.Feed(Bytes(stream.substr(cut)));
    drain();
    REQUIRE(got.size() == 2);
    CHECK(got[0].mesh_id == "step3-prod");
    CHECK(got[0].num_workers == 3);
    CHECK(got[0].num_servers == 2);
    CHECK(got[0].join_flags == core::kJoinResume);
    CHECK(got[0].sequence == 17);
    CHECK(got[0].barrier_released == 16);
    CHECK(got[1].sequence == 99);
    CHECK(in.buffered() == 0);
  }
}

TEST_CASE("hardening: a control stream of garbage or of a huge claim is refused at its header",
          "[hardening]") {
  core::ControlAssembler garbage;
  garbage.Feed(Bytes(std::string(12, 'G')));
  CHECK_STATUS(garbage.Next().status(), kDataLoss);

  // A claim above the limit is refused before any payload byte arrives.
  core::ControlAssembler small(4096);
  std::string header = core::EncodeControl(SampleJoin()).substr(0, core::kControlHeaderBytes);
  header[8] = '\x00';
  header[9] = '\x00';
  header[10] = '\x01';  // 65536 bytes
  header[11] = '\x00';
  small.Feed(Bytes(header));
  CHECK_STATUS(small.Next().status(), kOutOfRange);
}

// Runs an acceptor handshake on bytes fed `step` at a time; returns the verdict bytes.
std::string FeedHello(core::HandshakeAcceptor& acceptor, const std::string& hello, size_t step) {
  for (size_t i = 0; i < hello.size() && acceptor.step() == core::HandshakeAcceptor::Step::kRead;
       i += step) {
    acceptor.Received(Bytes(hello.substr(i, std::min(step, acceptor.wanted()))));
  }
  return acceptor.TakeOutput();
}

std::string Hello(core::NodeId from) {
  std::string hello(core::kHelloBytes, '\0');
  const uint32_t fields[4] = {0x49484D53, core::kFrameVersion, from, 0};
  std::memcpy(hello.data(), fields, sizeof(fields));
  return hello;
}

TEST_CASE("hardening: the acceptor's handshake waits for bytes, decides, refuses", "[hardening]") {
  SECTION("a hello a byte at a time, then admitted") {
    core::HandshakeAcceptor acceptor("");
    FeedHello(acceptor, Hello(core::WorkerId(1)), 1);
    REQUIRE(acceptor.step() == core::HandshakeAcceptor::Step::kDecide);
    CHECK(acceptor.claimed() == core::WorkerId(1));
    acceptor.Decide(core::ServerId(0), absl::OkStatus());
    CHECK(acceptor.step() == core::HandshakeAcceptor::Step::kDone);
    CHECK(acceptor.TakeOutput() == "SMOK");
  }
  SECTION("bad magic is refused with a verdict, not silence") {
    core::HandshakeAcceptor acceptor("");
    std::string hello = Hello(core::WorkerId(0));
    hello[0] = 'X';
    CHECK(FeedHello(acceptor, hello, 7) == "SMNO");
    CHECK(acceptor.step() == core::HandshakeAcceptor::Step::kRefused);
  }
  SECTION("a secret the dialler lacks") {
    core::HandshakeAcceptor acceptor("k");
    FeedHello(acceptor, Hello(core::WorkerId(0)), 48);
    acceptor.Decide(core::ServerId(0), absl::OkStatus());
    CHECK(acceptor.step() == core::HandshakeAcceptor::Step::kRefused);
    CHECK(absl::StrContains(acceptor.refusal().message(), "did not authenticate"));
    CHECK(acceptor.TakeOutput() == "SMNO");
  }
  SECTION("withdrawn after its deadline") {
    core::HandshakeAcceptor acceptor("");
    acceptor.Received(Bytes(Hello(core::WorkerId(0)).substr(0, 10)));
    acceptor.Withdraw(absl::DeadlineExceededError("too slow"));
    CHECK(acceptor.step() == core::HandshakeAcceptor::Step::kRefused);
    CHECK(acceptor.TakeOutput() == "SMNO");
  }
}

TEST_CASE("hardening: a loss is named once", "[hardening]") {
  const core::NodeId s1 = core::ServerId(1);
  CHECK(core::PeerLossMessage(s1, "closed its connection") ==
        "server 1 lost: closed its connection");
  CHECK(core::PeerLossMessage(s1, "server 1 closed its connection") ==
        "server 1 lost: closed its connection");
  CHECK(core::PeerLossMessage(s1, "server 1 lost: server 1 lost: connection closed by peer") ==
        "server 1 lost: connection closed by peer");
  CHECK(core::PeerLossMessage(s1, "server 10 left") == "server 1 lost: server 10 left");
}

MeshOptions Shape(int workers, int servers) {
  MeshOptions o;
  o.transport = "tcp";
  o.timeout = absl::Seconds(3);
  o.num_workers = workers;
  o.num_servers = servers;
  return o;
}

TEST_CASE("hardening: a participant of another mesh shape or id is refused, naming both values",
          "[hardening]") {
  MeshOptions o = Shape(1, 2);
  o.mesh_id = "blue";
  auto scheduler = testing::StartLoopbackScheduler(o);
  REQUIRE_OK(scheduler);
  SECTION("num_servers") {
    MeshOptions w = o;
    w.num_servers = 1;
    auto worker = AFTensorWorker::Create(w);
    INFO(worker.status().ToString());
    CHECK(absl::IsPermissionDenied(worker.status()));
    CHECK(absl::StrContains(worker.status().message(), "configured for 1 workers and 1 servers"));
    CHECK(absl::StrContains(worker.status().message(), "this mesh has 1 workers and 2 servers"));
  }
  SECTION("mesh id") {
    MeshOptions w = o;
    w.mesh_id = "green";
    auto worker = AFTensorWorker::Create(w);
    INFO(worker.status().ToString());
    CHECK(absl::IsPermissionDenied(worker.status()));
    CHECK(absl::StrContains(worker.status().message(), "'green'"));
    CHECK(absl::StrContains(worker.status().message(), "'blue'"));
  }
}

// How many of `fds` the other end closed (readable, and recv says end of stream).
int ClosedByPeer(const std::vector<base::UniqueFd>& fds) {
  int closed = 0;
  for (const base::UniqueFd& fd : fds) {
    absl::StatusOr<bool> readable = base::WaitReadable(fd.get(), absl::Now());
    char byte;
    if (readable.ok() && *readable && ::recv(fd.get(), &byte, 1, MSG_DONTWAIT) == 0) ++closed;
  }
  return closed;
}

TEST_CASE("hardening: a large mesh joining at once from one host is not evicted as a flood",
          "[hardening]") {
  // 40 workers and 8 servers on one host, all dialling the scheduler at once
  // on a loaded machine: each join is still in flight (here: not sent yet)
  // when the next connections arrive. The admission caps must leave room for
  // every participant of the mesh (before: 16 per address, so 24 of these
  // were dropped and never retried their join), and still evict beyond that.
  MeshOptions o = Shape(40, 8);
  auto scheduler = testing::StartLoopbackScheduler(o);
  REQUIRE_OK(scheduler);
  absl::StatusOr<base::HostPort> at = base::ParseHostPort(o.scheduler);
  REQUIRE_OK(at);
  const int participants = o.num_workers + o.num_servers;
  std::vector<base::UniqueFd> joiners;
  for (int i = 0; i < participants; ++i) {
    absl::StatusOr<base::UniqueFd> fd = base::ConnectTcp(*at, absl::Now() + absl::Seconds(3));
    REQUIRE_OK(fd);
    joiners.push_back(*std::move(fd));
  }
  // Until the scheduler accepted them all (bounded).
  const absl::Time settle = absl::Now() + absl::Milliseconds(500);
  while (absl::Now() < settle) absl::SleepFor(absl::Milliseconds(20));
  CHECK(ClosedByPeer(joiners) == 0);
  // Strangers beyond the mesh and the slack: the oldest waiting ones go.
  std::vector<base::UniqueFd> strangers;
  for (int i = 0; i < 40; ++i) {
    absl::StatusOr<base::UniqueFd> fd = base::ConnectTcp(*at, absl::Now() + absl::Seconds(3));
    REQUIRE_OK(fd);
    strangers.push_back(*std::move(fd));
  }
  const absl::Time evicted_by = absl::Now() + absl::Seconds(3);
  int evicted = 0;
  while ((evicted = ClosedByPeer(joiners)) == 0 && absl::Now() < evicted_by) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  CHECK(evicted > 0);
}

// Turns the worker's next push into a frame of the reply type.
class WrongTypeOnce : public testing::ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;
  absl::Status Send(core::NodeId peer, const core::FrameHeader& header, const void* src,
                    core::RegionId region, size_t bytes) override {
    core::FrameHeader h = header;
    if (h.type == core::FrameType::kPush && armed.exchange(false)) {
      h.type = core::FrameType::kReply;
      h.part_index = h.part_count = 0;
    }
    return ForwardingTransport::Send(peer, h, src, region, bytes);
  }
  std::atomic<bool> armed{false};
};

TEST_CASE("hardening: a frame of the wrong type is answered with an error and claims nothing",
          "[hardening]") {
  WrongTypeOnce* wrong = nullptr;
  HarnessConfig c;
  c.workers = 1;
  c.servers = 1;
  c.options = Shape(1, 1);
  Harness mesh(c, [&](const MeshOptions& o) -> absl::StatusOr<std::unique_ptr<core::Transport>> {
    STEPMESH_ASSIGN_OR_RETURN(auto inner, compose::CreateTransport(o));
    if (o.role != Role::kWorker) return inner;
    auto t = std::make_unique<WrongTypeOnce>(std::move(inner));
    wrong = t.get();
    return t;
  });
  REQUIRE_OK(mesh.status());
  REQUIRE_OK(mesh.RoundTrip(0, 0, 1));
  wrong->armed = true;
  auto handle = mesh.Start(0, 0, 2);
  REQUIRE_OK(handle);
  // Answered: the request fails at once (not at its deadline), naming the type.
  const absl::Status failed = mesh.worker(0).Wait(*handle, absl::Seconds(2));
  INFO(failed.ToString());
  CHECK_STATUS(failed, kInvalidArgument);
  CHECK(absl::StrContains(failed.message(), "not frame type 2"));
  // Nothing stayed claimed: the same key goes through again.
  for (int i = 0; i < 3; ++i) CHECK_OK(mesh.RoundTrip(0, 0, static_cast<uint8_t>(3 + i)));
}

TEST_CASE("hardening: every lost connection is closed (descriptors stay flat over restarts)",
          "[hardening]") {
  HarnessConfig c;
  c.workers = 2;
  c.servers = 1;
  c.options = Shape(2, 1);
  Harness mesh(c, compose::CreateTransport);
  REQUIRE_OK(mesh.status());
  // A batch waits for both workers: each round is both of them.
  auto round = [&](uint8_t fill) -> absl::Status {
    STEPMESH_ASSIGN_OR_RETURN(RequestHandle h0, mesh.Start(0, 0, fill));
    STEPMESH_ASSIGN_OR_RETURN(RequestHandle h1, mesh.Start(1, 0, fill + 1));
    STEPMESH_RETURN_IF_ERROR(mesh.Finish(0, 0, h0, fill, absl::Seconds(5)));
    return mesh.Finish(1, 0, h1, fill + 1, absl::Seconds(5));
  };
  REQUIRE_OK(round(1));
  REQUIRE_OK(mesh.RestartWorker(1));
  REQUIRE_OK(round(2));
  const int fds = OpenFdCount();
  for (int i = 0; i < 16; ++i) {
    REQUIRE_OK(mesh.RestartWorker(1));
    REQUIRE_OK(round(static_cast<uint8_t>(10 + 2 * i)));
  }
  // The server closes a replaced connection at its receive thread's next poll.
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  while (OpenFdCount() != fds && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  CHECK(OpenFdCount() == fds);
}

// Records what a transport reports.
class RecordingSink : public core::TransportSink {
 public:
  absl::Status Resolve(core::NodeId, const core::FrameHeader&, core::Destination&,
                       core::FrameContext*) override {
    return absl::InvalidArgumentError("not expected");
  }
  void OnFrame(core::NodeId, const core::FrameHeader&, core::FrameContext, absl::Status) override {}
  void OnPeerLost(core::NodeId peer, absl::Status why) override {
    lost.push_back(peer);
    reasons.push_back(std::string(why.message()));
  }
  std::vector<core::NodeId> lost;
  std::vector<std::string> reasons;
};

TEST_CASE("hardening: a peer that stops reading fills only its own queue, then is dropped",
          "[hardening]") {
  MeshOptions o = Shape(2, 1);
  o.timeout = absl::Seconds(1);
  auto server = *tcp::CreateTcpTransport(o);
  std::vector<std::unique_ptr<core::Transport>> workers;
  const std::string endpoint = *server->LocalEndpoint();
  const core::NodeId s = core::ServerId(0);
  auto accepted = std::async(std::launch::async, [&] {
    const core::PeerInfo peers[2] = {{core::WorkerId(0), ""}, {core::WorkerId(1), ""}};
    return server->Connect(s, peers, absl::Now() + absl::Seconds(3));
  });
  for (int w = 0; w < 2; ++w) {
    workers.push_back(*tcp::CreateTcpTransport(o));
    (void)*workers.back()->LocalEndpoint();
    const core::PeerInfo peer{s, endpoint};
    REQUIRE_OK(
        workers.back()->Connect(core::WorkerId(w), {&peer, 1}, absl::Now() + absl::Seconds(3)));
  }
  REQUIRE_OK(accepted.get());

  // Neither worker polls: every frame stays in the kernel, then in the
  // server's queue for it. Send never blocks.
  std::vector<char> payload(1 << 20, 'x');
  core::FrameHeader h;
  h.type = core::FrameType::kReply;
  h.src = s;
  h.dst = core::WorkerId(0);
  h.payload_bytes = payload.size();
  absl::Status sent;
  int frames = 0;
  const absl::Time start = absl::Now();
  while (sent.ok() && frames < 10000) {
    sent = server->Send(h.dst, h, payload.data(), 1, payload.size());
    ++frames;
  }
  INFO(frames << " frames, " << sent.ToString());
  CHECK_STATUS(sent, kResourceExhausted);
  CHECK(absl::StrContains(sent.message(), "worker 0"));
  CHECK(absl::Now() - start < absl::Seconds(1));  // queued, not waited for
  // Worker 1's traffic is not behind worker 0's.
  h.dst = core::WorkerId(1);
  h.payload_bytes = 0;
  CHECK_OK(server->Send(h.dst, h, nullptr, 0, 0));
  // A queue that does not move for the timeout loses its peer, and only it.
  RecordingSink sink;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (sink.lost.empty() && absl::Now() < deadline) {
    REQUIRE_OK(server->Poll(sink, absl::Milliseconds(20)));
  }
  REQUIRE(sink.lost.size() == 1);
  CHECK(sink.lost[0] == core::WorkerId(0));
  CHECK(absl::StrContains(sink.reasons[0], "did not read its socket"));
  CHECK_STATUS(server->Send(core::WorkerId(0), h, nullptr, 0, 0), kUnavailable);
}

}  // namespace
}  // namespace stepmesh
