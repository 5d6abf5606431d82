// A rejoined worker and the hello its server made for the process it
// replaced. The server connects a rejoiner from its peer-event thread while
// its receive side handles the rejoiner's own hello; the Connect's hello can
// read the old process's tag and reach the new process last. A receiver that
// took that tag wrote every frame under a tag the server had released: the
// frames never completed (a request pending until its deadline, the rare
// "rejoin ... over every transport" failure of the libfabric-tcp row).

#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "src/base/sync.h"
#include "src/transport/libfabric/fabric_wire.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "stepmesh/status.h"
#include "tests/libfabric/fabric_pair.h"
#include "tests/support/forwarding_transport.h"
#include "tests/support/status.h"

namespace stepmesh::testing {
namespace {

const core::NodeId kWorker = core::WorkerId(0);

// Once armed, the server's control connection makes the race's bad order
// certain: the rejoiner's hello is delivered only after the server's Connect
// sent its own (held back here), and that one goes out after the answer and
// the first advert, as a late peer-event thread would send it.
class HelloGate {
 public:
  void Arm() {
    base::MutexLock lock(&mu_);
    armed_ = true;
  }
  bool reordered() {
    base::MutexLock lock(&mu_);
    return released_;
  }
  bool AwaitReleased(absl::Duration within) {
    base::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout([this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return released_; },
                                within);
  }
  // Receive side: a carrier from the worker waits (bounded) for the stash.
  void BeforeDelivery(core::NodeId peer) {
    base::MutexLock lock(&mu_);
    if (!armed_ || peer != kWorker) return;
    (void)mu_.AwaitWithTimeout([this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return has_stash_; },
                               absl::Seconds(2));
  }
  // Send side: true when `body` was kept back; `release` gets it back once
  // the first advert went out.
  bool Stash(core::NodeId peer, const core::FrameHeader& h, absl::string_view body) {
    base::MutexLock lock(&mu_);
    if (!armed_ || has_stash_ || peer != kWorker) return false;
    absl::StatusOr<libfabric::ControlMessage> m = libfabric::DecodeControl(body);
    if (!m.ok() || m->type != libfabric::ControlType::kHello) return false;
    header_ = h;
    body_ = std::string(body);
    has_stash_ = true;
    return true;
  }
  bool TakeAfterAdvert(core::NodeId peer, absl::string_view body, core::FrameHeader& h,
                       std::string& stash) {
    base::MutexLock lock(&mu_);
    if (!has_stash_ || released_ || peer != kWorker) return false;
    absl::StatusOr<libfabric::ControlMessage> m = libfabric::DecodeControl(body);
    if (!m.ok() || m->type != libfabric::ControlType::kAdvert) return false;
    h = header_;
    stash = body_;
    released_ = true;
    return true;
  }

 private:
  base::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  bool has_stash_ ABSL_GUARDED_BY(mu_) = false;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  core::FrameHeader header_ ABSL_GUARDED_BY(mu_);
  std::string body_ ABSL_GUARDED_BY(mu_);
};

class GatedControl final : public ForwardingTransport {
 public:
  GatedControl(std::unique_ptr<core::Transport> inner, std::shared_ptr<HelloGate> gate)
      : ForwardingTransport(std::move(inner)), gate_(std::move(gate)) {}
  absl::Status Send(core::NodeId peer, const core::FrameHeader& header, const void* src,
                    core::RegionId src_region, size_t bytes) override {
    const absl::string_view body(static_cast<const char*>(src), bytes);
    if (gate_->Stash(peer, header, body)) return absl::OkStatus();
    absl::Status sent = ForwardingTransport::Send(peer, header, src, src_region, bytes);
    core::FrameHeader late;
    std::string stash;
    if (sent.ok() && gate_->TakeAfterAdvert(peer, body, late, stash)) {
      return ForwardingTransport::Send(peer, late, stash.data(), 0, stash.size());
    }
    return sent;
  }
  absl::Status Poll(core::TransportSink& sink, absl::Duration max_wait) override {
    Gated gated(sink, *gate_);
    return ForwardingTransport::Poll(gated, max_wait);
  }

 private:
  class Gated final : public ForwardingSink {
   public:
    Gated(core::TransportSink& inner, HelloGate& gate) : ForwardingSink(inner), gate_(gate) {}
    void OnFrame(core::NodeId peer, const core::FrameHeader& header, core::FrameContext context,
                 absl::Status status) override {
      gate_.BeforeDelivery(peer);
      ForwardingSink::OnFrame(peer, header, context, std::move(status));
    }

   private:
    HelloGate& gate_;
  };
  std::shared_ptr<HelloGate> gate_;
};

TEST_CASE("libfabric: a rejoiner ignores the hello its server made for the process it replaced",
          "[libfabric][rejoin]") {
  auto gate = std::make_shared<HelloGate>();
  core::TransportFactory control =
      [gate](const MeshOptions& o) -> absl::StatusOr<std::unique_ptr<core::Transport>> {
    STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<core::Transport> tcp, tcp::CreateTcpTransport(o));
    return std::make_unique<GatedControl>(std::move(tcp), gate);
  };
  MeshOptions options;
  options.transport = "libfabric";
  options.fi_provider = "tcp";
  options.timeout = absl::Seconds(5);
  auto made = FabricPair::Make(options, {}, 8192, Device::Cpu(), control);
  REQUIRE_OK(made.status());
  FabricPair& pair = **made;
  pair.StartPolling(absl::Milliseconds(1));
  REQUIRE_OK(pair.Push(1));
  REQUIRE(pair.AwaitFrames(1, absl::Seconds(5)));
  pair.StopPolling();

  gate->Arm();
  REQUIRE_OK(pair.RestartWorker({}, absl::Milliseconds(1)));
  REQUIRE_OK(pair.Push(2));
  // The stale hello went out right behind the advert the push waited for;
  // a moment for the new worker to read it before it pushes again.
  REQUIRE(gate->AwaitReleased(absl::Seconds(5)));
  absl::SleepFor(absl::Milliseconds(100));
  REQUIRE_OK(pair.Push(3));
  // Bounded: on the old code frame 3 (and maybe 2) never completes.
  CHECK(pair.AwaitFrames(3, absl::Seconds(5)));
  CHECK(pair.server_sink().delivered.load() == 3);
  CHECK(pair.server_sink().failed.load() == 0);
  CHECK(pair.SlotMatchesSource());
}

}  // namespace
}  // namespace stepmesh::testing
