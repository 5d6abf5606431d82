// The libfabric transport's rails and its sleep.
//
// Rails: on CI the tcp and shm providers list one NIC each (tcp bound to
// 127.0.0.1: "lo"; shm: "shm"), so two rails are two fabric/domain/endpoint
// sets opened on that one NIC -- each with its own MRs, keys, address vector,
// CQs and address, exactly what two EFA devices give, only not twice the
// bandwidth. A payload of at least fi_stripe_min_bytes is split across them;
// the writes of both halves are counted at the receiver like any others.
//
// Sleep: with a CQ wait fd (tcp), an idle transport in blocking mode sleeps
// in epoll on it and on its control connection instead of waking every
// millisecond to read its CQs.

#include <rdma/fi_errno.h>
#include <sys/resource.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "src/base/sync.h"
#include "src/transport/libfabric/fabric_endpoint.h"
#include "src/transport/libfabric/libfabric_transport.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "tests/libfabric/fabric_pair.h"
#include "tests/support/mesh_scenarios.h"
#include "tests/support/status.h"

namespace stepmesh::testing {
namespace {

// What went out on which rail (all transports of a test share one).
struct RailCounts {
  base::Mutex mu;
  std::vector<size_t> bytes = std::vector<size_t>(libfabric::kMaxRails, 0);
  std::set<fid_ep*> endpoints;
};

// Posts through fi_writemsg, counting what the provider took; writes on
// `fail_rail` fail with -FI_EIO, as fi_writemsg on a NIC that went away does.
// (A failed write's error completion takes the same path, Finish -> abort;
// neither CI provider can be made to produce one: a write with a wrong remote
// key is never completed by shm or tcp at all, which the receiver's timeout
// covers.)
class CountingPoster final : public libfabric::WritePoster {
 public:
  CountingPoster(std::shared_ptr<RailCounts> counts, std::shared_ptr<std::atomic<int>> fail_rail)
      : counts_(std::move(counts)),
        fail_rail_(std::move(fail_rail)),
        direct_(libfabric::MakeDirectPoster()) {}
  ssize_t Post(fid_ep* ep, const libfabric::WriteOp& op) override {
    if (fail_rail_ != nullptr && static_cast<int>(op.rail) == fail_rail_->load()) {
      return -FI_EIO;
    }
    const ssize_t rc = direct_->Post(ep, op);
    if (rc == 0) {  // not the attempts the provider refused (-FI_EAGAIN)
      base::MutexLock lock(&counts_->mu);
      counts_->bytes[op.rail] += op.len;
      counts_->endpoints.insert(ep);
    }
    return rc;
  }

 private:
  std::shared_ptr<RailCounts> counts_;
  std::shared_ptr<std::atomic<int>> fail_rail_;
  std::unique_ptr<libfabric::WritePoster> direct_;
};

MeshOptions TwoRails(const std::string& provider) {
  MeshOptions o;
  o.transport = "libfabric";
  o.fi_provider = provider;
  o.timeout = absl::Seconds(10);
  o.fi_nics = 2;
  o.fi_stripe_min_bytes = 8192;
  return o;
}

TEST_CASE("libfabric: payloads of at least the threshold are striped over two rails, byte-exact",
          "[libfabric][rails]") {
  for (const char* provider : {"shm", "tcp"}) {
    DYNAMIC_SECTION(provider) {
      auto counts = std::make_shared<RailCounts>();
      const MeshOptions base = TwoRails(provider);
      core::TransportFactory factory = [counts, base](const MeshOptions& options) {
        MeshOptions o = options;
        o.fi_provider = base.fi_provider;
        o.fi_nics = base.fi_nics;
        o.fi_stripe_min_bytes = base.fi_stripe_min_bytes;
        libfabric::LibfabricHooks hooks;
        hooks.poster = [counts] { return std::make_unique<CountingPoster>(counts, nullptr); };
        hooks.chunk_bytes = 4096;  // each half is several writes
        return libfabric::CreateLibfabricTransport(o, tcp::CreateTcpTransport, std::move(hooks));
      };
      Scenario sc;
      sc.workers = 2;
      sc.servers = 2;
      sc.micro_batches = 2;
      sc.iterations = 3;
      sc.push_bytes = 6 * 4096;      // striped: 12 KiB on each rail
      sc.pull_bytes = 5 * 4096 + 8;  // striped: 12 KiB, then 8 KiB + 8 bytes
      sc.step_timeout = absl::Seconds(10);
      CHECK_OK(RunInProcess(sc, base, factory));
      base::MutexLock lock(&counts->mu);
      INFO("rail 0: " << counts->bytes[0] << " bytes, rail 1: " << counts->bytes[1]);
      CHECK(counts->bytes[1] > 0);
      // Both halves: the page-aligned first half on rail 0, the rest on rail 1.
      CHECK(counts->bytes[0] > counts->bytes[1]);
      CHECK(counts->bytes[1] * 2 > counts->bytes[0]);
      CHECK(counts->bytes[2] == 0);
      // Four participants, two endpoints each, every one of them used by a writer.
      CHECK(counts->endpoints.size() == 8);
    }
  }
}

TEST_CASE("libfabric: below the threshold a payload goes whole on the first rail",
          "[libfabric][rails]") {
  auto counts = std::make_shared<RailCounts>();
  libfabric::LibfabricHooks hooks;
  hooks.poster = [counts] { return std::make_unique<CountingPoster>(counts, nullptr); };
  auto made = FabricPair::Make(TwoRails("shm"), hooks, 8192 - 8);
  REQUIRE_OK(made.status());
  FabricPair& pair = **made;
  pair.StartPolling(absl::Milliseconds(1));
  REQUIRE_OK(pair.Push(1));
  REQUIRE(pair.AwaitFrames(1, absl::Seconds(10)));
  CHECK(pair.server_sink().delivered.load() == 1);
  CHECK(pair.SlotMatchesSource());
  base::MutexLock lock(&counts->mu);
  CHECK(counts->bytes[0] == 8192 - 8);
  CHECK(counts->bytes[1] == 0);
}

TEST_CASE(
    "libfabric: a stripe that fails fails its frame with DATA_LOSS naming the rail, and the "
    "next frame goes through",
    "[libfabric][rails]") {
  for (const char* provider : {"shm", "tcp"}) {
    DYNAMIC_SECTION(provider) {
      auto counts = std::make_shared<RailCounts>();
      auto fail = std::make_shared<std::atomic<int>>(1);
      libfabric::LibfabricHooks hooks;
      hooks.poster = [counts, fail] { return std::make_unique<CountingPoster>(counts, fail); };
      auto made = FabricPair::Make(TwoRails(provider), hooks, 64 << 10);
      REQUIRE_OK(made.status());
      FabricPair& pair = **made;
      pair.StartPolling(absl::Milliseconds(1));
      REQUIRE_OK(pair.Push(1));
      REQUIRE(pair.AwaitFrames(1, absl::Seconds(10)));
      const absl::Status why = pair.server_sink().last_failure();
      INFO(why.ToString());
      CHECK(pair.server_sink().failed.load() == 1);
      CHECK(absl::IsDataLoss(why));
      CHECK(absl::StrContains(why.message(), "could not write the payload"));
      CHECK(absl::StrContains(why.message(), "rail 1"));
      fail->store(-1);  // the NIC is back
      REQUIRE_OK(pair.Push(2));
      REQUIRE(pair.AwaitFrames(2, absl::Seconds(10)));
      CHECK(pair.server_sink().delivered.load() == 1);
      CHECK(pair.SlotMatchesSource());
      CHECK(pair.server_sink().lost.load() == 0);
    }
  }
}

struct Usage {
  absl::Duration cpu;
  long wakeups = 0;  // voluntary context switches, every thread of the process
};
Usage ProcessUsage() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return {absl::DurationFromTimeval(u.ru_utime) + absl::DurationFromTimeval(u.ru_stime),
          u.ru_nvcsw};
}

TEST_CASE(
    "libfabric: in blocking mode an idle transport sleeps on its CQ wait fd (tcp) and still "
    "delivers, and shm (no wait object) polls",
    "[libfabric][blocking][cpu-budget]") {
  MeshOptions o;
  o.transport = "libfabric";
  o.timeout = absl::Seconds(10);
  o.threads.poll_mode = PollMode::kBlocking;
  SECTION("tcp: a wait fd") {
    o.fi_provider = "tcp";
    auto made = FabricPair::Make(o, {}, 1 << 20);
    REQUIRE_OK(made.status());
    FabricPair& pair = **made;
    CHECK(pair.worker().WaitFd() >= 0);
    CHECK(pair.server().WaitFd() >= 0);
    // As the core's receive loop in blocking mode: at most 50 ms per Poll.
    pair.StartPolling(absl::Milliseconds(50));
    REQUIRE_OK(pair.Push(1));  // the connection between the rails is made
    REQUIRE(pair.AwaitFrames(1, absl::Seconds(10)));
    absl::SleepFor(absl::Milliseconds(100));
    const Usage before = ProcessUsage();
    absl::SleepFor(absl::Seconds(1));
    const Usage after = ProcessUsage();
    const absl::Duration cpu = after.cpu - before.cpu;
    const long wakeups = after.wakeups - before.wakeups;
    // Measured here: asleep, the two Poll threads wake ~40 times (50 ms
    // each) for ~1.4 ms of CPU; polled every millisecond (the mode without a
    // wait fd), ~1700 times for 18-29 ms. The bounds sit far from both.
    INFO("over an idle second: " << absl::FormatDuration(cpu) << " of CPU, " << wakeups
                                 << " voluntary context switches");
    CHECK(wakeups < 400);
    CHECK(cpu < absl::Milliseconds(10));
    // Asleep, it still wakes for the fabric: a write and its descriptor land.
    const absl::Time sent = absl::Now();
    REQUIRE_OK(pair.Push(2));
    REQUIRE(pair.AwaitFrames(2, absl::Seconds(10)));
    INFO("delivered after " << absl::FormatDuration(absl::Now() - sent));
    CHECK(absl::Now() - sent < absl::Seconds(1));  // not a timeout's worth of Poll calls
    CHECK(pair.server_sink().delivered.load() == 2);
    CHECK(pair.SlotMatchesSource());
  }
  SECTION("shm: polled") {
    o.fi_provider = "shm";
    auto made = FabricPair::Make(o, {}, 1 << 20);
    REQUIRE_OK(made.status());
    FabricPair& pair = **made;
    CHECK(pair.worker().WaitFd() == -1);
    pair.StartPolling(absl::Milliseconds(50));
    REQUIRE_OK(pair.Push(1));
    REQUIRE(pair.AwaitFrames(1, absl::Seconds(10)));
    CHECK(pair.server_sink().delivered.load() == 1);
    CHECK(pair.SlotMatchesSource());
  }
}

}  // namespace
}  // namespace stepmesh::testing
