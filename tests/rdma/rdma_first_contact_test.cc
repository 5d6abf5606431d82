// What a first real NIC does that the fake used to be kinder about (#31):
// relaxed ordering on the MRs, fork handling, RLIMIT_MEMLOCK, InfiniBand
// partitions and RoCE GID types. Each case fails on the transport before #31.

#include <catch2/catch.hpp>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "src/transport/rdma/peer_setup.h"
#include "src/transport/rdma/verbs_resources.h"
#include "tests/rdma/rdma_pair.h"

namespace stepmesh::core {
namespace {

bool Mentions(const absl::Status& status, absl::string_view text) {
  return absl::StrContains(status.message(), text);
}

TEST_CASE("first contact: tensors' MRs get relaxed ordering unless it is off", "[rdma][first]") {
  // Buffers: recv (2 slots), reply, src, pull (1 slot) = 5 data MRs; each
  // side's control block for its one peer is 2 more.
  for (const auto& [mode, expected] :
       {std::pair{"auto", 5}, std::pair{"on", 9}, std::pair{"off", 0}}) {
    INFO("STEPMESH_RDMA_RELAXED_ORDERING=" << mode);
    PairConfig config;
    config.options.rdma.relaxed_ordering = mode;
    Buffers buf;
    Pair pair(config);
    Serve(pair, buf);
    PushChecked(pair, buf, 3000, 1);
    CHECK(pair.fabric.stats().relaxed_ordering_mrs == static_cast<uint64_t>(expected));
  }
}

TEST_CASE("first contact: no ibv_fork_init where the kernel copies pinned pages on fork",
          "[rdma][first]") {
  PairConfig config;
  config.copy_on_fork = true;
  Buffers buf;
  {
    Pair pair(config);
    RegisterAll(pair, buf);
    CHECK(pair.fabric.stats().fork_init_calls == 0);
    CHECK(pair.fabric.stats().dontfork_registrations == 0);
  }
  // Without copy-on-fork it is needed, unless turned off.
  config.copy_on_fork = false;
  config.options.rdma.fork_init = "off";
  Pair pair(config);
  RegisterAll(pair, buf);
  CHECK(pair.fabric.stats().fork_init_calls == 0);
}

TEST_CASE("first contact: an RLIMIT_MEMLOCK too small for the control blocks fails at start",
          "[rdma][first]") {
  FakeFabric fabric;
  testing::FakeHostSpec host;
  host.memlock_limit = 64 << 10;  // a container's default
  FakeNicSpec nic;
  MeshOptions options;
  options.num_servers = 2;
  auto transport = CreateRdmaTransport(options, fabric.AddHost({nic}, host));
  REQUIRE_FALSE(transport.ok());
  INFO(transport.status().ToString());
  CHECK(transport.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(Mentions(transport.status(), "RLIMIT_MEMLOCK (ulimit -l) is 64 KiB"));
  CHECK(Mentions(transport.status(), "2 peer(s)"));
}

TEST_CASE("first contact: a registration past RLIMIT_MEMLOCK names the limit", "[rdma][first]") {
  PairConfig config;
  // Room for the control block and the 1 MiB reply tensor, not for the 2 MiB
  // receive region besides.
  config.server_host.memlock_limit = rdma::ControlBlockBytes(1, 256) + (2 << 20);
  Buffers buf;
  Pair pair(config);
  REQUIRE(pair.server.transport->RegisterRegion(buf.Reply()).ok());
  const absl::Status recv = pair.server.transport->RegisterRegion(buf.Recv());
  INFO(recv.ToString());
  CHECK_FALSE(recv.ok());
  CHECK(Mentions(recv, "Cannot allocate memory"));
  CHECK(Mentions(recv, "RLIMIT_MEMLOCK (ulimit -l) is 2 MiB"));
  CHECK(pair.fabric.stats().memlock_refusals == 1);
}

TEST_CASE("first contact: a receive region pins its pages once, not again per slot",
          "[rdma][first]") {
  PairConfig config;
  // The control block, the 2 MiB receive region and the 1 MiB reply tensor
  // (plus a few pages: the buffers are not page-aligned): enough only if the
  // region's pages are charged once, not once more for a whole-region MR.
  config.server_host.memlock_limit = rdma::ControlBlockBytes(1, 256) + (3 << 20) + (64 << 10);
  Buffers buf;
  Pair pair(config);
  Serve(pair, buf);
  PushChecked(pair, buf, 70000, 3);
  ReplyChecked(pair, buf, 5000, 4);
  CHECK(pair.fabric.stats().memlock_refusals == 0);
}

TEST_CASE("first contact: STEPMESH_RDMA_PKEY selects the partition's P_Key entry",
          "[rdma][first]") {
  PairConfig config;
  // A cloud InfiniBand port: index 0 is the limited default partition, the
  // tenant's full-member partition sits further down.
  for (FakeNicSpec* nic : {&config.worker_nic, &config.server_nic}) {
    nic->link_layer = IBV_LINK_LAYER_INFINIBAND;
    nic->pkeys = {0x7FFF, 0x0123, 0x8001};
  }
  config.options.rdma.ack_timeout = 8;  // a lost request fails in ms, not seconds
  config.options.rdma.retry_count = 1;
  config.options.rdma.pkey = 0x8001;
  Buffers buf;
  Pair pair(config);
  Serve(pair, buf);
  PushChecked(pair, buf, 4000, 5);
  ReplyChecked(pair, buf, 900, 6);
  CHECK_FALSE(pair.worker.sink.AnyLoss());
}

TEST_CASE("first contact: a P_Key the port lacks fails at start, naming the table",
          "[rdma][first]") {
  FakeFabric fabric;
  FakeNicSpec nic;
  nic.link_layer = IBV_LINK_LAYER_INFINIBAND;
  nic.pkeys = {0xFFFF, 0x8002};
  MeshOptions options;
  options.rdma.pkey = 0x8001;
  auto transport = CreateRdmaTransport(options, fabric.AddHost(nic));
  REQUIRE_FALSE(transport.ok());
  INFO(transport.status().ToString());
  CHECK(Mentions(transport.status(), "STEPMESH_RDMA_PKEY"));
  CHECK(Mentions(transport.status(), "0:0xffff 1:0x8002"));
}

TEST_CASE("first contact: a RoCE v1 / v2 GID mismatch fails at connect, naming both",
          "[rdma][first]") {
  FakeFabric fabric;
  FakeNicSpec worker_nic;
  worker_nic.name = "fake_w";
  FakeNicSpec server_nic;
  server_nic.name = "fake_s";
  server_nic.ipv4 = 0x0A000002;
  MeshOptions worker_options;
  worker_options.timeout = absl::Seconds(3);
  worker_options.rdma.gid_index = 2;  // mlx5's RoCE v1 entry of the IPv4 address
  MeshOptions server_options = worker_options;
  server_options.role = Role::kServer;
  server_options.rdma.gid_index = -1;  // auto: RoCE v2
  auto w = CreateRdmaTransport(worker_options, fabric.AddHost(worker_nic));
  auto s = CreateRdmaTransport(server_options, fabric.AddHost(server_nic));
  REQUIRE(w.ok());
  REQUIRE(s.ok());
  const PairPeers peers = PeersOf(**w, **s);
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + absl::Seconds(3);
  auto accepted = std::async(std::launch::async,
                             [&] { return (*s)->Connect(kServer, peers.worker_peers, deadline); });
  const absl::Status dialled = (*w)->Connect(kWorker, peers.server_peers, deadline);
  const absl::Status accept = accepted.get();
  INFO(dialled.ToString() << " / " << accept.ToString());
  const absl::Status& named = dialled.ok() ? accept : dialled;
  CHECK_FALSE(named.ok());
  CHECK(Mentions(named, "GID type mismatch"));
  CHECK(Mentions(named, "RoCE v1"));
  CHECK(Mentions(named, "RoCE v2"));
  CHECK(absl::Now() - start < absl::Seconds(2));  // at connect, not after the retries
}

}  // namespace
}  // namespace stepmesh::core
