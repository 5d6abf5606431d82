#include "tests/support/loopback_mesh.h"

#include <future>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/sync.h"
#include "src/core/mesh.h"
#include "stepmesh/status.h"

namespace stepmesh::testing {

absl::StatusOr<std::unique_ptr<Scheduler>> StartLoopbackScheduler(MeshOptions& options) {
  options.scheduler = "127.0.0.1:0";
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<Scheduler> scheduler, Scheduler::Start(options));
  options.scheduler = scheduler->address();
  return scheduler;
}

LoopbackMesh::LoopbackMesh(MeshOptions base, core::TransportFactory transport, Backends backends)
    : base_(std::move(base)),
      transport_(std::move(transport)),
      backends_(std::move(backends)),
      workers_(base_.num_workers),
      servers_(base_.num_servers) {}

LoopbackMesh::~LoopbackMesh() {
  for (auto& w : workers_) {
    if (w != nullptr) (void)w->Shutdown();
  }
  for (auto& s : servers_) {
    if (s != nullptr) (void)s->Shutdown();
  }
  workers_.clear();
  servers_.clear();
  scheduler_.reset();
}

absl::StatusOr<std::unique_ptr<LoopbackMesh>> LoopbackMesh::StartEmpty(
    MeshOptions base, core::TransportFactory transport, Backends backends) {
  std::unique_ptr<LoopbackMesh> mesh(
      new LoopbackMesh(std::move(base), std::move(transport), std::move(backends)));
  STEPMESH_ASSIGN_OR_RETURN(mesh->scheduler_, StartLoopbackScheduler(mesh->base_));
  return mesh;
}

absl::StatusOr<std::unique_ptr<LoopbackMesh>> LoopbackMesh::Start(MeshOptions base,
                                                                  core::TransportFactory transport,
                                                                  Backends backends) {
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<LoopbackMesh> mesh,
                            StartEmpty(std::move(base), std::move(transport), std::move(backends)));
  // Every participant at once: a server's creation returns only once its
  // workers dialled it, a worker's once every server accepted.
  std::vector<std::future<absl::Status>> created;
  for (int s = 0; s < mesh->num_servers(); ++s) {
    created.push_back(std::async(std::launch::async, [&mesh, s] { return mesh->AddServer(s); }));
  }
  for (int w = 0; w < mesh->num_workers(); ++w) {
    created.push_back(std::async(std::launch::async, [&mesh, w] { return mesh->AddWorker(w); }));
  }
  absl::Status first;
  for (auto& f : created) {
    absl::Status s = f.get();
    if (first.ok()) first = std::move(s);
  }
  STEPMESH_RETURN_IF_ERROR(first);
  return mesh;
}

MeshOptions LoopbackMesh::options(Role role, int rank) const {
  MeshOptions o = base_;
  o.role = role;
  o.rank = rank;
  return o;
}

std::shared_ptr<Backend> LoopbackMesh::BackendFor(Role role, int rank) const {
  std::shared_ptr<Backend> backend = backends_ ? backends_(role, rank) : nullptr;
  return backend != nullptr ? backend : std::shared_ptr<Backend>(CreateCpuMockBackend());
}

absl::Status LoopbackMesh::AddWorker(int w) {
  STEPMESH_ASSIGN_OR_RETURN(
      workers_[w],
      core::CreateWorker(options(Role::kWorker, w), BackendFor(Role::kWorker, w), transport_));
  return absl::OkStatus();
}

absl::Status LoopbackMesh::AddServer(int s) {
  STEPMESH_ASSIGN_OR_RETURN(
      servers_[s],
      core::CreateServer(options(Role::kServer, s), BackendFor(Role::kServer, s), transport_));
  return absl::OkStatus();
}

void LoopbackMesh::ShutdownWorker(int w) {
  if (workers_[w] != nullptr) (void)workers_[w]->Shutdown();
}

void LoopbackMesh::ShutdownServer(int s) {
  if (servers_[s] != nullptr) (void)servers_[s]->Shutdown();
}

void LoopbackMesh::DropWorker(int w) {
  ShutdownWorker(w);
  workers_[w].reset();
}

void LoopbackMesh::DropServer(int s) {
  ShutdownServer(s);
  servers_[s].reset();
}

absl::Status LoopbackMesh::RestartWorker(int w) {
  DropWorker(w);
  absl::Status first;
  absl::Status last;
  for (int attempt = 0; attempt < 50; ++attempt) {  // the leave may not have reached the scheduler
    last = AddWorker(w);
    if (last.ok()) return last;
    if (first.ok()) first = last;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::Status(last.code(),
                      absl::StrCat(last.message(), " (first attempt: ", first.ToString(), ")"));
}

absl::Status RegisterKeyPair(AFTensorServer& server, MeshBuffers& buffers, size_t bytes) {
  const Shape shape{1, bytes};
  STEPMESH_RETURN_IF_ERROR(
      server.RegisterRecvTensor(1, {buffers.recv[0].data(), DType::kUInt8, shape}));
  STEPMESH_RETURN_IF_ERROR(
      server.RegisterReplyTensor(2, {buffers.reply[0].data(), DType::kUInt8, shape}));
  return server.Barrier();
}

absl::StatusOr<PreparedRequest> RegisterKeyPair(AFTensorWorker& worker, MeshBuffers& buffers,
                                                size_t bytes) {
  STEPMESH_RETURN_IF_ERROR(worker.RegisterPushTensor(1, BytesView(buffers.push[0].data(), bytes)));
  STEPMESH_RETURN_IF_ERROR(
      worker.RegisterPullTensor(2, 0, BytesView(buffers.pull[0].data(), bytes)));
  STEPMESH_RETURN_IF_ERROR(worker.Barrier());
  const Push push{1};
  const Pull pull{2, 0};
  return worker.Prepare({&push, 1}, {&pull, 1});
}

absl::Status RunParticipants(LoopbackMesh& mesh,
                             const std::function<absl::Status(AFTensorWorker&)>& worker_body,
                             const std::function<absl::Status(AFTensorServer&)>& server_body) {
  base::Mutex mu;
  absl::Status first_error;
  auto record = [&](const absl::Status& s) {
    base::MutexLock lock(&mu);
    if (first_error.ok() && !s.ok()) first_error = s;
  };
  std::vector<std::thread> threads;
  for (int w = 0; w < mesh.num_workers(); ++w) {
    threads.emplace_back([&, w] { record(worker_body(mesh.worker(w))); });
  }
  for (int s = 0; s < mesh.num_servers(); ++s) {
    threads.emplace_back([&, s] { record(server_body(mesh.server(s))); });
  }
  for (auto& t : threads) t.join();
  return first_error;
}

}  // namespace stepmesh::testing
