// The RDMA transport over the fake fabric: two transports in one process, each
// with a receive thread calling Poll, the test thread acting as send thread.

#include "src/transport/rdma/rdma_transport.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/net.h"
#include "src/transport/rdma/verbs_api.h"
#include "src/transport/rdma/verbs_resources.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "tests/rdma/rdma_pair.h"

namespace stepmesh::core {
namespace {

PairConfig Config(int qps = 1, absl::Duration timeout = absl::Seconds(3), int recv_depth = 256,
                  int64_t stripe_min_bytes = 64 << 10, uint8_t lag_ports = 0) {
  PairConfig c;
  c.options.timeout = timeout;
  c.options.rdma.qps_per_peer = qps;
  c.options.rdma.recv_depth = recv_depth;
  c.options.rdma.stripe_min_bytes = stripe_min_bytes;
  c.worker_nic.lag_ports = lag_ports;
  c.server_nic.lag_ports = lag_ports;
  return c;
}

TEST_CASE("rdma: push and reply land byte-exact in the registered slots", "[rdma][transport]") {
  Buffers buf;
  Pair pair;
  Serve(pair, buf);

  PushChecked(pair, buf, 300000, 3);
  auto events = pair.server.sink.WaitFor(1);
  REQUIRE(events.size() == 1);
  CHECK(events[0].header.key == 7);
  CHECK(buf.recv[0] == std::byte{0});  // the other worker's slot is untouched

  ReplyChecked(pair, buf, 4096, 11);

  // An empty reply (an acknowledgement) needs no advert and no payload write.
  REQUIRE(pair.server.transport
              ->Send(kWorker, Header(FrameType::kReply, kServer, kWorker, 12345, 0), nullptr, 0, 0)
              .ok());
  events = pair.worker.sink.WaitFor(2);
  REQUIRE(events.size() == 2);
  CHECK(events[1].status.ok());
  CHECK(pair.fabric.stats().rnr_errors == 0);
  CHECK(pair.fabric.stats().access_errors == 0);
}

TEST_CASE("rdma: error frames carry their message", "[rdma][transport]") {
  Pair pair;
  pair.worker.StartPolling();
  const std::string text = "server 0 cannot serve key 7";
  FrameHeader h = Header(FrameType::kError, kServer, kWorker, 7, text.size());
  h.status_code = static_cast<uint32_t>(absl::StatusCode::kResourceExhausted);
  REQUIRE(pair.server.transport->Send(kWorker, h, text.data(), 0, text.size()).ok());
  auto events = pair.worker.sink.WaitFor(1);
  REQUIRE(events.size() == 1);
  CHECK(events[0].status.code() == absl::StatusCode::kResourceExhausted);
  CHECK(events[0].status.message() == text);
}

TEST_CASE("rdma: a rejected arrival is reported and the next frame still lands",
          "[rdma][transport]") {
  Buffers buf;
  Pair pair;
  RegisterAll(pair, buf);
  pair.server.sink.resolve = [&buf](NodeId, const FrameHeader& h) -> absl::StatusOr<Destination> {
    if (h.request_id == 1) return absl::FailedPreconditionError("dtype mismatch");
    if (h.request_id == 2) return Destination{buf.recv.data(), Buffers::kSlot, 1};  // not its slot
    return Destination{buf.WorkerSlot(), Buffers::kSlot, 1};
  };
  pair.worker.StartPolling();
  pair.server.StartPolling();
  Fill(buf.src.data(), 1000, 5);
  for (uint64_t request : {1, 2, 3}) {
    REQUIRE(pair.worker.transport
                ->Send(kServer, Header(FrameType::kPush, kWorker, kServer, 7, 1000, request),
                       buf.src.data(), 2, 1000)
                .ok());
  }
  auto events = pair.server.sink.WaitFor(3);
  REQUIRE(events.size() == 3);
  CHECK(events[0].status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(events[0].status.message() == "dtype mismatch");
  CHECK(events[1].status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(events[2].status.ok());
  CHECK(Same(buf.WorkerSlot(), 1000, 5));
  CHECK(buf.recv[0] == std::byte{0});
}

TEST_CASE("rdma: sends check the advertised slot and the source region", "[rdma][transport]") {
  Buffers buf;
  Pair pair;
  RegisterAll(pair, buf);
  pair.worker.StartPolling();
  auto too_big = pair.worker.transport->Send(
      kServer, Header(FrameType::kPush, kWorker, kServer, 7, Buffers::kSlot + 1), buf.src.data(), 2,
      Buffers::kSlot + 1);
  CHECK(too_big.code() == absl::StatusCode::kOutOfRange);
  std::vector<std::byte> unregistered(64);
  auto stray = pair.worker.transport->Send(
      kServer, Header(FrameType::kPush, kWorker, kServer, 7, 64), unregistered.data(), 2, 64);
  CHECK(stray.code() == absl::StatusCode::kOutOfRange);
  auto unknown = pair.worker.transport->Send(
      kServer, Header(FrameType::kPush, kWorker, kServer, 7, 64), buf.src.data(), 99, 64);
  CHECK(unknown.code() == absl::StatusCode::kInvalidArgument);
  auto nobody = pair.worker.transport->Send(
      ServerId(5), Header(FrameType::kPush, kWorker, kServer, 7, 64), buf.src.data(), 2, 64);
  CHECK(nobody.code() == absl::StatusCode::kNotFound);
  CHECK(pair.fabric.stats().writes == 0);
}

// The first event of `sink` that is an error frame (not a loss), waiting at most `wait`.
Event FirstError(RecordingSink& sink, absl::Duration wait) {
  const absl::Time until = absl::Now() + wait;
  while (absl::Now() < until) {
    for (const Event& e : sink.events()) {
      if (!e.lost && e.header.type == FrameType::kError) return e;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return Event{};
}

TEST_CASE("rdma: a region registered after Connect is advertised, sends queue for it",
          "[rdma][transport]") {
  Buffers buf;
  Pair pair(Config(1, absl::Milliseconds(400)));
  REQUIRE(pair.worker.transport->RegisterRegion(buf.Src()).ok());
  ResolveToBuffers(pair, buf);
  pair.worker.StartPolling();
  pair.server.StartPolling();
  Fill(buf.src.data(), 512, 9);
  const FrameHeader h = Header(FrameType::kPush, kWorker, kServer, 7, 512, /*request=*/21);
  // Nothing advertised: the send returns at once, the frame waits in the
  // server's outbox, and once options.timeout passed it is dropped and
  // reported as an error frame naming the key -- the connection stays.
  const absl::Time before = absl::Now();
  CHECK(pair.worker.transport->Send(kServer, h, buf.src.data(), 2, 512).ok());
  CHECK(absl::Now() - before < absl::Milliseconds(200));
  const Event refused = FirstError(pair.worker.sink, absl::Seconds(5));
  INFO(refused.status.ToString());
  CHECK(refused.peer == kServer);
  CHECK(refused.header.request_id == 21);
  CHECK(refused.status.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(refused.status.message(), "key 7"));
  CHECK(absl::StrContains(refused.status.message(), "server 0"));
  CHECK(absl::Now() - before >= absl::Milliseconds(400));
  CHECK_FALSE(pair.worker.sink.AnyLoss());
  // Registered while the frame waits: it goes through.
  CHECK(pair.worker.transport->Send(kServer, h, buf.src.data(), 2, 512).ok());
  absl::SleepFor(absl::Milliseconds(50));
  CHECK(pair.server.transport->RegisterRegion(buf.Recv()).ok());
  auto events = pair.server.sink.WaitFor(1);
  REQUIRE(events.size() == 1);
  CHECK(events[0].status.ok());
  CHECK(Same(buf.WorkerSlot(), 512, 9));
  // Withdrawn on unregister: the next send waits again, and is refused.
  REQUIRE(pair.server.transport->UnregisterRegion(1).ok());
  absl::SleepFor(absl::Milliseconds(50));
  const size_t seen = pair.worker.sink.events().size();
  CHECK(pair.worker.transport->Send(kServer, h, buf.src.data(), 2, 512).ok());
  auto after = pair.worker.sink.WaitFor(seen + 1);
  REQUIRE(after.size() == seen + 1);
  CHECK(after.back().status.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(pair.fabric.stats().access_errors == 0);
  CHECK_FALSE(pair.worker.sink.AnyLoss());
}

TEST_CASE("rdma: credits bound what is in flight, no RNR ever", "[rdma][transport]") {
  Buffers buf;
  Pair pair(Config(1, absl::Seconds(5), /*recv_depth=*/8));
  RegisterAll(pair, buf);
  ResolveToBuffers(pair, buf);
  pair.worker.StartPolling();  // reads the adverts; the server does not poll yet
  absl::SleepFor(absl::Milliseconds(50));
  auto send = [&](uint64_t request) {
    return pair.worker.transport->Send(
        kServer, Header(FrameType::kPush, kWorker, kServer, 7, 64, request), buf.src.data(), 2, 64);
  };
  const uint64_t writes_before = pair.fabric.stats().writes;
  for (uint64_t r = 1; r <= 8; ++r) REQUIRE(send(r).ok());
  // Window full: the rest queue for that peer, and Send does not wait.
  const absl::Time before = absl::Now();
  for (uint64_t r = 9; r <= 200; ++r) REQUIRE(send(r).ok());
  CHECK(absl::Now() - before < absl::Seconds(1));
  // The window goes out (once the server's advert is in, and the fabric
  // executed it), and nothing past the credits: a payload write and a frame
  // for each of 8.
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (pair.fabric.stats().writes - writes_before < 16 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  absl::SleepFor(absl::Milliseconds(100));
  CHECK(pair.fabric.stats().writes - writes_before == 16);
  CHECK(pair.fabric.stats().rnr_errors == 0);
  pair.server.StartPolling();  // credits come back: the outbox drains
  auto events = pair.server.sink.WaitFor(200);
  REQUIRE(events.size() == 200);
  for (size_t i = 0; i < events.size(); ++i) {
    CHECK(events[i].header.request_id == i + 1);  // in order, none lost
  }
  CHECK(pair.fabric.stats().rnr_errors == 0);
}

// A server and two workers on one fabric: the server's sends to one worker
// that stops returning credits must not hold up its sends to the other.
struct Trio {
  FakeFabric fabric;
  Node server;
  Node workers[2];
  std::vector<std::byte> reply = std::vector<std::byte>(4096);
  std::vector<std::byte> pull[2] = {std::vector<std::byte>(4096), std::vector<std::byte>(4096)};

  explicit Trio(const MeshOptions& options) {
    MeshOptions o = options;
    o.num_workers = 2;
    o.role = Role::kServer;
    FakeNicSpec nic;
    nic.name = "fake_s";
    nic.ipv4 = 0x0A000010;
    auto s = CreateRdmaTransport(o, fabric.AddHost(nic));
    REQUIRE(s.ok());
    server.transport = *std::move(s);
    std::vector<PeerInfo> to_workers;
    std::vector<std::string> endpoints;
    o.role = Role::kWorker;
    for (int w = 0; w < 2; ++w) {
      nic.name = absl::StrCat("fake_w", w);
      nic.ipv4 = 0x0A000001 + w;
      auto t = CreateRdmaTransport(o, fabric.AddHost(nic));
      REQUIRE(t.ok());
      workers[w].transport = *std::move(t);
      auto ep = workers[w].transport->LocalEndpoint();
      REQUIRE(ep.ok());
      to_workers.push_back({WorkerId(w), *ep});
    }
    auto sep = server.transport->LocalEndpoint();
    REQUIRE(sep.ok());
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    auto accepted = std::async(std::launch::async, [&] {
      return server.transport->Connect(kServer, to_workers, deadline);
    });
    const std::vector<PeerInfo> to_server = {{kServer, *sep}};
    for (int w = 0; w < 2; ++w) {
      REQUIRE(workers[w].transport->Connect(WorkerId(w), to_server, deadline).ok());
    }
    REQUIRE(accepted.get().ok());
    RegionInfo source = Buffers::Region(4, 9, reply);
    source.slot_bytes = reply.size();
    REQUIRE(server.transport->RegisterRegion(source).ok());
    for (int w = 0; w < 2; ++w) {
      RegionInfo r = Buffers::Region(3, 9, pull[w], 1, {kServer});
      r.slot_bytes = pull[w].size();
      REQUIRE(workers[w].transport->RegisterRegion(r).ok());
      workers[w].sink.resolve = [this, w](NodeId,
                                          const FrameHeader&) -> absl::StatusOr<Destination> {
        return Destination{pull[w].data(), pull[w].size(), 3};
      };
    }
  }
  ~Trio() {
    server.StopPolling();
    for (Node& w : workers) w.StopPolling();
  }
  absl::Status Reply(int w, uint64_t request) {
    return server.transport->Send(WorkerId(w),
                                  Header(FrameType::kReply, kServer, WorkerId(w), 9, 64, request),
                                  reply.data(), 4, 64);
  }
};

// Issue 29: Send used to wait up to options.timeout, on the one send thread,
// for a credit of a peer whose window was full, so every other peer's frames
// queued behind the slow one.
TEST_CASE("rdma: a peer that stops returning credits holds up no other peer", "[rdma][transport]") {
  MeshOptions options;
  options.timeout = absl::Seconds(10);
  options.rdma.recv_depth = 8;
  Trio trio(options);
  trio.server.StartPolling();  // reads both workers' adverts
  trio.workers[0].StartPolling();
  // Worker 1 never polls: it returns no credits (its receives stay consumed).
  absl::SleepFor(absl::Milliseconds(100));
  for (uint64_t r = 1; r <= 8; ++r) REQUIRE(trio.Reply(1, r).ok());  // its whole window
  const absl::Time start = absl::Now();
  for (uint64_t r = 1; r <= 200; ++r) {
    INFO("round " << r);
    REQUIRE(trio.Reply(1, 8 + r).ok());  // queued for worker 1, at once
    REQUIRE(trio.Reply(0, r).ok());
  }
  auto events = trio.workers[0].sink.WaitFor(200);
  const absl::Duration took = absl::Now() - start;
  INFO("200 replies to worker 0 took " << absl::FormatDuration(took));
  REQUIRE(events.size() == 200);
  for (size_t i = 0; i < events.size(); ++i) {
    CHECK(events[i].status.ok());
    CHECK(events[i].header.request_id == i + 1);
  }
  CHECK(took < absl::Seconds(2));  // nowhere near the 10 s a credit wait took
  // Worker 1's outbox fills, then Send refuses at once, naming the peer.
  absl::Status full;
  uint64_t queued = 208;
  const absl::Time filling = absl::Now();
  while (full.ok() && queued < 10000 && absl::Now() - filling < absl::Seconds(5)) {
    full = trio.Reply(1, ++queued);
  }
  INFO(full.ToString() << " after " << queued << " replies to worker 1");
  CHECK(full.code() == absl::StatusCode::kResourceExhausted);
  CHECK(absl::StrContains(full.message(), "worker 1"));
  CHECK(absl::StrContains(full.message(), "credits"));
  // Worker 0 is still served at once.
  REQUIRE(trio.Reply(0, 201).ok());
  CHECK(trio.workers[0].sink.WaitFor(201, absl::Seconds(2)).size() == 201);
  CHECK_FALSE(trio.server.sink.AnyLoss());
  // Worker 1 comes back: everything queued arrives, in order.
  trio.workers[1].StartPolling();
  const size_t sent = queued - 1;  // the last was refused
  auto late = trio.workers[1].sink.WaitFor(sent, absl::Seconds(8));
  REQUIRE(late.size() == sent);
  for (size_t i = 0; i < late.size(); ++i) CHECK(late[i].header.request_id == i + 1);
  CHECK(trio.fabric.stats().rnr_errors == 0);
  CHECK_FALSE(trio.server.sink.AnyLoss());
}

TEST_CASE("rdma: a peer whose credits never come back is lost after the timeout, alone",
          "[rdma][transport]") {
  MeshOptions options;
  options.timeout = absl::Milliseconds(500);
  options.rdma.recv_depth = 8;
  Trio trio(options);
  trio.server.StartPolling();
  trio.workers[0].StartPolling();
  absl::SleepFor(absl::Milliseconds(100));
  for (uint64_t r = 1; r <= 20; ++r) REQUIRE(trio.Reply(1, r).ok());
  auto lost = trio.server.sink.WaitFor(1, absl::Seconds(5));
  REQUIRE(lost.size() == 1);
  INFO(lost[0].status.ToString());
  CHECK(lost[0].lost);
  CHECK(lost[0].peer == WorkerId(1));
  CHECK(lost[0].status.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(lost[0].status.message(), "worker 1"));
  CHECK(absl::StrContains(lost[0].status.message(), "credits"));
  // Worker 0 never noticed.
  REQUIRE(trio.Reply(0, 1).ok());
  auto events = trio.workers[0].sink.WaitFor(1);
  REQUIRE(events.size() == 1);
  CHECK(events[0].status.ok());
}

TEST_CASE("rdma: two QPs per peer stripe large payloads", "[rdma][transport]") {
  Buffers buf;
  Pair pair(Config(2, absl::Seconds(3), /*recv_depth=*/16, /*stripe_min_bytes=*/8192));
  Serve(pair, buf);
  for (uint8_t round = 0; round < 40; ++round) {
    const size_t bytes = round % 2 ? 100000 : 100;  // striped and not, interleaved
    Fill(buf.src.data(), bytes, round);
    REQUIRE(pair.worker.transport
                ->Send(kServer, Header(FrameType::kPush, kWorker, kServer, 7, bytes, round),
                       buf.src.data(), 2, bytes)
                .ok());
    auto events = pair.server.sink.WaitFor(round + 1u);
    REQUIRE(events.size() == round + 1u);
    CHECK(events.back().status.ok());
    CHECK(Same(buf.WorkerSlot(), bytes, round));
  }
  CHECK(pair.fabric.stats().rnr_errors == 0);
}

TEST_CASE("rdma: on a bonded device each QP of a peer is pinned to its own LAG port",
          "[rdma][transport]") {
  SECTION("two QPs, two bonded ports: one QP per port, striped traffic still exact") {
    Buffers buf;
    Pair pair(Config(2, absl::Seconds(3), 256, 8192, /*lag_ports=*/2));
    CHECK(pair.fabric.LagPorts("fake_w") == std::vector<uint8_t>{1, 2});
    CHECK(pair.fabric.LagPorts("fake_s") == std::vector<uint8_t>{1, 2});
    RegisterAll(pair, buf);
    ResolveToBuffers(pair, buf);
    pair.worker.StartPolling();
    pair.server.StartPolling();
    Fill(buf.src.data(), 100000, 3);
    REQUIRE(pair.worker.transport
                ->Send(kServer, Header(FrameType::kPush, kWorker, kServer, 7, 100000, 1),
                       buf.src.data(), 2, 100000)
                .ok());
    auto events = pair.server.sink.WaitFor(1);
    REQUIRE(events.size() == 1);
    CHECK(events[0].status.ok());
    CHECK(Same(buf.WorkerSlot(), 100000, 3));
  }
  SECTION("one QP per peer: left to the bond's hash") {
    Pair pair(Config(1, absl::Seconds(3), 256, 8192, /*lag_ports=*/2));
    CHECK(pair.fabric.LagPorts("fake_w") == std::vector<uint8_t>{0});
  }
  SECTION("not an mlx5 bond: nothing pinned, nothing fails") {
    Pair pair(Config(2, absl::Seconds(3), 256, 8192, /*lag_ports=*/0));
    CHECK(pair.fabric.LagPorts("fake_w") == std::vector<uint8_t>{0, 0});
  }
}

TEST_CASE("rdma: a peer that goes away is reported, never fatal", "[rdma][transport]") {
  Buffers buf;
  Pair pair;
  RegisterAll(pair, buf);
  pair.worker.StartPolling();
  pair.server.StartPolling();
  SECTION("orderly shutdown") {
    pair.server.StopPolling();
    pair.server.transport->Shutdown();
    auto events = pair.worker.sink.WaitFor(1);
    REQUIRE(events.size() == 1);
    CHECK(events[0].lost);
    CHECK(events[0].peer == kServer);
    CHECK(events[0].status.code() == absl::StatusCode::kCancelled);
    CHECK(std::string(events[0].status.message()).find("left") != std::string::npos);
  }
  SECTION("process gone") {
    pair.server.StopPolling();
    pair.server.transport.reset();
    auto events = pair.worker.sink.WaitFor(1);
    REQUIRE(events.size() == 1);
    CHECK(events[0].lost);
  }
  SECTION("NIC failure surfaces as a bad completion") {
    pair.fabric.FailNic("fake_s");
    Fill(buf.src.data(), 64, 1);
    // The first send may be posted before the failure shows; the loss follows.
    (void)pair.worker.transport->Send(kServer, Header(FrameType::kPush, kWorker, kServer, 7, 64),
                                      buf.src.data(), 2, 64);
    auto events = pair.worker.sink.WaitFor(1);
    REQUIRE(events.size() >= 1);
    CHECK(events[0].lost);
    auto server_events = pair.server.sink.WaitFor(1);
    REQUIRE(server_events.size() == 1);
    CHECK(server_events[0].lost);
    CHECK(server_events[0].peer == kWorker);
  }
  // Afterwards sends fail fast instead of hanging.
  auto after = pair.worker.transport->Send(
      kServer, Header(FrameType::kPush, kWorker, kServer, 7, 64), buf.src.data(), 2, 64);
  CHECK(after.code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("rdma: mismatched QP counts are refused at connect", "[rdma][transport]") {
  FakeFabric fabric;
  MeshOptions one;
  MeshOptions two;
  two.rdma.qps_per_peer = 2;
  FakeNicSpec a, b;
  a.ipv4 = 0x0A000001;
  b.ipv4 = 0x0A000002;
  auto w = *rdma::CreateRdmaTransport(one, fabric.AddHost(a));
  auto s = *rdma::CreateRdmaTransport(two, fabric.AddHost(b));
  const std::string sep = *s->LocalEndpoint();
  const std::string wep = *w->LocalEndpoint();
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  std::vector<PeerInfo> to_worker = {{kWorker, wep}};
  std::vector<PeerInfo> to_server = {{kServer, sep}};
  auto accepted =
      std::async(std::launch::async, [&] { return s->Connect(kServer, to_worker, deadline); });
  CHECK(w->Connect(kWorker, to_server, deadline).code() == absl::StatusCode::kFailedPrecondition);
  CHECK_FALSE(accepted.get().ok());
}

TEST_CASE("rdma: device selection prefers the named device and RoCE v2 GIDs", "[rdma][transport]") {
  FakeFabric fabric;
  const FakeNicSpec down{.name = "fake_down", .port_state = IBV_PORT_DOWN};
  const FakeNicSpec up{.name = "fake_up"};
  const FakeNicSpec other{.name = "fake_other"};
  auto verbs = fabric.AddHost({down, up, other});
  MeshOptions o;
  auto port = rdma::OpenPort(*verbs, o);
  REQUIRE(port.ok());
  CHECK(port->device_name == "fake_up");  // first active port
  CHECK(port->gid_index == 3);            // the RoCE v2 IPv4-mapped GID, not v1 or link-local
  o.rdma.device = "fake_other";
  port = rdma::OpenPort(*verbs, o);
  REQUIRE(port.ok());
  CHECK(port->device_name == "fake_other");
  o.rdma.gid_index = 0;
  port = rdma::OpenPort(*verbs, o);
  REQUIRE(port.ok());
  CHECK(port->gid_index == 0);
  o.rdma.device = "fake_down";
  CHECK_FALSE(rdma::OpenPort(*verbs, o).ok());
  o.rdma.device = "mlx5_9";
  CHECK(rdma::CreateRdmaTransport(o, verbs).status().code() == absl::StatusCode::kUnavailable);
}

// hostile (#13) for the RDMA bootstrap port: clients that connect and never
// say a word (a port scan, a stuck or hostile process) must not keep the real
// worker out. The old accept loop served one connection at a time, each for
// up to 5 s, so the worker behind 40 of them timed out.
TEST_CASE("rdma: silent connections to the bootstrap port do not keep a real peer out",
          "[rdma][transport]") {
  Buffers buf;  // before the fabric and the transports: they may read it while draining
  PairConfig config;
  FakeFabric fabric(config.fabric);
  auto w = CreateRdmaTransport(config.options, fabric.AddHost(config.worker_nic));
  auto s = CreateRdmaTransport(config.options, fabric.AddHost(config.server_nic));
  REQUIRE(w.ok());
  REQUIRE(s.ok());
  const PairPeers peers = PeersOf(**w, **s);
  const std::string& sep = peers.server_peers[0].endpoint;
  auto where = base::ParseHostPort(sep.substr(0, sep.find('|')));
  REQUIRE(where.ok());
  std::vector<base::UniqueFd> silent;
  for (int i = 0; i < 40; ++i) {  // more than the per-address cap (32)
    auto fd = base::ConnectTcp(*where, absl::Now() + absl::Seconds(2));
    REQUIRE(fd.ok());
    silent.push_back(*std::move(fd));
  }
  auto accepted = std::async(std::launch::async, [&] {
    return (*s)->Connect(kServer, peers.worker_peers, absl::Now() + absl::Seconds(10));
  });
  const absl::Time start = absl::Now();
  const absl::Status dialled = (*w)->Connect(kWorker, peers.server_peers, start + absl::Seconds(4));
  const absl::Status accept = accepted.get();
  INFO(dialled.ToString() << " / " << accept.ToString());
  CHECK(dialled.ok());
  CHECK(accept.ok());
  CHECK(absl::Now() - start < absl::Seconds(4));
  // And the connection carries frames.
  Node worker, server;
  worker.transport = *std::move(w);
  server.transport = *std::move(s);
  REQUIRE(server.transport->RegisterRegion(buf.Recv()).ok());
  REQUIRE(worker.transport->RegisterRegion(buf.Src()).ok());
  server.sink.resolve = [&](NodeId, const FrameHeader&) -> absl::StatusOr<Destination> {
    return Destination{buf.WorkerSlot(), Buffers::kSlot, 1};
  };
  worker.StartPolling();
  server.StartPolling();
  Fill(buf.src.data(), 256, 3);
  REQUIRE(worker.transport
              ->Send(kServer, Header(FrameType::kPush, kWorker, kServer, 7, 256), buf.src.data(), 2,
                     256)
              .ok());
  auto events = server.sink.WaitFor(1);
  REQUIRE(events.size() == 1);
  CHECK(events[0].status.ok());
  CHECK(Same(buf.WorkerSlot(), 256, 3));
  worker.StopPolling();
  server.StopPolling();
}

// libibverbs is opened at run time (#29): a machine without rdma-core runs the
// same library, and asking for RDMA there names what is missing.
TEST_CASE("rdma: without libibverbs the verbs API names the missing library, TCP still works",
          "[rdma][transport]") {
  auto missing = rdma::MakeRealVerbsApi("libstepmesh_no_such_verbs.so.1");
  REQUIRE_FALSE(missing.ok());
  INFO(missing.status().ToString());
  CHECK(missing.status().code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(missing.status().message(), "libstepmesh_no_such_verbs.so.1"));
  CHECK(absl::StrContains(missing.status().message(), "libibverbs"));
  // A library that is there but is not libibverbs: the entry point it lacks.
  auto wrong = rdma::MakeRealVerbsApi("libc.so.6");
  REQUIRE_FALSE(wrong.ok());
  INFO(wrong.status().ToString());
  CHECK(wrong.status().code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(wrong.status().message(), "has no ibv_fork_init"));
  // The library this build names opens here (rdma-core is installed), and
  // without a device it lists none rather than failing.
  auto real = rdma::MakeRealVerbsApi();
  REQUIRE(real.ok());
  int count = -1;
  if (ibv_device** list = (*real)->GetDeviceList(&count); list != nullptr) {
    (*real)->FreeDeviceList(list);
  }
  CHECK(count >= 0);
  // TCP needs none of it.
  MeshOptions options;
  options.bind_host = "127.0.0.1";
  auto tcp = tcp::CreateTcpTransport(options);
  REQUIRE(tcp.ok());
  CHECK((*tcp)->LocalEndpoint().ok());
}

}  // namespace
}  // namespace stepmesh::core
