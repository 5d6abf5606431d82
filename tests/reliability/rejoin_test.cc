// Rejoin of a restarted worker over every transport of the table.

#include <atomic>
#include <catch2/catch.hpp>
#include <memory>
#include <utility>
#include <vector>

#include "src/base/sync.h"
#include "src/core/protocol.h"
#include "stepmesh/status.h"
#include "tests/reliability/harness.h"
#include "tests/support/forwarding_transport.h"
#include "tests/support/status.h"
#include "tests/support/transport_table.h"

namespace stepmesh::testing {
namespace {

// A receive thread that lags behind the rendezvous thread (a loaded machine):
// a worker connection's loss is held back and reported only when the core
// starts connecting that worker's next process, i.e. after the server
// already counted the rejoined worker back in.
class LateLossTransport final : public ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;

  absl::Status Connect(core::NodeId self, absl::Span<const core::PeerInfo> peers,
                       absl::Time deadline) override {
    std::vector<std::pair<core::NodeId, absl::Status>> late;
    {
      base::MutexLock lock(&mu_);
      for (const core::PeerInfo& peer : peers) {
        for (auto it = held_.begin(); it != held_.end();) {
          if (it->first == peer.id) {
            late.push_back(std::move(*it));
            it = held_.erase(it);
          } else {
            ++it;
          }
        }
      }
    }
    core::TransportSink* sink = proxy_.inner.load();
    for (auto& [peer, why] : late) sink->OnPeerLost(peer, why);
    return ForwardingTransport::Connect(self, peers, deadline);
  }

  absl::Status Poll(core::TransportSink& sink, absl::Duration max_wait) override {
    proxy_.inner.store(&sink);
    return ForwardingTransport::Poll(proxy_, max_wait);
  }

 private:
  struct Proxy final : core::TransportSink {
    explicit Proxy(LateLossTransport* o) : owner(o) {}
    LateLossTransport* const owner;
    std::atomic<core::TransportSink*> inner{nullptr};  // set by the receive thread
    absl::Status Resolve(core::NodeId peer, const core::FrameHeader& header, core::Destination& out,
                         core::FrameContext* context) override {
      return inner.load()->Resolve(peer, header, out, context);
    }
    void OnFrame(core::NodeId peer, const core::FrameHeader& header, core::FrameContext context,
                 absl::Status status) override {
      inner.load()->OnFrame(peer, header, context, std::move(status));
    }
    void OnPeerLost(core::NodeId peer, absl::Status why) override {
      if (!core::IsWorker(peer)) return inner.load()->OnPeerLost(peer, std::move(why));
      base::MutexLock lock(&owner->mu_);
      owner->held_.emplace_back(peer, std::move(why));
    }
  };

  base::Mutex mu_;
  std::vector<std::pair<core::NodeId, absl::Status>> held_ ABSL_GUARDED_BY(mu_);
  Proxy proxy_{this};
};

core::TransportFactory LateLoss(core::TransportFactory inner) {
  return [inner = std::move(inner)](
             const MeshOptions& options) -> absl::StatusOr<std::unique_ptr<core::Transport>> {
    STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<core::Transport> transport, inner(options));
    return std::make_unique<LateLossTransport>(std::move(transport));
  };
}

void RejoinTwice(const TransportCase& row, bool late_loss) {
  INFO(row.name << (late_loss ? ", the old connection's loss reported late" : ""));
  const TransportInstance transport = row.make();
  Harness mesh(MeshConfig(row.transport, /*workers=*/2, /*servers=*/2),
               late_loss ? LateLoss(transport.factory) : transport.factory);
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
    REQUIRE_OK(restarted);
    for (int i = 0; i < 5; ++i) {
      const absl::Status s = both(static_cast<uint8_t>(100 + 10 * i));
      REQUIRE_OK(s);
    }
  }
  CHECK(mesh.server_errors().empty());
  if (transport.verify) CHECK_OK(transport.verify());
}

TEST_CASE("rejoin: a worker restarted in place is served again, over every transport", "[rejoin]") {
  for (const TransportCase& row : TransportTable()) RejoinTwice(row, /*late_loss=*/false);
}

// The old connection's end can reach the server after the scheduler announced
// the new process (the receive thread lagging under load): it must not count
// the new process out again, or its requests wait for a batch that never forms.
TEST_CASE("rejoin: a late loss of the old connection does not drop the rejoined worker",
          "[rejoin]") {
  for (const TransportCase& row : TransportTable()) RejoinTwice(row, /*late_loss=*/true);
}

}  // namespace
}  // namespace stepmesh::testing
