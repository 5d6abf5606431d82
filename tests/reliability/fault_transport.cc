#include "tests/reliability/fault_transport.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "stepmesh/status.h"
#include "tests/reliability/wire_proxy.h"
#include "tests/support/forwarding_transport.h"

namespace stepmesh::testing {

void FaultPlan::Add(const FaultRule& rule) {
  base::MutexLock lock(&mu_);
  rules_.push_back({rule, 0, 0});
}

void FaultPlan::RefuseConnect(core::NodeId node) {
  base::MutexLock lock(&mu_);
  refused_.push_back(node);
}

void FaultPlan::Stall(core::NodeId node, absl::Duration duration) {
  base::MutexLock lock(&mu_);
  stalls_[node] = absl::Now() + duration;
}

int FaultPlan::fired(FaultAction action) const {
  base::MutexLock lock(&mu_);
  auto it = fired_.find(action);
  return it == fired_.end() ? 0 : it->second;
}

int FaultPlan::delivered(core::NodeId node) const {
  base::MutexLock lock(&mu_);
  auto it = delivered_.find(node);
  return it == delivered_.end() ? 0 : it->second;
}

void FaultPlan::CountDelivered(core::NodeId node) {
  base::MutexLock lock(&mu_);
  ++delivered_[node];
}

bool IsWireFault(FaultAction action) {
  return action == FaultAction::kCorruptHeader || action == FaultAction::kCorruptPayload ||
         action == FaultAction::kTruncate;
}

std::optional<FaultRule> FaultPlan::Match(const core::FrameHeader& h, bool wire) {
  base::MutexLock lock(&mu_);
  for (Armed& a : rules_) {
    const FaultRule& r = a.rule;
    if (IsWireFault(r.action) != wire) continue;
    if (r.type.has_value() && *r.type != h.type) continue;
    if (r.from != core::kNoNode && r.from != h.src) continue;
    if (r.to != core::kNoNode && r.to != h.dst) continue;
    if (a.seen++ < r.skip) continue;
    if (r.count >= 0 && a.hit >= r.count) continue;
    ++a.hit;
    ++fired_[r.action];
    return r;
  }
  return std::nullopt;
}

bool FaultPlan::refuses(core::NodeId node) const {
  base::MutexLock lock(&mu_);
  for (core::NodeId n : refused_) {
    if (n == node) return true;
  }
  return false;
}

absl::Time FaultPlan::stalled_until(core::NodeId node) const {
  base::MutexLock lock(&mu_);
  auto it = stalls_.find(node);
  return it == stalls_.end() ? absl::InfinitePast() : it->second;
}

namespace {

// Counts what a node's transport hands to its core (tests wait for a frame to
// have been dealt with instead of sleeping).
class CountingSink final : public ForwardingSink {
 public:
  CountingSink(core::TransportSink& inner, FaultPlan& plan, core::NodeId self)
      : ForwardingSink(inner), plan_(plan), self_(self) {}
  void OnFrame(core::NodeId peer, const core::FrameHeader& header, core::FrameContext context,
               absl::Status status) override {
    ForwardingSink::OnFrame(peer, header, context, std::move(status));
    plan_.CountDelivered(self_);
  }

 private:
  FaultPlan& plan_;
  const core::NodeId self_;
};

class FaultTransport final : public core::Transport {
 public:
  FaultTransport(std::unique_ptr<core::Transport> inner, std::shared_ptr<FaultPlan> plan)
      : inner_(std::move(inner)), plan_(std::move(plan)) {}

  absl::string_view name() const override { return inner_->name(); }
  absl::StatusOr<std::string> LocalEndpoint() override { return inner_->LocalEndpoint(); }

  absl::Status Connect(core::NodeId self, absl::Span<const core::PeerInfo> peers,
                       absl::Time deadline) override {
    self_.store(self);
    if (plan_->refuses(self)) {
      return absl::UnavailableError("fault injection: connection refused");
    }
    return inner_->Connect(self, peers, deadline);
  }

  absl::Status RegisterRegion(const core::RegionInfo& region) override {
    return inner_->RegisterRegion(region);
  }
  absl::Status UnregisterRegion(core::RegionId id) override { return inner_->UnregisterRegion(id); }

  absl::Status Send(core::NodeId peer, const core::FrameHeader& header, const void* src,
                    core::RegionId src_region, size_t bytes) override {
    if (killed_.load()) return absl::UnavailableError("fault injection: this node's link is dead");
    std::optional<FaultRule> rule = plan_->Match(header, /*wire=*/false);
    if (!rule.has_value()) return inner_->Send(peer, header, src, src_region, bytes);
    core::FrameHeader h = header;
    switch (rule->action) {
      case FaultAction::kDrop:
        return absl::OkStatus();
      case FaultAction::kDelay:
        absl::SleepFor(rule->delay);
        return inner_->Send(peer, h, src, src_region, bytes);
      case FaultAction::kDuplicate:
        STEPMESH_RETURN_IF_ERROR(inner_->Send(peer, h, src, src_region, bytes));
        return inner_->Send(peer, h, src, src_region, bytes);
      case FaultAction::kRewriteKey:
        h.key = rule->new_key;
        return inner_->Send(peer, h, src, src_region, bytes);
      case FaultAction::kForgeSource:
        h.src = rule->new_src;
        return inner_->Send(peer, h, src, src_region, bytes);
      case FaultAction::kKill:
        killed_.store(true);
        inner_->Shutdown();
        return absl::UnavailableError("fault injection: this node's link died");
      case FaultAction::kCorruptHeader:
      case FaultAction::kCorruptPayload:
      case FaultAction::kTruncate:
        break;  // the wire proxy's
    }
    return inner_->Send(peer, h, src, src_region, bytes);
  }

  absl::Status Poll(core::TransportSink& sink, absl::Duration max_wait) override {
    const absl::Time until = plan_->stalled_until(self_.load());
    const absl::Time now = absl::Now();
    if (killed_.load() || now < until) {
      // Deliver nothing (the frames wait in the socket, as with a stopped process).
      const absl::Duration nap = killed_.load() ? max_wait : std::min(max_wait, until - now);
      if (nap > absl::ZeroDuration()) absl::SleepFor(std::min(nap, absl::Milliseconds(5)));
      return absl::OkStatus();
    }
    CountingSink counting(sink, *plan_, self_.load());
    return inner_->Poll(counting, max_wait);
  }

  void Wake() override { inner_->Wake(); }
  void Shutdown() override { inner_->Shutdown(); }

 private:
  std::unique_ptr<core::Transport> inner_;
  std::shared_ptr<FaultPlan> plan_;
  std::atomic<core::NodeId> self_{core::kNoNode};
  std::atomic<bool> killed_{false};
};

}  // namespace

std::unique_ptr<core::Transport> WrapWithFaults(std::unique_ptr<core::Transport> inner,
                                                std::shared_ptr<FaultPlan> plan) {
  return std::make_unique<FaultTransport>(std::move(inner), std::move(plan));
}

core::TransportFactory Faulty(core::TransportFactory inner, std::shared_ptr<FaultPlan> plan,
                              bool wire) {
  return [inner = std::move(inner), plan = std::move(plan),
          wire](const MeshOptions& options) -> absl::StatusOr<std::unique_ptr<core::Transport>> {
    STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<core::Transport> t, inner(options));
    if (wire) t = WrapWithWireProxy(std::move(t), plan);
    return WrapWithFaults(std::move(t), plan);
  };
}

core::TransportFactory FaultyTcp(std::shared_ptr<FaultPlan> plan) {
  return Faulty(tcp::CreateTcpTransport, std::move(plan), /*wire=*/true);
}

}  // namespace stepmesh::testing
