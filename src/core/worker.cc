// AFTensorWorker: the facade over one mesh node owning the worker's logic
// (src/core/participant_node.h, src/core/worker_logic.h). The Participant
// methods are ParticipantNode's; the data path goes to the logic.

#include "stepmesh/worker.h"

#include <memory>
#include <utility>

#include "src/core/mesh.h"
#include "src/core/participant_node.h"
#include "src/core/worker_logic.h"

namespace stepmesh::core {
namespace {

class Worker final : public ParticipantNode<AFTensorWorker, WorkerLogic> {
 public:
  using ParticipantNode::ParticipantNode;

  int num_servers() const override { return logic().num_servers(); }
  absl::Status RegisterPushTensor(Key key, TensorView tensor) override {
    return logic().RegisterPushTensor(key, tensor);
  }
  absl::Status RegisterPullTensor(Key key, int server, TensorView tensor) override {
    return logic().RegisterPullTensor(key, server, tensor);
  }
  absl::Status Unregister(Key key) override { return logic().Unregister(key); }
  absl::StatusOr<PreparedRequest> Prepare(absl::Span<const Push> pushes,
                                          absl::Span<const Pull> pulls) override {
    return logic().Prepare(pushes, pulls);
  }
  absl::StatusOr<RequestHandle> Post(const PreparedRequest& prepared,
                                     const SendOptions& send_options) override {
    return logic().Post(prepared, send_options);
  }
  absl::StatusOr<RequestHandle> PushPull(absl::Span<const Push> pushes,
                                         absl::Span<const Pull> pulls,
                                         const SendOptions& send_options) override {
    return logic().PushPull(pushes, pulls, send_options);
  }
  absl::Status Wait(RequestHandle handle, absl::Duration timeout) override {
    return logic().Wait(handle, timeout);
  }
  absl::StatusOr<bool> Test(RequestHandle handle) override { return logic().Test(handle); }
  absl::Status StreamWaitReply(RequestHandle handle, Stream& stream) override {
    return logic().StreamWaitReply(handle, stream);
  }
  absl::Status StreamWaitNextPull(Key key, int server, Stream& stream) override {
    return logic().StreamWaitNextPull(key, server, stream);
  }
  absl::StatusOr<TraceRecord> FetchTrace(RequestHandle handle) override {
    return logic().FetchTrace(handle);
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<AFTensorWorker>> CreateWorker(const MeshOptions& options,
                                                             std::shared_ptr<Backend> backend,
                                                             const TransportFactory& transport,
                                                             RendezvousFactory rendezvous) {
  return CreateParticipant<Worker>(options, Role::kWorker, std::move(backend), transport,
                                   std::move(rendezvous), "CreateWorker");
}

}  // namespace stepmesh::core
