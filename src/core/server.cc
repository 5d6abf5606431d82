// AFTensorServer: the facade over one mesh node owning the server's logic
// (src/core/participant_node.h, src/core/server_logic.h). The Participant
// methods are ParticipantNode's; the data path goes to the logic.

#include "stepmesh/server.h"

#include <memory>
#include <utility>

#include "src/core/mesh.h"
#include "src/core/participant_node.h"
#include "src/core/server_logic.h"

namespace stepmesh::core {
namespace {

class Server final : public ParticipantNode<AFTensorServer, ServerLogic> {
 public:
  using ParticipantNode::ParticipantNode;

  int num_workers() const override { return logic().num_workers(); }
  absl::Status RegisterRecvTensor(Key key, TensorView region) override {
    return logic().RegisterRecvTensor(key, region);
  }
  absl::Status RegisterReplyTensor(Key key, TensorView region) override {
    return logic().RegisterReplyTensor(key, region);
  }
  absl::Status Unregister(Key key) override { return logic().Unregister(key); }
  absl::StatusOr<Batch> GetBatch(absl::Duration timeout, BatchPolicy policy) override {
    return logic().GetBatch(timeout, policy);
  }
  absl::Status StreamWaitNextBatch(Stream& stream) override {
    return logic().StreamWaitNextBatch(stream);
  }
  absl::Status Respond(const Batch& batch, absl::Span<const Reply> replies,
                       const SendOptions& send_options) override {
    return logic().Respond(batch, replies, send_options);
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<AFTensorServer>> CreateServer(const MeshOptions& options,
                                                             std::shared_ptr<Backend> backend,
                                                             const TransportFactory& transport,
                                                             RendezvousFactory rendezvous) {
  return CreateParticipant<Server>(options, Role::kServer, std::move(backend), transport,
                                   std::move(rendezvous), "CreateServer");
}

}  // namespace stepmesh::core
