#include "tests/reliability/harness.h"

#include <dirent.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "stepmesh/status.h"

namespace stepmesh::testing {
namespace {

int CountEntries(const char* dir) {
  DIR* d = ::opendir(dir);
  if (d == nullptr) return -1;
  int n = 0;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n - 1;  // opendir's own descriptor (fd dir) / harmless for task
}

}  // namespace

int OpenFdCount() { return CountEntries("/proc/self/fd"); }
// stepmesh's own threads (all named "sm-..."): sanitizer runtimes and the test
// framework start threads of their own at times this count must not see.
std::vector<std::string> ThreadNames() {
  std::vector<std::string> names;
  DIR* d = ::opendir("/proc/self/task");
  if (d == nullptr) return names;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const std::string path = absl::StrCat("/proc/self/task/", e->d_name, "/comm");
    if (FILE* f = std::fopen(path.c_str(), "r")) {
      char name[32] = {};
      if (std::fgets(name, sizeof(name), f) != nullptr && std::strncmp(name, "sm-", 3) == 0) {
        names.push_back(
            absl::StrCat(absl::StripTrailingAsciiWhitespace(name), " (tid ", e->d_name, ")"));
      }
      std::fclose(f);
    }
  }
  ::closedir(d);
  return names;
}

int ThreadCount() { return static_cast<int>(ThreadNames().size()); }

int ThreadCountSettled(int want, absl::Duration deadline) {
  const absl::Time until = absl::Now() + deadline;
  int n = ThreadCount();
  while (n != want && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
    n = ThreadCount();
  }
  return n;
}

Harness::Harness(const HarnessConfig& config, const core::TransportFactory& transport)
    : config_(config) {
  const int W = config.workers, S = config.servers, M = config.keys;
  pulls_.assign(W,
                std::vector<std::vector<std::vector<uint8_t>>>(
                    M, std::vector<std::vector<uint8_t>>(S, std::vector<uint8_t>(config.bytes))));
  pushes_flat_.assign(W * M, std::vector<uint8_t>(config.bytes));
  recvs_.assign(S, std::vector<std::vector<uint8_t>>(M, std::vector<uint8_t>(config.bytes * W)));
  replies_.assign(S, std::vector<std::vector<uint8_t>>(M, std::vector<uint8_t>(config.bytes * W)));
  serving_.reset(new std::atomic<bool>[S]);
  exits_.assign(S, absl::OkStatus());

  MeshOptions base = config.options;
  base.num_workers = W;
  base.num_servers = S;
  absl::StatusOr<std::unique_ptr<LoopbackMesh>> mesh = LoopbackMesh::Start(base, transport);
  if (!mesh.ok()) {
    status_ = mesh.status();
    return;
  }
  mesh_ = *std::move(mesh);
  auto keep = [this](absl::Status s) {
    if (status_.ok() && !s.ok()) status_ = s;
  };
  const int64_t rows = W;
  for (int s = 0; s < S; ++s) {
    for (int m = 0; m < M; ++m) {
      keep(mesh_->server(s).RegisterRecvTensor(
          RelPushKey(m), {recvs_[s][m].data(), DType::kUInt8,
                          Shape{rows, static_cast<int64_t>(config.bytes)}, Device::Cpu()}));
      keep(mesh_->server(s).RegisterReplyTensor(
          RelPullKey(m), {replies_[s][m].data(), DType::kUInt8,
                          Shape{rows, static_cast<int64_t>(config.bytes)}, Device::Cpu()}));
    }
  }
  for (int w = 0; w < W; ++w) keep(RegisterWorkerTensors(w));
  if (!status_.ok()) return;
  for (int s = 0; s < S; ++s) {
    serving_[s] = true;
    serve_threads_.emplace_back([this, s] { ServeLoop(s); });
  }
}

Harness::~Harness() {
  stop_ = true;
  for (auto& t : serve_threads_) {
    if (t.joinable()) t.join();
  }
  mesh_.reset();  // before the tensors it registered
}

void Harness::ServeLoop(int s) {
  AFTensorServer& server = mesh_->server(s);
  absl::Status last;
  while (!stop_.load() && serving_[s].load()) {
    absl::StatusOr<Batch> batch = server.GetBatch(absl::Milliseconds(50));
    if (!batch.ok()) {
      last = batch.status();
      if (absl::IsDeadlineExceeded(last)) continue;
      if (absl::IsUnavailable(last) || absl::IsCancelled(last) ||
          absl::IsFailedPrecondition(last)) {
        break;  // every worker gone, or this server shut down
      }
      base::MutexLock lock(&mu_);
      errors_.push_back(last.ToString());
      continue;
    }
    std::vector<Reply> replies;
    for (size_t k = 0; k < batch->workers.size(); ++k) {
      const int w = batch->workers[k];
      const BatchTensor& t = batch->tensors[0];
      const int m = static_cast<int>(t.key - RelPushKey(0));
      const auto* in = static_cast<const uint8_t*>(t.region.data) + w * t.slot_bytes;
      uint8_t* out = replies_[s][m].data() + w * config_.bytes;
      for (size_t j = 0; j < config_.bytes; ++j) out[j] = in[j] ^ ReplyMask(s);
      if (batch->pull_keys[k] != Batch::kNoPull) replies.push_back({w});
    }
    if (hold_.load()) {
      held_batches_.fetch_add(1);
      const absl::Time until = absl::Now() + absl::Seconds(10);
      while (hold_.load() && !stop_.load() && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(1));
      }
    }
    absl::Status responded = server.Respond(*batch, replies);
    if (!responded.ok() && !stop_.load()) {
      base::MutexLock lock(&mu_);
      errors_.push_back(absl::StrCat("respond: ", responded.ToString()));
    }
  }
  base::MutexLock lock(&mu_);
  exits_[s] = last;
}

absl::StatusOr<RequestHandle> Harness::Start(int w, int m, uint8_t fill, std::vector<int> servers) {
  if (servers.empty()) {
    for (int s = 0; s < config_.servers; ++s) servers.push_back(s);
  }
  std::vector<uint8_t>& push = pushes_flat_[w * config_.keys + m];
  for (size_t j = 0; j < push.size(); ++j) push[j] = static_cast<uint8_t>(fill + j * 7);
  Push p{RelPushKey(m)};
  p.servers = servers;
  std::vector<Pull> pulls;
  for (int s : servers) pulls.push_back({RelPullKey(m), s});
  return mesh_->worker(w).PushPull({&p, 1}, pulls);
}

absl::Status Harness::Finish(int w, int m, RequestHandle handle, uint8_t fill,
                             absl::Duration timeout, std::vector<int> servers) {
  if (servers.empty()) {
    for (int s = 0; s < config_.servers; ++s) servers.push_back(s);
  }
  STEPMESH_RETURN_IF_ERROR(mesh_->worker(w).Wait(handle, timeout));
  for (int s : servers) {
    const std::vector<uint8_t>& got = pulls_[w][m][s];
    for (size_t j = 0; j < got.size(); ++j) {
      const uint8_t want = static_cast<uint8_t>(fill + j * 7) ^ ReplyMask(s);
      if (got[j] != want) {
        return absl::DataLossError(absl::StrCat("worker ", w, " key ", m, " server ", s, ": byte ",
                                                j, " is ", int{got[j]}, ", expected ", int{want}));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Harness::RoundTrip(int w, int m, uint8_t fill, absl::Duration timeout,
                                std::vector<int> servers) {
  STEPMESH_ASSIGN_OR_RETURN(RequestHandle h, Start(w, m, fill, servers));
  return Finish(w, m, h, fill, timeout, servers);
}

std::vector<std::string> Harness::server_errors() {
  base::MutexLock lock(&mu_);
  return errors_;
}

void Harness::StopWorker(int w) { mesh_->ShutdownWorker(w); }

absl::Status Harness::RegisterWorkerTensors(int w) {
  const int M = config_.keys;
  for (int m = 0; m < M; ++m) {
    STEPMESH_RETURN_IF_ERROR(mesh_->worker(w).RegisterPushTensor(
        RelPushKey(m), BytesView(pushes_flat_[w * M + m].data(), config_.bytes)));
    for (int s = 0; s < config_.servers; ++s) {
      STEPMESH_RETURN_IF_ERROR(mesh_->worker(w).RegisterPullTensor(
          RelPullKey(m), s, BytesView(pulls_[w][m][s].data(), config_.bytes)));
    }
  }
  return absl::OkStatus();
}

absl::Status Harness::RestartWorker(int w) {
  STEPMESH_RETURN_IF_ERROR(mesh_->RestartWorker(w));
  return RegisterWorkerTensors(w);
}

void Harness::StopServer(int s) {
  serving_[s] = false;
  if (s < static_cast<int>(serve_threads_.size()) && serve_threads_[s].joinable()) {
    serve_threads_[s].join();
  }
  mesh_->ShutdownServer(s);
}

absl::Status Harness::server_exit(int s) {
  if (s < static_cast<int>(serve_threads_.size()) && serve_threads_[s].joinable()) {
    serve_threads_[s].join();
  }
  base::MutexLock lock(&mu_);
  return exits_[s];
}

}  // namespace stepmesh::testing
