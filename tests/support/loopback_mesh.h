#pragma once
// A whole mesh inside this process, the way every in-process test builds one:
// a scheduler on a free 127.0.0.1 port and the workers and servers over one
// transport factory, each on a cpu_mock backend of its own unless the test
// brings backends. Participants are created concurrently (servers accept
// while workers dial) and torn down workers first, then servers, then the
// scheduler.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/core/transport.h"
#include "stepmesh/backend.h"
#include "stepmesh/options.h"
#include "stepmesh/scheduler.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"

namespace stepmesh::testing {

// A scheduler on 127.0.0.1 at a free port; `options.scheduler` becomes its address.
absl::StatusOr<std::unique_ptr<Scheduler>> StartLoopbackScheduler(MeshOptions& options);

// Host memory for one push and one pull tensor per participant of a mesh of
// `workers` x `servers`: a server's recv and reply hold one `bytes` slot per
// worker; pull[w * servers + s] is worker w's reply from server s. Declare it
// before the mesh: registered memory outlives the participants.
struct MeshBuffers {
  MeshBuffers(int workers, int servers, size_t bytes)
      : recv(servers, std::vector<uint8_t>(workers * bytes)),
        reply(servers, std::vector<uint8_t>(workers * bytes)),
        push(workers, std::vector<uint8_t>(bytes)),
        pull(workers * servers, std::vector<uint8_t>(bytes)) {}
  std::vector<std::vector<uint8_t>> recv, reply, push, pull;
};

// The one round trip of a 1 x 1 mesh over `buffers` (slots of `bytes`): the
// server registers recv key 1 and reply key 2, the worker push key 1 and
// pull key 2 from server 0; each then waits in Barrier. The worker's
// PushPull of both, prepared.
absl::Status RegisterKeyPair(AFTensorServer& server, MeshBuffers& buffers, size_t bytes);
absl::StatusOr<PreparedRequest> RegisterKeyPair(AFTensorWorker& worker, MeshBuffers& buffers,
                                                size_t bytes);

class LoopbackMesh {
 public:
  // The backend participant (role, rank) runs on; null: a cpu_mock backend.
  using Backends = std::function<std::shared_ptr<Backend>(Role role, int rank)>;

  // base.num_workers x base.num_servers participants over `transport`.
  static absl::StatusOr<std::unique_ptr<LoopbackMesh>> Start(MeshOptions base,
                                                             core::TransportFactory transport,
                                                             Backends backends = nullptr);
  // Only the scheduler: the test adds participants (AddWorker, AddServer) or
  // creates them itself from options().
  static absl::StatusOr<std::unique_ptr<LoopbackMesh>> StartEmpty(MeshOptions base,
                                                                  core::TransportFactory transport,
                                                                  Backends backends = nullptr);
  ~LoopbackMesh();
  LoopbackMesh(const LoopbackMesh&) = delete;
  LoopbackMesh& operator=(const LoopbackMesh&) = delete;

  int num_workers() const { return base_.num_workers; }
  int num_servers() const { return base_.num_servers; }
  // The options participant (role, rank) runs with: the base, its role and
  // rank, the scheduler's address.
  MeshOptions options(Role role, int rank) const;
  const core::TransportFactory& transport() const { return transport_; }

  Scheduler& scheduler() { return *scheduler_; }
  void StopScheduler() { scheduler_.reset(); }
  AFTensorWorker& worker(int w) { return *workers_[w]; }
  AFTensorServer& server(int s) { return *servers_[s]; }
  bool has_worker(int w) const { return workers_[w] != nullptr; }
  bool has_server(int s) const { return servers_[s] != nullptr; }

  // Creates participant (role, rank) now; it joins the running mesh.
  absl::Status AddWorker(int w);
  absl::Status AddServer(int s);
  // Shuts the participant down (and keeps the object until DropWorker/DropServer).
  void ShutdownWorker(int w);
  void ShutdownServer(int s);
  void DropWorker(int w);
  void DropServer(int s);
  // A rolling restart of worker `w`: drops it, then a new process takes the
  // rank, retried while the scheduler still counts the old one.
  absl::Status RestartWorker(int w);

 private:
  LoopbackMesh(MeshOptions base, core::TransportFactory transport, Backends backends);
  std::shared_ptr<Backend> BackendFor(Role role, int rank) const;

  MeshOptions base_;  // with the scheduler's address
  core::TransportFactory transport_;
  Backends backends_;
  std::unique_ptr<Scheduler> scheduler_;
  std::vector<std::unique_ptr<AFTensorWorker>> workers_;
  std::vector<std::unique_ptr<AFTensorServer>> servers_;
};

// Runs `worker_body` for every worker and `server_body` for every server, each
// on a thread of its own; the first error any of them returned.
absl::Status RunParticipants(LoopbackMesh& mesh,
                             const std::function<absl::Status(AFTensorWorker&)>& worker_body,
                             const std::function<absl::Status(AFTensorServer&)>& server_body);

}  // namespace stepmesh::testing
