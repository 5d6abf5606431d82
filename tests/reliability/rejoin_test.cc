// Rejoin of a restarted worker over every transport of the table.

#include <atomic>
#include <catch2/catch.hpp>
#include <functional>
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

// One round in which workers 0 and 1 each push to server 0 (filled with
// `fill` and `fill + 1`) and check their replies.
absl::Status BothWorkersRound(Harness& mesh, uint8_t fill) {
  STEPMESH_ASSIGN_OR_RETURN(RequestHandle h0, mesh.Start(0, 0, fill));
  STEPMESH_ASSIGN_OR_RETURN(RequestHandle h1, mesh.Start(1, 0, fill + 1));
  STEPMESH_RETURN_IF_ERROR(mesh.Finish(0, 0, h0, fill, absl::Seconds(5)));
  return mesh.Finish(1, 0, h1, fill + 1, absl::Seconds(5));
}

void RejoinTwice(const TransportCase& row, bool late_loss) {
  INFO(row.name << (late_loss ? ", the old connection's loss reported late" : ""));
  const TransportInstance transport = row.make();
  Harness mesh(MeshConfig(row.transport, /*workers=*/2, /*servers=*/2),
               late_loss ? LateLoss(transport.factory) : transport.factory);
  REQUIRE(mesh.status().ok());
  // Batches hold both workers (kAllWorkers): each round needs both.
  auto both = [&](uint8_t fill) { return BothWorkersRound(mesh, fill); };
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

// A server whose peer-event thread is descheduled right after the transport
// connected a rejoined worker (a loaded machine): its Connect returns only
// when the test releases it. Meanwhile the transport already carries the new
// process's frames, and its goodbye; the losses it reports are counted.
class HeldConnectTransport final : public ForwardingTransport {
 public:
  struct Gate {
    base::Mutex mu;
    bool armed ABSL_GUARDED_BY(mu) = false;     // the next server Connect is held
    bool holding ABSL_GUARDED_BY(mu) = false;   // one is held now
    bool released ABSL_GUARDED_BY(mu) = false;  // the held one may return
    int worker_losses ABSL_GUARDED_BY(mu) = 0;  // reported by the transport
  };
  HeldConnectTransport(std::unique_ptr<core::Transport> inner, std::shared_ptr<Gate> gate)
      : ForwardingTransport(std::move(inner)), gate_(std::move(gate)) {}

  absl::Status Connect(core::NodeId self, absl::Span<const core::PeerInfo> peers,
                       absl::Time deadline) override {
    absl::Status connected = ForwardingTransport::Connect(self, peers, deadline);
    if (!core::IsServer(self)) return connected;
    base::MutexLock lock(&gate_->mu);
    if (!std::exchange(gate_->armed, false)) return connected;
    gate_->holding = true;
    // Bounded: a test that never releases fails on its own deadlines.
    gate_->mu.AwaitWithDeadline([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return gate_->released; },
                                absl::Now() + absl::Seconds(20));
    gate_->holding = false;
    return connected;
  }

  absl::Status Poll(core::TransportSink& sink, absl::Duration max_wait) override {
    Counting counting(sink, *gate_);
    return ForwardingTransport::Poll(counting, max_wait);
  }

 private:
  struct Counting final : ForwardingSink {
    Counting(core::TransportSink& s, Gate& g) : ForwardingSink(s), gate(g) {}
    Gate& gate;
    void OnPeerLost(core::NodeId peer, absl::Status why) override {
      ForwardingSink::OnPeerLost(peer, std::move(why));
      if (!core::IsWorker(peer)) return;
      base::MutexLock lock(&gate.mu);
      ++gate.worker_losses;
    }
  };

  std::shared_ptr<Gate> gate_;
};

// Waits (bounded) until `ready` holds under the gate's lock.
bool AwaitGate(HeldConnectTransport::Gate& gate, const std::function<bool()>& ready) {
  base::MutexLock lock(&gate.mu);
  return gate.mu.AwaitWithDeadline([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return ready(); },
                                   absl::Now() + absl::Seconds(10));
}

void LeaveWhileServerConnects(const TransportCase& row) {
  INFO(row.name);
  const TransportInstance transport = row.make();
  auto gate = std::make_shared<HeldConnectTransport::Gate>();
  core::TransportFactory held =
      [inner = transport.factory,
       gate](const MeshOptions& options) -> absl::StatusOr<std::unique_ptr<core::Transport>> {
    STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<core::Transport> t, inner(options));
    return std::make_unique<HeldConnectTransport>(std::move(t), gate);
  };
  Harness mesh(MeshConfig(row.transport, /*workers=*/2, /*servers=*/1), held);
  REQUIRE(mesh.status().ok());
  // Batches hold every live worker (kAllWorkers).
  auto both = [&](uint8_t fill) { return BothWorkersRound(mesh, fill); };
  REQUIRE_OK(both(1));
  int losses_before = 0;
  {
    base::MutexLock lock(&gate->mu);
    gate->armed = true;
  }
  // The old process leaves in order; the new one joins, is served while the
  // server's Connect is held, and leaves in order too.
  REQUIRE_OK(mesh.RestartWorker(1));
  REQUIRE(AwaitGate(*gate, [&] { return gate->holding; }));
  REQUIRE_OK(both(10));
  {
    // The new process was served: any report of its predecessor's connection came before.
    base::MutexLock lock(&gate->mu);
    losses_before = gate->worker_losses;
  }
  mesh.StopWorker(1);
  REQUIRE(AwaitGate(*gate, [&] { return gate->worker_losses > losses_before; }));
  {
    base::MutexLock lock(&gate->mu);
    gate->released = true;
  }
  // Worker 0 alone: the server must not wait for a worker that is gone.
  for (int i = 0; i < 3; ++i) {
    const absl::Status s = mesh.RoundTrip(0, 0, static_cast<uint8_t>(20 + i), absl::Seconds(5));
    REQUIRE_OK(s);
  }
  CHECK(mesh.server_errors().empty());
  if (transport.verify) CHECK_OK(transport.verify());
}

// The transport carries a rejoined worker's new connection before the
// server's Connect for it returns, so that connection's end can be reported
// in the window where a late report of the old connection is ignored. A new
// process that left in order meanwhile must still be counted out (the
// scheduler's notice of the leave), or every batch waits for it.
TEST_CASE("rejoin: a worker that leaves while the server still connects it is counted out",
          "[rejoin]") {
  for (const TransportCase& row : TransportTable()) LeaveWhileServerConnects(row);
}

}  // namespace
}  // namespace stepmesh::testing
