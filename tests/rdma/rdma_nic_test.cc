// What a real NIC does that an instant, in-order wire hides: requests still in
// flight when memory is released or the connection is closed, InfiniBand
// addressing, port events, retry budgets, message-size limits, grants larger
// than asked for, immediate-less devices. Every case runs on the asynchronous
// fake fabric (tests/rdma/fake_verbs.h).

#include <catch2/catch.hpp>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "src/transport/rdma/verbs_resources.h"
#include "tests/rdma/rdma_pair.h"

namespace stepmesh::core {
namespace {

using testing::FakeGid;

// Releases a held QP after `after`, from another thread.
std::future<void> ReleaseLater(FakeFabric& fabric, uint32_t qpn, absl::Duration after) {
  return std::async(std::launch::async, [&fabric, qpn, after] {
    absl::SleepFor(after);
    fabric.HoldQp(qpn, false);
  });
}

bool Mentions(const absl::Status& status, absl::string_view text) {
  return absl::StrContains(status.message(), text);
}

// A worker and a server on the fake fabric, serving `buf`'s regions.
struct ServedPair {
  ServedPair() { Serve(pair, buf); }
  Buffers buf;
  Pair pair;
};

TEST_CASE_METHOD(
    ServedPair,
    "rdma nic: a source region is deregistered only once the sends reading it completed",
    "[rdma][nic]") {
  PushChecked(pair, buf, 100, 4);  // the advert is in: the next push is posted at once
  Fill(buf.src.data(), 4096, 5);
  const uint32_t qp0 = pair.WorkerQps().at(0);
  pair.fabric.HoldQp(qp0, true);  // the push is posted, not yet executed
  REQUIRE(Push(pair, buf, 4096, 1).ok());
  auto release = ReleaseLater(pair.fabric, qp0, absl::Milliseconds(50));
  CHECK(pair.worker.transport->UnregisterRegion(2).ok());
  release.get();
  auto events = pair.server.sink.WaitFor(2);
  REQUIRE(events.size() >= 2);
  INFO(events[1].status.ToString());
  CHECK_FALSE(events[1].lost);
  CHECK(events[1].status.ok());
  CHECK(Same(buf.WorkerSlot(), 4096, 5));
  CHECK(pair.fabric.stats().access_errors == 0);
  CHECK_FALSE(pair.worker.sink.AnyLoss());
}

TEST_CASE("rdma nic: a withdrawn receive slot stays registered until the writer acknowledged",
          "[rdma][nic]") {
  PairConfig config;
  config.options.timeout = absl::Milliseconds(500);  // the last push waits this long
  Buffers buf;
  Pair pair(config);
  Serve(pair, buf);
  PushChecked(pair, buf, 100, 4);  // the advert is in: the next push is posted at once
  const uint32_t qp0 = pair.WorkerQps().at(0);
  pair.fabric.HoldQp(qp0, true);
  REQUIRE(Push(pair, buf, 4096, 1).ok());  // the writer holds the slot's rkey in flight
  auto release = ReleaseLater(pair.fabric, qp0, absl::Milliseconds(50));
  CHECK(pair.server.transport->UnregisterRegion(1).ok());
  release.get();
  absl::SleepFor(absl::Milliseconds(50));
  CHECK(pair.fabric.stats().access_errors == 0);
  CHECK_FALSE(pair.worker.sink.AnyLoss());
  CHECK_FALSE(pair.server.sink.AnyLoss());
  // The key is gone for the worker: the next push waits for an advert, and
  // is refused once the timeout passed (the connection stays).
  CHECK(pair.worker.transport
            ->Send(kServer, Header(FrameType::kPush, kWorker, kServer, 7, 64, 2), buf.src.data(), 2,
                   64)
            .ok());
  auto refused = pair.worker.sink.WaitFor(1);
  REQUIRE(refused.size() == 1);
  CHECK_FALSE(refused[0].lost);
  CHECK(refused[0].status.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(Mentions(refused[0].status, "key 7"));
}

TEST_CASE_METHOD(ServedPair, "rdma nic: frames posted before Shutdown arrive before the goodbye",
                 "[rdma][nic]") {
  ReplyChecked(pair, buf, 100, 4);  // the advert is in: the replies below are posted at once
  Fill(buf.reply.data(), 1000, 3);
  const uint32_t qp0 = pair.ServerQps().at(0);
  pair.fabric.HoldQp(qp0, true);
  for (uint64_t r = 1; r <= 5; ++r) REQUIRE(Reply(pair, buf, 1000, r).ok());
  auto release = ReleaseLater(pair.fabric, qp0, absl::Milliseconds(50));
  pair.server.StopPolling();
  pair.server.transport->Shutdown();
  release.get();
  auto events = pair.worker.sink.WaitFor(7);
  REQUIRE(events.size() == 7);
  for (uint64_t r = 1; r <= 5; ++r) {
    INFO("reply " << r << ": " << events[r].status.ToString());
    CHECK_FALSE(events[r].lost);
    CHECK(events[r].status.ok());
    CHECK(events[r].header.request_id == r);
  }
  CHECK(events[6].lost);
  CHECK(Same(buf.pull.data(), 1000, 3));
}

TEST_CASE("rdma nic: InfiniBand ports connect by LID", "[rdma][nic]") {
  PairConfig config;
  config.worker_nic.link_layer = IBV_LINK_LAYER_INFINIBAND;
  config.server_nic.link_layer = IBV_LINK_LAYER_INFINIBAND;
  Buffers buf;
  Pair pair(config);
  Serve(pair, buf);
  PushChecked(pair, buf, 5000, 1);
  ReplyChecked(pair, buf, 700, 2);
}

TEST_CASE(
    "rdma nic: events of the other port of a dual-port HCA drop nobody, a GID change "
    "on ours does",
    "[rdma][nic]") {
  PairConfig config;
  config.worker_nic.ports = 2;
  config.options.rdma.port = 1;
  Buffers buf;
  Pair pair(config);
  Serve(pair, buf);
  pair.fabric.InjectPortEvent("fake_w", 2, IBV_EVENT_PORT_ERR);
  ibv_gid other{};
  other.raw[0] = 0x20;
  pair.fabric.ChangeGid("fake_w", 2, 3, other);  // port 2's address: not ours
  absl::SleepFor(absl::Milliseconds(50));
  CHECK_FALSE(pair.worker.sink.AnyLoss());
  Fill(buf.src.data(), 100, 4);
  REQUIRE(Push(pair, buf, 100, 1).ok());
  auto events = pair.server.sink.WaitFor(1);
  REQUIRE(events.size() == 1);
  CHECK(events[0].status.ok());
  // Our own GID changes: the address every peer uses is gone.
  pair.fabric.ChangeGid("fake_w", 1, 3, other);
  events = pair.worker.sink.WaitFor(1);
  REQUIRE(events.size() == 1);
  CHECK(events[0].lost);
  INFO(events[0].status.ToString());
  CHECK(Mentions(events[0].status, "GID"));
}

TEST_CASE_METHOD(ServedPair, "rdma nic: the default ACK timeout rides out a one-second PFC pause",
                 "[rdma][nic]") {
  pair.fabric.PauseNic("fake_s", absl::Seconds(1));
  PushChecked(pair, buf, 2000, 6, /*nth=*/1, /*wait=*/absl::Seconds(10));
  CHECK_FALSE(pair.worker.sink.AnyLoss());
}

TEST_CASE("rdma nic: a send that is never acknowledged is reported with its own cause",
          "[rdma][nic]") {
  PairConfig config;
  config.options.rdma.ack_timeout = 8;  // 1 ms per try
  config.options.rdma.retry_count = 1;
  Buffers buf;
  Pair pair(config);
  Serve(pair, buf);
  pair.fabric.DropTraffic(pair.WorkerQps().at(0), true);
  REQUIRE(Push(pair, buf, 100, 1).ok());  // posted; the loss shows later
  auto events = pair.worker.sink.WaitFor(1);
  REQUIRE(events.size() == 1);
  CHECK(events[0].lost);
  INFO(events[0].status.ToString());
  CHECK(Mentions(events[0].status, "retry counter exceeded"));
  CHECK(Push(pair, buf, 100, 2).code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("rdma nic: send CQs hold every send WR the NIC granted", "[rdma][nic]") {
  PairConfig config;
  config.options.rdma.qps_per_peer = 2;
  Pair pair(config);
  for (uint32_t qpn : pair.WorkerQps()) {
    INFO("QP " << qpn << " granted " << pair.fabric.GrantedSendWr(qpn) << " send WRs");
    CHECK(pair.fabric.SendCqCapacity(qpn) >= static_cast<int>(pair.fabric.GrantedSendWr(qpn)));
  }
}

TEST_CASE("rdma nic: payloads larger than the port's max_msg_sz are split", "[rdma][nic]") {
  PairConfig config;
  config.worker_nic.max_msg_sz = 64 << 10;
  config.server_nic.max_msg_sz = 64 << 10;
  config.options.rdma.qps_per_peer = GENERATE(1, 2);
  config.options.rdma.stripe_min_bytes = 8192;
  Buffers buf;
  Pair pair(config);
  Serve(pair, buf);
  PushChecked(pair, buf, 300000, 8);
  ReplyChecked(pair, buf, Buffers::kSlot, 9);
  CHECK(pair.fabric.stats().length_errors == 0);
}

TEST_CASE("rdma nic: ibv_fork_init runs once per transport, before any registration",
          "[rdma][nic]") {
  Buffers buf;
  Pair pair;
  RegisterAll(pair, buf);
  CHECK(pair.fabric.stats().fork_init_calls == 2);
  CHECK(pair.fabric.stats().registrations_before_fork_init == 0);
}

TEST_CASE("rdma nic: link-local RoCE v2 GIDs are never chosen", "[rdma][nic]") {
  FakeFabric fabric;
  ibv_gid link_local{};
  link_local.raw[0] = 0xFE;
  link_local.raw[1] = 0x80;
  link_local.raw[15] = 7;
  ibv_gid global{};
  global.raw[0] = 0x20;
  global.raw[1] = 0x01;
  global.raw[2] = 0x0D;
  global.raw[3] = 0xB8;
  global.raw[15] = 5;
  FakeNicSpec spec;
  spec.name = "fake_v6";
  spec.gids = {{link_local, IBV_GID_TYPE_ROCE_V1},
               {link_local, IBV_GID_TYPE_ROCE_V2},
               {global, IBV_GID_TYPE_ROCE_V2}};
  auto v6 = fabric.AddHost(spec);  // outlives the port it opens
  auto port = rdma::OpenPort(*v6, MeshOptions());
  REQUIRE(port.ok());
  CHECK(port->gid_index == 2);
  spec.name = "fake_ll";
  spec.gids.pop_back();  // only link-local addresses: RoCE v1, never v2
  auto link_local_only = fabric.AddHost(spec);
  auto ll = rdma::OpenPort(*link_local_only, MeshOptions());
  REQUIRE(ll.ok());
  CHECK(ll->gid_index == 0);
}

ibv_gid V4(uint8_t a, uint8_t b, uint8_t c, uint8_t d) {
  ibv_gid gid{};
  gid.raw[10] = 0xFF;
  gid.raw[11] = 0xFF;
  gid.raw[12] = a;
  gid.raw[13] = b;
  gid.raw[14] = c;
  gid.raw[15] = d;
  return gid;
}

TEST_CASE("rdma nic: with an interface named, only GIDs in its subnets are chosen", "[rdma][nic]") {
  FakeFabric fabric;
  FakeNicSpec spec;
  spec.name = "fake_two_nets";
  spec.gids = {{V4(10, 0, 0, 5), IBV_GID_TYPE_ROCE_V2},
               {V4(10, 0, 1, 5), IBV_GID_TYPE_ROCE_V2},
               {V4(127, 0, 0, 9), IBV_GID_TYPE_ROCE_V2}};
  auto verbs = fabric.AddHost(spec);
  MeshOptions options;
  auto port = rdma::OpenPort(*verbs, options);
  REQUIRE(port.ok());
  CHECK(port->gid_index == 0);  // no interface: the first of equals
  options.rdma.interface = "10.0.1.0/24";
  port = rdma::OpenPort(*verbs, options);
  REQUIRE(port.ok());
  CHECK(port->gid_index == 1);
  options.rdma.interface = "lo";  // 127.0.0.1/8 on every Linux host
  port = rdma::OpenPort(*verbs, options);
  REQUIRE(port.ok());
  CHECK(port->gid_index == 2);
  options.rdma.interface = "192.168.0.0/16";
  port = rdma::OpenPort(*verbs, options);
  REQUIRE_FALSE(port.ok());
  INFO(port.status().ToString());
  CHECK(Mentions(port.status(), "192.168.0.0/16"));
  for (const char* bad : {"no_such_interface0", "10.0.0.0/40", "10.0.0/8"}) {
    options.rdma.interface = bad;
    port = rdma::OpenPort(*verbs, options);
    INFO(bad << ": " << port.status().ToString());
    CHECK_FALSE(port.ok());
    CHECK(Mentions(port.status(), "STEPMESH_RDMA_INTERFACE"));
  }
}

TEST_CASE("rdma nic: iWARP devices (no immediate data) are not candidates", "[rdma][nic]") {
  FakeFabric fabric;
  const FakeNicSpec siw{.name = "siw0", .iwarp = true};
  const FakeNicSpec roce{.name = "fake_roce"};
  auto both = fabric.AddHost({siw, roce});  // outlives the port it opens
  auto port = rdma::OpenPort(*both, MeshOptions());
  REQUIRE(port.ok());
  CHECK(port->device_name == "fake_roce");
  auto siw_only = fabric.AddHost(siw);
  auto only = rdma::OpenPort(*siw_only, MeshOptions());
  REQUIRE_FALSE(only.ok());
  INFO(only.status().ToString());
  CHECK(Mentions(only.status(), "iWARP"));
}

TEST_CASE("rdma nic: a slot withdrawn and advertised again is written at its new place",
          "[rdma][nic]") {
  PairConfig config;
  config.options.rdma.qps_per_peer = GENERATE(1, 2);
  config.options.rdma.stripe_min_bytes = 8192;
  Buffers buf;
  std::vector<std::byte> moved(2 * Buffers::kSlot);
  Pair pair(config);
  RegisterAll(pair, buf);
  pair.server.sink.resolve = [&](NodeId, const FrameHeader& h) -> absl::StatusOr<Destination> {
    if (h.request_id == 1) return Destination{buf.WorkerSlot(), Buffers::kSlot, 1};
    return Destination{moved.data() + Buffers::kSlot, Buffers::kSlot, 5};
  };
  pair.worker.StartPolling();
  pair.server.StartPolling();
  Fill(buf.src.data(), 100000, 1);
  REQUIRE(Push(pair, buf, 100000, 1).ok());  // prepares the route
  REQUIRE(pair.server.sink.WaitFor(1).size() == 1);
  REQUIRE(pair.server.transport->UnregisterRegion(1).ok());
  RegionInfo again = buf.Recv();
  again.id = 5;
  again.base = moved.data();
  REQUIRE(pair.server.transport->RegisterRegion(again).ok());
  Fill(buf.src.data(), 100000, 2);
  REQUIRE(Push(pair, buf, 100000, 2).ok());  // the cached route follows the new advert
  auto events = pair.server.sink.WaitFor(2);
  REQUIRE(events.size() == 2);
  INFO(events[1].status.ToString());
  CHECK(events[1].status.ok());
  CHECK(Same(moved.data() + Buffers::kSlot, 100000, 2));
  CHECK(Same(buf.WorkerSlot(), 100000, 1));  // the old slot kept its bytes
  CHECK(pair.fabric.stats().access_errors == 0);
}

// Two QPs per peer, a small credit window, both ends polling, and the worker's
// stripe QP (QP 1) held: whatever is striped waits for it.
struct ParkingPair {
  static PairConfig Config() {
    PairConfig config;
    config.options.rdma.qps_per_peer = 2;
    config.options.rdma.recv_depth = 16;
    config.options.rdma.stripe_min_bytes = 8192;
    return config;
  }
  Buffers buf;
  Pair pair{Config()};
  uint32_t qp1 = 0;

  ParkingPair() {
    RegisterAll(pair, buf);
    ResolveToBuffers(pair, buf);
    pair.worker.StartPolling();
    pair.server.StartPolling();
    qp1 = pair.WorkerQps().at(1);
    pair.fabric.HoldQp(qp1, true);  // the stripe QP falls behind QP 0
    Fill(buf.src.data(), 100000, 2);
    REQUIRE(Push(pair, buf, 100000, 1).ok());  // striped: its second half waits on QP 1
  }
};

TEST_CASE("rdma nic: a frame waiting for its stripe is parked, then delivered in order",
          "[rdma][nic]") {
  ParkingPair p;
  for (uint64_t r = 2; r <= 9; ++r) REQUIRE(Push(p.pair, p.buf, 100, r).ok());
  absl::SleepFor(absl::Milliseconds(30));
  CHECK(p.pair.server.sink.events().empty());  // all parked behind the first
  p.pair.fabric.HoldQp(p.qp1, false);
  auto events = p.pair.server.sink.WaitFor(9);
  REQUIRE(events.size() == 9);
  for (uint64_t r = 1; r <= 9; ++r) {
    CHECK(events[r - 1].status.ok());
    CHECK(events[r - 1].header.request_id == r);
  }
  CHECK(Same(p.buf.WorkerSlot(), 100000, 2));
}

TEST_CASE("rdma nic: frames parked behind a late stripe never outnumber the credits",
          "[rdma][nic]") {
  ParkingPair p;
  // Three windows of small frames behind it: the old receiver credited parked
  // frames at once and ran out of parking space after one window.
  constexpr uint64_t kFrames = 1 + 3 * 16;
  auto sender = std::async(std::launch::async, [&] {
    for (uint64_t r = 2; r <= kFrames; ++r) {
      if (absl::Status s = Push(p.pair, p.buf, 100, r); !s.ok()) return s;
    }
    return absl::OkStatus();
  });
  absl::SleepFor(absl::Milliseconds(100));
  p.pair.fabric.HoldQp(p.qp1, false);
  const absl::Status sent = sender.get();
  INFO(sent.ToString());
  CHECK(sent.ok());
  auto events = p.pair.server.sink.WaitFor(kFrames);
  REQUIRE(events.size() == kFrames);
  for (uint64_t r = 1; r <= kFrames; ++r) {
    INFO("frame " << r << ": " << events[r - 1].status.ToString());
    CHECK_FALSE(events[r - 1].lost);
    CHECK(events[r - 1].header.request_id == r);
  }
  CHECK_FALSE(p.pair.worker.sink.AnyLoss());
}

}  // namespace
}  // namespace stepmesh::core
