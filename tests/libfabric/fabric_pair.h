#pragma once
// Two libfabric transports in this process, a worker and a server, connected
// to each other without a mesh around them: the worker pushes one registered
// buffer into the server's receive slot, and each side's Poll runs on a
// thread of its own as the core's receive loop does. For the tests that need
// to see one transport's behaviour (its queue, its rails, its sleep) rather
// than a whole scenario's.

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/base/sync.h"
#include "src/core/protocol.h"
#include "src/core/transport.h"
#include "src/transport/libfabric/libfabric_transport.h"
#include "stepmesh/options.h"

namespace stepmesh::testing {

// The server side's sink: every push lands in `slot`; counts deliveries and
// keeps the latest failure.
class SlotSink final : public core::TransportSink {
 public:
  explicit SlotSink(std::vector<std::byte>& slot) : slot_(slot) {}
  absl::Status Resolve(core::NodeId, const core::FrameHeader&, core::Destination& out,
                       core::FrameContext*) override {
    out.data = slot_.data();
    out.capacity = slot_.size();
    out.region = 1;
    return absl::OkStatus();
  }
  void OnFrame(core::NodeId, const core::FrameHeader&, core::FrameContext,
               absl::Status status) override {
    if (!status.ok()) {
      base::MutexLock lock(&mu_);
      last_failure_ = status;
    }
    (status.ok() ? delivered : failed).fetch_add(1);
  }
  void OnPeerLost(core::NodeId, absl::Status) override { lost.fetch_add(1); }
  absl::Status last_failure() {
    base::MutexLock lock(&mu_);
    return last_failure_;
  }
  std::atomic<int> delivered{0}, failed{0}, lost{0};

 private:
  std::vector<std::byte>& slot_;
  base::Mutex mu_;
  absl::Status last_failure_;
};

class FabricPair {
 public:
  // `options.fi_provider` names the provider; `worker_hooks` go to the
  // worker, `worker_hooks.api` to both. Registers a `bytes` source (a
  // pattern) and receive slot, as memory of `device` (host memory that
  // stands in for it: the tests of FI_HMEM registration run without a GPU).
  static absl::StatusOr<std::unique_ptr<FabricPair>> Make(
      const MeshOptions& options, libfabric::LibfabricHooks worker_hooks, size_t bytes,
      Device device = Device::Cpu(), core::TransportFactory server_control = {});
  ~FabricPair();

  // Polls both sides on threads of their own, each Poll waiting at most `wait`.
  void StartPolling(absl::Duration wait);
  void StopPolling();
  // Pushes the source (request `id`); the server's sink sees it land.
  absl::Status Push(uint64_t id);
  // Waits (bounded) until the server delivered or failed `n` frames in all.
  bool AwaitFrames(int n, absl::Duration within);
  bool SlotMatchesSource() const;
  // Shuts the worker down and starts a new process's transport at its rank
  // (a new epoch), connected to the server as a rejoiner is: both Connect
  // side by side. Polling must be stopped; it is started again with `wait`.
  absl::Status RestartWorker(libfabric::LibfabricHooks hooks, absl::Duration wait);

  core::Transport& worker() { return *worker_; }
  core::Transport& server() { return *server_; }
  SlotSink& server_sink() { return server_sink_; }
  size_t bytes() const { return src_.size(); }

 private:
  FabricPair(size_t bytes) : slot_(bytes), src_(bytes) {}
  absl::Status ConnectBoth();
  // Shuts the worker down and drops it while a new poller drives the server
  // (left running).
  void RetireWorker(absl::Duration wait);
  void PollServer(absl::Duration wait);  // a thread polling one side until StopPolling
  void PollWorker(absl::Duration wait);

  MeshOptions options_;
  std::unique_ptr<core::Transport> worker_, server_;
  std::vector<std::byte> slot_, src_;
  SlotSink server_sink_{slot_};
  SlotSink worker_sink_{src_};  // nothing arrives at the worker
  std::atomic<bool> stop_{false};
  std::vector<std::thread> pollers_;
};

}  // namespace stepmesh::testing
