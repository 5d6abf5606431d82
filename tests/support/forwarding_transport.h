#pragma once
// A transport (and a transport sink) that forwards every call to another one:
// the bases for test decorators that change one behaviour.

#include <memory>
#include <utility>

#include "src/core/transport.h"

namespace stepmesh::testing {

// Forwards what a transport hands its core; a decorator overrides the calls it
// watches and calls these.
class ForwardingSink : public core::TransportSink {
 public:
  explicit ForwardingSink(core::TransportSink& inner) : inner_(inner) {}
  absl::Status Resolve(core::NodeId peer, const core::FrameHeader& header, core::Destination& out,
                       core::FrameContext* context) override {
    return inner_.Resolve(peer, header, out, context);
  }
  void OnFrame(core::NodeId peer, const core::FrameHeader& header, core::FrameContext context,
               absl::Status status) override {
    inner_.OnFrame(peer, header, context, std::move(status));
  }
  void OnPeerLost(core::NodeId peer, absl::Status why) override {
    inner_.OnPeerLost(peer, std::move(why));
  }

 private:
  core::TransportSink& inner_;
};

class ForwardingTransport : public core::Transport {
 public:
  explicit ForwardingTransport(std::unique_ptr<core::Transport> inner) : inner_(std::move(inner)) {}
  absl::string_view name() const override { return inner_->name(); }
  absl::StatusOr<std::string> LocalEndpoint() override { return inner_->LocalEndpoint(); }
  absl::Status Connect(core::NodeId self, absl::Span<const core::PeerInfo> peers,
                       absl::Time deadline) override {
    return inner_->Connect(self, peers, deadline);
  }
  bool CanAccess(const Device& device) const override { return inner_->CanAccess(device); }
  absl::Status RegisterRegion(const core::RegionInfo& region) override {
    return inner_->RegisterRegion(region);
  }
  absl::Status UnregisterRegion(core::RegionId id) override { return inner_->UnregisterRegion(id); }
  absl::Status Send(core::NodeId peer, const core::FrameHeader& header, const void* src,
                    core::RegionId src_region, size_t bytes) override {
    return inner_->Send(peer, header, src, src_region, bytes);
  }
  absl::Status Poll(core::TransportSink& sink, absl::Duration max_wait) override {
    return inner_->Poll(sink, max_wait);
  }
  void Wake() override { inner_->Wake(); }
  void Shutdown() override { inner_->Shutdown(); }

 private:
  std::unique_ptr<core::Transport> inner_;
};

}  // namespace stepmesh::testing
