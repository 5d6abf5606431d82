// The frame-level faults again, over the RDMA transport on fake verbs
// (tests/rdma/fake_verbs.h). Byte-level faults need a wire the RDMA transport
// does not expose to tests; the decorator reports them UNIMPLEMENTED there.

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <memory>

#include "absl/strings/str_cat.h"
#include "src/compose/transports.h"
#include "src/core/mesh.h"
#include "src/transport/rdma/rdma_transport.h"
#include "stepmesh/status.h"
#include "tests/rdma/fake_verbs.h"
#include "tests/reliability/fault_transport.h"
#include "tests/reliability/harness.h"

namespace stepmesh::testing {
namespace {

using core::FrameType;

core::TransportFactory FakeRdma(std::shared_ptr<FakeFabric> fabric) {
  auto next_host = std::make_shared<std::atomic<uint32_t>>(1);
  return [fabric, next_host](const MeshOptions& options)
             -> absl::StatusOr<std::unique_ptr<core::Transport>> {
    const uint32_t n = next_host->fetch_add(1);
    FakeNicSpec spec;
    spec.name = absl::StrCat("fake_mlx5_", n);
    spec.ipv4 = 0x0A000000 + n;
    return rdma::CreateRdmaTransport(options, fabric->AddHost(spec));
  };
}

TEST_CASE("fault over rdma: drop, duplicate, rewritten key, dead link", "[fault][rdma]") {
  auto fabric = std::make_shared<FakeFabric>();
  auto plan = std::make_shared<FaultPlan>();
  SECTION("a dropped push: DEADLINE_EXCEEDED on that request only") {
    plan->Add({.action = FaultAction::kDrop, .type = FrameType::kPush, .to = core::ServerId(1)});
    Harness mesh(MeshConfig("rdma"), Faulty(FakeRdma(fabric), plan));
    INFO(mesh.status().ToString());
    REQUIRE(mesh.status().ok());
    auto h = mesh.Start(0, 0, 1);
    REQUIRE(h.ok());
    CHECK(absl::IsDeadlineExceeded(mesh.Finish(0, 0, *h, 1, absl::Milliseconds(500))));
    CHECK(mesh.RoundTrip(0, 1, 2).ok());
  }
  SECTION("a duplicated reply is ignored") {
    plan->Add({.action = FaultAction::kDuplicate, .type = FrameType::kReply, .count = 2});
    Harness mesh(MeshConfig("rdma"), Faulty(FakeRdma(fabric), plan));
    REQUIRE(mesh.status().ok());
    for (int i = 0; i < 4; ++i) {
      const absl::Status s = mesh.RoundTrip(0, i % 2, static_cast<uint8_t>(i));
      INFO(s.ToString());
      CHECK(s.ok());
    }
  }
  SECTION("a reply under another key never lands in that tensor") {
    plan->Add({.action = FaultAction::kRewriteKey,
               .type = FrameType::kReply,
               .from = core::ServerId(0),
               .new_key = RelPullKey(1)});
    Harness mesh(MeshConfig("rdma"), Faulty(FakeRdma(fabric), plan));
    REQUIRE(mesh.status().ok());
    std::fill(mesh.pull(0, 1, 0).begin(), mesh.pull(0, 1, 0).end(), 0xEE);
    std::fill(mesh.pull(0, 1, 1).begin(), mesh.pull(0, 1, 1).end(), 0xEE);
    const absl::Status s = mesh.RoundTrip(0, 0, 1);
    INFO(s.ToString());
    CHECK_FALSE(s.ok());  // the request reports the mismatch
    // KNOWN LIMITATION (unlike TCP): RDMA WRITEs the payload into the region the
    // header names before the receiver sees the header, so the bytes DO land in
    // key 201's pull tensor -- a region this worker registered for server 0's
    // slot, so still "only where that peer may write", but not the addressed
    // tensor. Server 1's tensor of that key is untouched.
    CHECK(std::all_of(mesh.pull(0, 1, 1).begin(), mesh.pull(0, 1, 1).end(),
                      [](uint8_t b) { return b == 0 || b == 0xEE; }));
  }
  SECTION("a server whose link dies: UNAVAILABLE, the other server still serves") {
    plan->Add({.action = FaultAction::kKill, .type = FrameType::kReply, .from = core::ServerId(1)});
    Harness mesh(MeshConfig("rdma"), Faulty(FakeRdma(fabric), plan));
    REQUIRE(mesh.status().ok());
    const absl::Status s = mesh.RoundTrip(0, 0, 1);
    INFO(s.ToString());
    CHECK(absl::IsUnavailable(s));
    CHECK(mesh.RoundTrip(0, 1, 2, absl::Seconds(5), {0}).ok());
  }
}

TEST_CASE("rejoin: a worker restarted in place is served again, over tcp and rdma",
          "[rejoin][rdma]") {
  for (const bool rdma : {false, true}) {
    INFO((rdma ? "rdma (fake verbs)" : "tcp"));
    auto fabric = std::make_shared<FakeFabric>();
    HarnessConfig config = MeshConfig("rdma", /*workers=*/2, /*servers=*/2);
    if (!rdma) config.options.transport = "tcp";
    Harness mesh(config,
                 rdma ? FakeRdma(fabric) : core::TransportFactory(compose::CreateTransport));
    REQUIRE(mesh.status().ok());
    // Batches hold both workers (kAllWorkers): each round needs both.
    auto both = [&](uint8_t fill) -> absl::Status {
      STEPMESH_ASSIGN_OR_RETURN(RequestHandle h0, mesh.Start(0, 0, fill));
      STEPMESH_ASSIGN_OR_RETURN(RequestHandle h1, mesh.Start(1, 0, fill + 1));
      STEPMESH_RETURN_IF_ERROR(mesh.Finish(0, 0, h0, fill, absl::Seconds(5)));
      return mesh.Finish(1, 0, h1, fill + 1, absl::Seconds(5));
    };
    for (int i = 0; i < 5; ++i) REQUIRE(both(static_cast<uint8_t>(10 * i)).ok());
    for (int restart = 0; restart < 2; ++restart) {
      const absl::Status restarted = mesh.RestartWorker(1);
      INFO(restarted.ToString());
      REQUIRE(restarted.ok());
      for (int i = 0; i < 5; ++i) {
        const absl::Status s = both(static_cast<uint8_t>(100 + 10 * i));
        INFO(s.ToString());
        REQUIRE(s.ok());
      }
    }
    CHECK(mesh.server_errors().empty());
    if (rdma) CHECK(fabric->stats().access_errors == 0);
  }
}

}  // namespace
}  // namespace stepmesh::testing
