#pragma once
// A transport that forwards every call to another one: the base for test
// decorators that change one behaviour.

#include <memory>
#include <utility>

#include "src/core/transport.h"

namespace stepmesh::testing {

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
