// The libfabric transport: a frame is complete when its descriptor and every
// one of its writes have landed, in whatever order they come. The reordering
// poster (libfabric_transport.h) holds every write and posts them newest
// first, one per millisecond -- each frame's last chunk lands first, as it may
// on EFA's SRD. The counted transport must stay byte-exact under it; the
// order-dependent variant (only the last write signals, as on RC) must not,
// which shows that the reordering reaches the data.

#include <rdma/fi_errno.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "src/compose/transports.h"
#include "src/core/protocol.h"
#include "src/transport/libfabric/fabric_endpoint.h"
#include "src/transport/libfabric/fabric_wire.h"
#include "src/transport/libfabric/frame_assembler.h"
#include "src/transport/libfabric/libfabric_transport.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "tests/libfabric/fabric_pair.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/mesh_scenarios.h"
#include "tests/support/scoped_env.h"
#include "tests/support/status.h"

namespace stepmesh::testing {
namespace {

using libfabric::FrameAssembler;
using libfabric::FrameDescriptor;

core::TransportFactory Reordered(const std::string& provider, bool order_dependent) {
  return [provider, order_dependent](const MeshOptions& options) {
    MeshOptions o = options;
    o.fi_provider = provider;
    libfabric::LibfabricHooks hooks;
    hooks.poster = [] { return libfabric::MakeReorderingPoster(absl::Milliseconds(1)); };
    hooks.chunk_bytes = 4096;  // every push and pull is several writes
    hooks.signal_last_chunk_only = order_dependent;
    return libfabric::CreateLibfabricTransport(o, tcp::CreateTcpTransport, std::move(hooks));
  };
}

Scenario SmallScenario() {
  return {.workers = 1,
          .servers = 1,
          .micro_batches = 2,
          .iterations = 3,
          .push_bytes = 6 * 4096,  // 6 writes
          .pull_bytes = 5 * 4096,  // 5 writes
          .step_timeout = absl::Seconds(10)};
}

MeshOptions Base() {
  MeshOptions o;
  o.transport = "libfabric";
  o.timeout = absl::Seconds(10);
  return o;
}

TEST_CASE("libfabric: writes landing newest first are counted, the data is exact",
          "[libfabric][reorder]") {
  for (const char* provider : {"shm", "tcp"}) {
    DYNAMIC_SECTION(provider) {
      // 2A2F: each server counts two writers' frames, each writer's two
      // micro-batches in flight, all their writes interleaved newest first.
      Scenario sc = SmallScenario();
      sc.workers = 2;
      sc.servers = 2;
      CHECK_OK(RunInProcess(sc, Base(), Reordered(provider, false)));
    }
  }
}

TEST_CASE("libfabric: the order-dependent variant fails under the same reordering",
          "[libfabric][reorder]") {
  // Only each frame's last write signals, and its landing is taken for all:
  // the frame is delivered while its other writes are still held, so the
  // scenario's byte check (or its deadline) fails. If this passed, the
  // reordering poster would not be reordering and the test above would
  // prove nothing.
  // The worker's own verdict: whichever participant reports first (a server
  // may say "every worker is gone" once the failed worker left), the worker
  // saw wrong bytes.
  const Scenario sc = SmallScenario();
  MeshOptions o = Base();
  o.num_workers = sc.workers;
  o.num_servers = sc.servers;
  auto mesh = LoopbackMesh::Start(o, Reordered("shm", true));
  REQUIRE_OK(mesh.status());
  absl::Status worker_status;
  const absl::Status s = RunParticipants(
      **mesh,
      [&](AFTensorWorker& worker) {
        worker_status = RunWorker(worker, sc);
        return worker_status;
      },
      [&](AFTensorServer& server) { return RunServer(server, sc); });
  INFO("the order-dependent variant: " << s.ToString()
                                       << "; the worker: " << worker_status.ToString());
  CHECK_FALSE(s.ok());
  CHECK(absl::IsDataLoss(worker_status));  // bytes that had not landed yet
}

// Refuses every write with -FI_EAGAIN while `refuse` is set, as a provider
// whose queue to a peer is full does.
class RefusingPoster final : public libfabric::WritePoster {
 public:
  explicit RefusingPoster(std::shared_ptr<std::atomic<bool>> refuse)
      : refuse_(std::move(refuse)), direct_(libfabric::MakeDirectPoster()) {}
  ssize_t Post(fid_ep* ep, const libfabric::WriteOp& op) override {
    if (refuse_->load()) return -FI_EAGAIN;
    return direct_->Post(ep, op);
  }

 private:
  std::shared_ptr<std::atomic<bool>> refuse_;
  std::unique_ptr<libfabric::WritePoster> direct_;
};

TEST_CASE(
    "libfabric: writes the provider refuses queue for that peer, a full queue is "
    "RESOURCE_EXHAUSTED naming it, and the queue drains in order",
    "[libfabric][queue]") {
  MeshOptions o = Base();
  o.fi_provider = "shm";
  o.timeout = absl::Seconds(5);
  auto refuse = std::make_shared<std::atomic<bool>>(true);
  libfabric::LibfabricHooks hooks;
  hooks.chunk_bytes = 4096;
  hooks.poster = [refuse] { return std::make_unique<RefusingPoster>(refuse); };
  constexpr size_t kBytes = 64 << 10;  // 16 writes a frame
  auto made = FabricPair::Make(o, hooks, kBytes);
  REQUIRE_OK(made.status());
  FabricPair& pair = **made;
  pair.StartPolling(absl::Milliseconds(1));

  int accepted = 0;
  absl::Status full;
  const absl::Time start = absl::Now();
  for (int i = 0; i < 1000 && full.ok(); ++i) {
    full = pair.Push(static_cast<uint64_t>(i));
    if (full.ok()) ++accepted;
  }
  INFO(full.ToString());
  CHECK(absl::IsResourceExhausted(full));
  CHECK(absl::StrContains(full.message(), core::PeerName(core::ServerId(0))));
  CHECK(accepted == 4096 / 16);                     // the queue's bound, in frames
  CHECK(absl::Now() - start < absl::Seconds(2));    // no send waited for the provider
  CHECK(pair.server_sink().delivered.load() == 0);  // the descriptors wait for their writes
  refuse->store(false);  // room again: the queue drains and every frame completes
  CHECK(pair.AwaitFrames(accepted, absl::Seconds(10)));
  CHECK(pair.server_sink().delivered.load() == accepted);
  CHECK(pair.server_sink().failed.load() == 0);
  CHECK(pair.SlotMatchesSource());
}

FrameDescriptor Descriptor(uint32_t seq, uint32_t chunks) {
  FrameDescriptor d;
  d.seq = seq;
  d.chunks = chunks;
  d.header.type = core::FrameType::kPush;
  d.header.payload_bytes = chunks * 100;
  d.header.part_count = 1;
  return d;
}

TEST_CASE("libfabric: frame assembler completes by count in any order, delivers in order",
          "[libfabric][assembler]") {
  FrameAssembler a;
  const absl::Time now = absl::Now();
  a.OnChunk(2);  // frame 2's write lands before any descriptor
  a.OnDescriptor(Descriptor(1, 2), now);
  a.OnDescriptor(Descriptor(2, 1), now);
  CHECK(a.Ready() == nullptr);  // frame 2 is complete but frame 1 is first
  a.OnChunk(1);
  CHECK(a.Ready() == nullptr);
  a.OnChunk(1);
  REQUIRE(a.Ready() != nullptr);
  CHECK(a.Ready()->seq == 1);
  CHECK(a.Ready()->failure.ok());
  a.Pop();
  REQUIRE(a.Ready() != nullptr);
  CHECK(a.Ready()->seq == 2);
  a.Pop();
  CHECK_FALSE(a.waiting());

  SECTION("an extra write fails the frame") {
    a.OnDescriptor(Descriptor(3, 1), now);
    a.OnChunk(3);
    a.OnChunk(3);
    REQUIRE(a.Ready() != nullptr);
    CHECK(absl::IsDataLoss(a.Ready()->failure));
  }
  SECTION("an abort ahead of its descriptor fails the frame") {
    a.OnAbort(4, absl::DataLossError("write failed"));
    a.OnDescriptor(Descriptor(4, 3), now);
    REQUIRE(a.Ready() != nullptr);
    CHECK(absl::IsDataLoss(a.Ready()->failure));
  }
  SECTION("a frame with no writes is complete at once") {
    a.OnDescriptor(Descriptor(5, 0), now);
    CHECK(a.Ready() != nullptr);
  }
}

TEST_CASE("libfabric: control messages round-trip and garbage is refused", "[libfabric][wire]") {
  libfabric::Hello hello{.epoch = 42,
                         .your_tag = 7,
                         .your_epoch = 0x1234567890abcdefull,
                         .provider = "shm",
                         .addresses = {"fi_shm://1", "fi_shm://2"}};
  auto m = libfabric::DecodeControl(libfabric::EncodeHello(hello));
  REQUIRE_OK(m.status());
  CHECK(m->hello.epoch == 42);
  CHECK(m->hello.your_tag == 7);
  CHECK(m->hello.your_epoch == 0x1234567890abcdefull);
  CHECK(m->hello.addresses == std::vector<std::string>{"fi_shm://1", "fi_shm://2"});
  FrameDescriptor d = Descriptor(9, 0);
  d.header.payload_bytes = 3;
  d.inline_bytes = "abc";
  auto f = libfabric::DecodeControl(libfabric::EncodeFrame(d));
  REQUIRE_OK(f.status());
  CHECK(f->frame.inline_bytes == "abc");
  std::string bad = libfabric::EncodeFrame(d);
  bad[20] ^= 1;  // inside the header: its CRC fails
  CHECK(absl::IsDataLoss(libfabric::DecodeControl(bad).status()));
  CHECK_FALSE(libfabric::DecodeControl("").ok());
  CHECK_FALSE(libfabric::DecodeControl(std::string("\x63", 1)).ok());
  CHECK(libfabric::ImmediateSeq(libfabric::Immediate(4095, 0xFFFFF)) == 0xFFFFF);
  CHECK(libfabric::ImmediateTag(libfabric::Immediate(4095, 0xFFFFF)) == 4095);
}

TEST_CASE("libfabric: an unknown provider is named, with the ones this machine has",
          "[libfabric][bad-input]") {
  MeshOptions o = Base();
  o.fi_provider = "carrier-pigeon";
  const absl::Status s = compose::CreateTransport(o).status();
  INFO(s.ToString());
  CHECK(absl::IsNotFound(s));
  CHECK(absl::StrContains(s.message(), "'carrier-pigeon'"));
  CHECK(absl::StrContains(s.message(), "providers on this machine:"));
  CHECK(absl::StrContains(s.message(), "shm"));
}

// libfabric behind the FabricApi seam, with what the provider reports edited:
// this machine's providers all have RMA and CQ data, EFA-less clouds and
// old providers do not.
const libfabric::FabricApi* real_api = nullptr;
bool strip_rma = false;
int Edited(uint32_t version, const char* node, const char* service, uint64_t flags,
           const fi_info* hints, fi_info** info) {
  if (strip_rma && hints != nullptr && (hints->caps & FI_RMA) != 0) return -FI_ENODATA;
  const int rc = real_api->getinfo(version, node, service, flags, hints, info);
  if (rc == 0 && !strip_rma) {
    for (fi_info* i = *info; i != nullptr; i = i->next) i->domain_attr->cq_data_size = 0;
  }
  return rc;
}

TEST_CASE("libfabric: a provider without RMA or remote CQ data is refused by name",
          "[libfabric][bad-input]") {
  auto api = libfabric::LoadFabricApi();
  REQUIRE_OK(api.status());
  real_api = *api;
  libfabric::FabricApi edited = **api;
  edited.getinfo = Edited;
  const libfabric::EndpointConfig shm{.provider = "shm", .host = ""};
  // Without FI_RMA (strip_rma), or with RMA but no remote CQ data.
  for (const auto& [strip, lacks] :
       {std::pair{true, "'shm' lacks FI_RMA"}, {false, "'shm' lacks remote CQ data"}}) {
    DYNAMIC_SECTION(lacks) {
      strip_rma = strip;
      const absl::Status s = libfabric::FabricEndpoint::Open(edited, shm).status();
      INFO(s.ToString());
      CHECK(absl::IsFailedPrecondition(s));
      CHECK(absl::StrContains(s.message(), lacks));
    }
  }
  SECTION("the real one opens") {
    auto e = libfabric::FabricEndpoint::Open(**api, shm);
    REQUIRE_OK(e.status());
    CHECK((*e)->provider() == "shm");
    CHECK((*e)->cq_data_size() >= 4);
  }
  SECTION("a utility provider alone has no RDM endpoint") {
    const absl::Status s =
        libfabric::FabricEndpoint::Open(**api, {.provider = "ofi_hook_noop", .host = ""}).status();
    INFO(s.ToString());
    CHECK(absl::IsNotFound(s));
    CHECK(absl::StrContains(s.message(), "'ofi_hook_noop'"));
  }
}

TEST_CASE("libfabric: selected through the environment table", "[libfabric][options]") {
  {
    ScopedEnv env({{"STEPMESH_TRANSPORT", "libfabric"}, {"STEPMESH_FI_PROVIDER", "shm"}});
    auto o = MeshOptions::FromEnv();
    REQUIRE_OK(o.status());
    CHECK(o->transport == "libfabric");
    CHECK(o->fi_provider == "shm");
  }
  {
    ScopedEnv env({{"FI_PROVIDER", "tcp"}, {"DMLC_ENABLE_RDMA", "fabric"}});
    auto o = MeshOptions::FromEnv();
    REQUIRE_OK(o.status());
    CHECK(o->transport == "libfabric");
    CHECK(o->fi_provider == "tcp");
  }
  {
    ScopedEnv env({{"FI_PROVIDER", "tcp"}, {"STEPMESH_FI_PROVIDER", "shm"}});
    auto o = MeshOptions::FromEnv();
    REQUIRE_OK(o.status());
    CHECK(o->fi_provider == "shm");  // STEPMESH_* wins
  }
}

}  // namespace
}  // namespace stepmesh::testing
