// The smallest complete stepmesh program: one FFN server and two attention
// workers exchange a micro-batch per step over TCP on 127.0.0.1.
//
// Each worker "computes" its activations on a backend stream, then PushPull
// sends them once that work's event completes (no host wait in between). The
// server takes each batch (one request per worker), runs one "FFN" over all
// the rows, and replies to every worker with its own rows. Workers check
// every value.
//
// Everything runs as threads of this process for brevity; as separate
// processes the code is the same, with options.scheduler pointing at one
// `stepmesh_scheduler` (docs/api.md).
//
//   build/examples/quickstart/quickstart [--steps N]

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "stepmesh/stepmesh.h"

namespace {

constexpr int kWorkers = 2;
constexpr int64_t kTokens = 4;  // rows each worker sends per step
constexpr int64_t kHidden = 8;
constexpr stepmesh::Key kActivations = 1;  // the push; also names the micro-batch
constexpr stepmesh::Key kOutputs = 2;      // the pull

float Input(int worker, int step, int64_t i) { return worker * 1000.0f + step + 0.25f * i; }
float Ffn(float x) { return 2.0f * x + 1.0f; }

absl::Status RunServer(const stepmesh::MeshOptions& base, int steps) {
  stepmesh::MeshOptions options = base;
  options.role = stepmesh::Role::kServer;
  STEPMESH_ASSIGN_OR_RETURN(auto server, stepmesh::AFTensorServer::Create(options));
  // One slot per worker: worker w's rows land at rows [w * kTokens, (w + 1) * kTokens).
  std::vector<float> in(kWorkers * kTokens * kHidden), out(in.size());
  const stepmesh::Shape shape{kWorkers * kTokens, kHidden};
  STEPMESH_RETURN_IF_ERROR(server->RegisterRecvTensor(
      kActivations, {in.data(), stepmesh::DType::kFloat32, shape}));
  STEPMESH_RETURN_IF_ERROR(
      server->RegisterReplyTensor(kOutputs, {out.data(), stepmesh::DType::kFloat32, shape}));
  STEPMESH_RETURN_IF_ERROR(server->Barrier());
  for (int step = 0; step < steps; ++step) {
    STEPMESH_ASSIGN_OR_RETURN(stepmesh::Batch batch, server->GetBatch(absl::Seconds(10)));
    const stepmesh::BatchTensor& act = batch.tensors[0];
    std::vector<stepmesh::Reply> replies;
    for (int w : batch.workers) {
      const size_t floats = act.valid_bytes[w] / sizeof(float);
      const float* x = static_cast<const float*>(act.region.data) + w * act.slot_bytes / 4;
      float* y = out.data() + w * kTokens * kHidden;
      for (size_t i = 0; i < floats; ++i) y[i] = Ffn(x[i]);
      replies.push_back({w, floats * sizeof(float)});
    }
    STEPMESH_RETURN_IF_ERROR(server->Respond(batch, replies));
  }
  STEPMESH_RETURN_IF_ERROR(server->Barrier());
  return server->Shutdown();
}

absl::Status RunWorker(const stepmesh::MeshOptions& base, int rank, int steps) {
  stepmesh::MeshOptions options = base;
  options.role = stepmesh::Role::kWorker;
  options.rank = rank;
  STEPMESH_ASSIGN_OR_RETURN(auto worker, stepmesh::AFTensorWorker::Create(options));
  stepmesh::Backend& backend = worker->backend();  // cpu_mock: streams are threads
  STEPMESH_ASSIGN_OR_RETURN(auto act, backend.Allocate(kTokens * kHidden * 4,
                                                       stepmesh::MemoryKind::kDevice));
  STEPMESH_ASSIGN_OR_RETURN(auto outputs, backend.Allocate(kTokens * kHidden * 4,
                                                           stepmesh::MemoryKind::kDevice));
  STEPMESH_ASSIGN_OR_RETURN(auto stream, backend.CreateStream());
  STEPMESH_ASSIGN_OR_RETURN(auto computed, backend.CreateEvent());
  const stepmesh::Shape shape{kTokens, kHidden};
  STEPMESH_RETURN_IF_ERROR(
      worker->RegisterPushTensor(kActivations, act->View(stepmesh::DType::kFloat32, shape)));
  STEPMESH_RETURN_IF_ERROR(worker->RegisterPullTensor(
      kOutputs, /*server=*/0, outputs->View(stepmesh::DType::kFloat32, shape)));
  STEPMESH_RETURN_IF_ERROR(worker->Barrier());

  auto* x = static_cast<float*>(act->data());
  const auto* y = static_cast<const float*>(outputs->data());
  for (int step = 0; step < steps; ++step) {
    // The attention "kernel": asynchronous on the stream; the event marks its end.
    STEPMESH_RETURN_IF_ERROR(stream->LaunchHostFunc([x, rank, step] {
      for (int64_t i = 0; i < kTokens * kHidden; ++i) x[i] = Input(rank, step, i);
    }));
    STEPMESH_RETURN_IF_ERROR(computed->Record(*stream));
    const stepmesh::Push push{kActivations};
    const stepmesh::Pull pull{kOutputs, 0};
    STEPMESH_ASSIGN_OR_RETURN(stepmesh::RequestHandle request,
                              worker->PushPull({&push, 1}, {&pull, 1}, {.ready = computed.get()}));
    STEPMESH_RETURN_IF_ERROR(worker->Wait(request, absl::Seconds(10)));
    for (int64_t i = 0; i < kTokens * kHidden; ++i) {
      if (y[i] != Ffn(Input(rank, step, i))) {
        return absl::DataLossError("worker " + std::to_string(rank) + " step " +
                                   std::to_string(step) + ": wrong output");
      }
    }
  }
  STEPMESH_RETURN_IF_ERROR(worker->Barrier());
  return worker->Shutdown();
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 100;
  if (argc == 3 && std::strcmp(argv[1], "--steps") == 0) steps = std::atoi(argv[2]);
  if (steps <= 0 || (argc != 1 && argc != 3)) {
    std::fprintf(stderr, "usage: quickstart [--steps N]\n");
    return 2;
  }
  // STEPMESH_* variables apply (log level, ...); this program runs the whole
  // mesh itself, so unless a secret is given it makes one up for its members.
  absl::StatusOr<stepmesh::MeshOptions> from_env = stepmesh::MeshOptions::FromEnv();
  if (!from_env.ok()) {
    std::fprintf(stderr, "quickstart: %s\n", from_env.status().ToString().c_str());
    return 2;
  }
  stepmesh::MeshOptions options = *from_env;
  if (options.auth_token.empty()) {
    absl::StatusOr<std::string> token = stepmesh::GenerateAuthToken();
    if (!token.ok()) {
      std::fprintf(stderr, "quickstart: %s\n", token.status().ToString().c_str());
      return 1;
    }
    options.auth_token = *token;
  }
  options.transport = "tcp";
  options.num_workers = kWorkers;
  options.num_servers = 1;
  options.scheduler = "127.0.0.1:0";  // any free port
  auto scheduler = stepmesh::Scheduler::Start(options);
  if (!scheduler.ok()) {
    std::fprintf(stderr, "scheduler: %s\n", scheduler.status().ToString().c_str());
    return 1;
  }
  options.scheduler = (*scheduler)->address();

  std::vector<absl::Status> results(kWorkers + 1);
  std::vector<std::thread> threads;
  threads.emplace_back([&] { results[0] = RunServer(options, steps); });
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] { results[w + 1] = RunWorker(options, w, steps); });
  }
  for (std::thread& t : threads) t.join();
  int failed = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    if (results[i].ok()) continue;
    std::fprintf(stderr, "%s: %s\n", i == 0 ? "server" : "worker", results[i].ToString().c_str());
    ++failed;
  }
  if (failed != 0) return 1;
  std::printf("quickstart: %d workers x %d steps of %lld x %lld floats, every value checked: OK\n",
              kWorkers, steps, static_cast<long long>(kTokens), static_cast<long long>(kHidden));
  return 0;
}
