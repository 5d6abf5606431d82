// The core's end-to-end scenarios (tests/core/mesh_scenarios.h) with every
// participant on the RDMA transport over one in-process fake fabric.

#include <atomic>
#include <catch2/catch.hpp>
#include <future>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/core/mesh.h"
#include "src/transport/rdma/rdma_transport.h"
#include "stepmesh/backend.h"
#include "stepmesh/scheduler.h"
#include "tests/core/conformance_suite.h"
#include "tests/core/mesh_scenarios.h"
#include "tests/rdma/fake_verbs.h"

namespace stepmesh {
namespace {

using testing::FakeFabric;
using testing::FakeNicSpec;
using testing::Scenario;

// Each participant gets its own fake host (NIC + GID) on one shared fabric.
core::TransportFactory FakeRdmaFactory(std::shared_ptr<FakeFabric> fabric,
                                       rdma::RdmaTuning tuning = {}) {
  auto next_host = std::make_shared<std::atomic<uint32_t>>(1);
  return [fabric, tuning, next_host](const MeshOptions& options)
             -> absl::StatusOr<std::unique_ptr<core::Transport>> {
    const uint32_t n = next_host->fetch_add(1);
    FakeNicSpec spec;
    spec.name = absl::StrCat("fake_mlx5_", n);
    spec.ipv4 = 0x0A000000 + n;
    return rdma::CreateRdmaTransport(options, fabric->AddHost(spec), tuning);
  };
}

MeshOptions RdmaOptions(int qps = 1) {
  MeshOptions o;
  o.transport = "rdma";
  o.timeout = absl::Seconds(10);
  o.rdma_qps_per_peer = qps;
  return o;
}

TEST_CASE("conformance over rdma (fake verbs): 1A1F, 1A2F, 2A2F, 3 micro-batches",
          "[rdma][conformance]") {
  for (auto [w, s] : {std::pair{1, 1}, std::pair{1, 2}, std::pair{2, 2}}) {
    auto fabric = std::make_shared<FakeFabric>();
    Scenario sc;
    sc.workers = w;
    sc.servers = s;
    sc.iterations = 30;
    INFO(w << "A" << s << "F");
    absl::Status result = testing::RunInProcess(sc, RdmaOptions(), FakeRdmaFactory(fabric));
    CHECK(result.ok());
    if (!result.ok()) FAIL_CHECK(result.ToString());
    CHECK(fabric->stats().rnr_errors == 0);
    CHECK(fabric->stats().access_errors == 0);
  }
}

TEST_CASE("conformance over rdma (fake verbs): 2A2F with payload checksums on",
          "[rdma][conformance]") {
  auto fabric = std::make_shared<FakeFabric>();
  Scenario sc;
  sc.iterations = 20;
  MeshOptions o = RdmaOptions();
  o.payload_checksum = true;  // every payload sealed and checked, none may fail
  absl::Status result = testing::RunInProcess(sc, o, FakeRdmaFactory(fabric));
  CHECK(result.ok());
  if (!result.ok()) FAIL_CHECK(result.ToString());
}

TEST_CASE("conformance over rdma (fake verbs): two QPs per peer, small credit window",
          "[rdma][conformance]") {
  auto fabric = std::make_shared<FakeFabric>();
  rdma::RdmaTuning tuning;
  tuning.recv_depth = 8;  // forces credit returns every other frame
  tuning.stripe_min_bytes = 4096;
  Scenario sc;
  sc.iterations = 30;
  absl::Status result = testing::RunInProcess(sc, RdmaOptions(2), FakeRdmaFactory(fabric, tuning));
  CHECK(result.ok());
  if (!result.ok()) FAIL_CHECK(result.ToString());
  CHECK(fabric->stats().rnr_errors == 0);
}

TEST_CASE("conformance over rdma (fake verbs): bad input and peer loss", "[rdma][conformance]") {
  auto fabric = std::make_shared<FakeFabric>();
  testing::RunBadInputConformance([fabric] {
    MeshOptions o = RdmaOptions();
    o.timeout = absl::Seconds(3);
    return std::make_unique<testing::MeshPair>(o, FakeRdmaFactory(fabric));
  });
  CHECK(fabric->stats().rnr_errors == 0);
}

}  // namespace
}  // namespace stepmesh

namespace stepmesh {
namespace {

// Bootstrap sockets run the same challenge-response as TCP data connections.
absl::Status ConnectPair(const std::string& worker_secret, const std::string& server_secret,
                         absl::Status* server_result) {
  auto fabric = std::make_shared<testing::FakeFabric>();
  auto factory = FakeRdmaFactory(fabric);
  MeshOptions wo = RdmaOptions();
  wo.auth_token = worker_secret;
  MeshOptions so = RdmaOptions();
  so.auth_token = server_secret;
  auto worker = factory(wo);
  auto server = factory(so);
  if (!worker.ok()) return worker.status();
  if (!server.ok()) return server.status();
  auto worker_endpoint = (*worker)->LocalEndpoint();
  auto server_endpoint = (*server)->LocalEndpoint();
  if (!worker_endpoint.ok() || !server_endpoint.ok()) return absl::InternalError("endpoints");
  const core::NodeId w = core::WorkerId(0), s = core::ServerId(0);
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  auto accepted = std::async(std::launch::async, [&] {
    const core::PeerInfo peer{w, *worker_endpoint};
    return (*server)->Connect(s, {&peer, 1}, deadline);
  });
  const core::PeerInfo peer{s, *server_endpoint};
  absl::Status dialled = (*worker)->Connect(w, {&peer, 1}, deadline);
  *server_result = accepted.get();
  (*worker)->Shutdown();
  (*server)->Shutdown();
  return dialled;
}

TEST_CASE("rdma bootstrap connections need the shared secret on both ends", "[rdma][auth]") {
  absl::Status server;
  CHECK(ConnectPair("alpha", "alpha", &server).ok());
  CHECK(server.ok());
  CHECK(absl::IsPermissionDenied(ConnectPair("alpha", "beta", &server)));
  CHECK_FALSE(server.ok());  // the impostor never became a peer
  CHECK(absl::IsPermissionDenied(ConnectPair("", "beta", &server)));
  CHECK_FALSE(server.ok());
}

}  // namespace
}  // namespace stepmesh
