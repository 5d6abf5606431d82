// An integrator's first program, built against the installed library with
// nothing but find_package(stepmesh) or pkg-config, at the compiler's default
// C++ standard (tests/install/CMakeLists.txt builds it both ways).
//
// Each formation is a whole mesh of separate processes: this process is the
// scheduler, and it starts itself again as 2 workers and 2 servers that take
// their configuration from DMLC_* variables, the way launchers start StepMesh.
// Every worker pushes 128x7168 bf16 to both servers and pulls a reply from
// each, `--rounds` times; servers and workers check every element they get.
// There is no Barrier() anywhere: a server registers its tensors whenever it
// gets to it (the workers' pushes may already be on the way), and everyone
// calls Shutdown() as soon as its own last request is done. The test then
// checks that stderr holds no warning: an orderly run is a quiet run.
//
//   consumer [--formations N] [--rounds R]
//   consumer --child   (a mesh participant; started by the above)

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "stepmesh/stepmesh.h"

extern char** environ;

namespace {

constexpr int kWorkers = 2;
constexpr int kServers = 2;
constexpr int64_t kRows = 128;
constexpr int64_t kCols = 7168;
constexpr size_t kElems = kRows * kCols;  // bf16 elements of one worker's push
constexpr stepmesh::Key kPushKey = 1;
constexpr stepmesh::Key kPullKey = 2;
constexpr absl::Duration kWait = absl::Seconds(20);

uint16_t PushValue(int round, int worker, size_t i) {
  return static_cast<uint16_t>(i * 31 + round * 7 + worker * 1009);
}
uint16_t ReplyValue(uint16_t pushed, int server) {
  return static_cast<uint16_t>(pushed ^ (0x5a5a + server));
}

int Fail(const std::string& who, const absl::Status& status) {
  std::fprintf(stderr, "consumer %s: FAILED: %s\n", who.c_str(), status.ToString().c_str());
  return 1;
}

int RunWorker(stepmesh::AFTensorWorker& worker, int rounds) {
  const std::string who = absl::StrCat("worker ", worker.rank());
  std::vector<uint16_t> push(kElems);
  std::vector<std::vector<uint16_t>> pull(kServers, std::vector<uint16_t>(kElems));
  const stepmesh::Shape shape{kRows, kCols};
  absl::Status st =
      worker.RegisterPushTensor(kPushKey, {push.data(), stepmesh::DType::kBFloat16, shape});
  for (int s = 0; st.ok() && s < kServers; ++s) {
    st =
        worker.RegisterPullTensor(kPullKey, s, {pull[s].data(), stepmesh::DType::kBFloat16, shape});
  }
  if (!st.ok()) return Fail(who, st);
  const stepmesh::Push p{kPushKey};
  const stepmesh::Pull q[kServers] = {{kPullKey, 0}, {kPullKey, 1}};
  for (int round = 0; round < rounds; ++round) {
    for (size_t i = 0; i < kElems; ++i) push[i] = PushValue(round, worker.rank(), i);
    absl::StatusOr<stepmesh::RequestHandle> h = worker.PushPull({&p, 1}, {q, kServers});
    if (!h.ok()) return Fail(who, h.status());
    if (absl::Status w = worker.Wait(*h, kWait); !w.ok()) return Fail(who, w);
    for (int s = 0; s < kServers; ++s) {
      for (size_t i = 0; i < kElems; ++i) {
        if (pull[s][i] != ReplyValue(PushValue(round, worker.rank(), i), s)) {
          return Fail(who, absl::DataLossError(absl::StrCat("round ", round, " reply of server ", s,
                                                            " element ", i)));
        }
      }
    }
  }
  if (absl::Status sd = worker.Shutdown(); !sd.ok()) return Fail(who, sd);
  return 0;
}

int RunServer(stepmesh::AFTensorServer& server, int rounds) {
  const std::string who = absl::StrCat("server ", server.rank());
  std::vector<uint16_t> recv(kWorkers * kElems), reply(kWorkers * kElems);
  const stepmesh::Shape shape{kWorkers * kRows, kCols};
  // The application is a little slow to register: pushes may arrive first.
  absl::SleepFor(absl::Milliseconds(20 * server.rank()));
  absl::Status st =
      server.RegisterRecvTensor(kPushKey, {recv.data(), stepmesh::DType::kBFloat16, shape});
  if (st.ok()) {
    st = server.RegisterReplyTensor(kPullKey, {reply.data(), stepmesh::DType::kBFloat16, shape});
  }
  if (!st.ok()) return Fail(who, st);
  for (int round = 0; round < rounds; ++round) {
    absl::StatusOr<stepmesh::Batch> batch = server.GetBatch(kWait);
    if (!batch.ok()) return Fail(who, batch.status());
    if (batch->workers.size() != kWorkers) {
      return Fail(who, absl::InternalError(
                           absl::StrCat("round ", round, ": ", batch->workers.size(), " workers")));
    }
    for (int w = 0; w < kWorkers; ++w) {
      for (size_t i = 0; i < kElems; ++i) {
        const uint16_t got = recv[w * kElems + i];
        if (got != PushValue(round, w, i)) {
          return Fail(who, absl::DataLossError(absl::StrCat("round ", round, " push of worker ", w,
                                                            " element ", i)));
        }
        reply[w * kElems + i] = ReplyValue(got, server.rank());
      }
    }
    std::vector<stepmesh::Reply> replies;
    for (int w : batch->workers) replies.push_back(stepmesh::Reply{w});
    if (absl::Status r = server.Respond(*batch, replies); !r.ok()) return Fail(who, r);
  }
  if (absl::Status sd = server.Shutdown(); !sd.ok()) return Fail(who, sd);
  return 0;
}

// A worker or a server, configured from the environment alone.
int RunChild(int rounds) {
  absl::StatusOr<stepmesh::MeshOptions> options = stepmesh::MeshOptions::FromEnv();
  if (!options.ok()) return Fail("child", options.status());
  if (options->role == stepmesh::Role::kWorker) {
    auto worker = stepmesh::AFTensorWorker::Create(*options);
    if (!worker.ok()) return Fail("worker", worker.status());
    return RunWorker(**worker, rounds);
  }
  auto server = stepmesh::AFTensorServer::Create(*options);
  if (!server.ok()) return Fail("server", server.status());
  return RunServer(**server, rounds);
}

// Waits for `pid` until `deadline`, then kills it (it is ours) and reaps it.
int Reap(pid_t pid, absl::Time deadline) {
  int status = 0;
  while (true) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) return -1;
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -2;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// One mesh: this process schedules, four children work and serve.
absl::Status RunFormation(const char* self, int rounds, int formation) {
  stepmesh::MeshOptions options;
  options.role = stepmesh::Role::kScheduler;
  options.scheduler = "127.0.0.1:0";
  options.num_workers = kWorkers;
  options.num_servers = kServers;
  options.timeout = kWait;
  // A mesh open to any local process is worth a warning: this one has a secret.
  absl::StatusOr<std::string> token = stepmesh::GenerateAuthToken();
  if (!token.ok()) return token.status();
  options.auth_token = *token;
  auto scheduler = stepmesh::Scheduler::Start(options);
  if (!scheduler.ok()) return scheduler.status();
  const std::string address = (*scheduler)->address();
  const std::string port = address.substr(address.rfind(':') + 1);

  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  env_strings.push_back("DMLC_PS_ROOT_URI=127.0.0.1");
  env_strings.push_back("DMLC_PS_ROOT_PORT=" + port);
  env_strings.push_back(absl::StrCat("DMLC_NUM_WORKER=", kWorkers));
  env_strings.push_back(absl::StrCat("DMLC_NUM_SERVER=", kServers));
  env_strings.push_back("STEPMESH_TRANSPORT=tcp");
  env_strings.push_back("STEPMESH_TIMEOUT=20s");
  env_strings.push_back("STEPMESH_AUTH_TOKEN=" + *token);
  const std::string rounds_arg = std::to_string(rounds);
  std::vector<pid_t> children;
  absl::Status result = absl::OkStatus();
  for (int c = 0; c < kWorkers + kServers; ++c) {
    std::vector<std::string> env = env_strings;
    env.push_back(c % 2 == 0 ? "DMLC_ROLE=worker" : "DMLC_ROLE=server");
    std::vector<char*> envp;
    for (std::string& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    char* argv[] = {const_cast<char*>(self), const_cast<char*>("--child"),
                    const_cast<char*>("--rounds"), const_cast<char*>(rounds_arg.c_str()), nullptr};
    pid_t pid = 0;
    if (int err = posix_spawn(&pid, self, nullptr, nullptr, argv, envp.data()); err != 0) {
      result = absl::InternalError(absl::StrCat("posix_spawn: ", std::strerror(err)));
      break;
    }
    children.push_back(pid);
  }
  if (result.ok()) result = (*scheduler)->WaitUntilDone(absl::Seconds(60));
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (size_t c = 0; c < children.size(); ++c) {
    const int code = Reap(children[c], deadline);
    if (code != 0 && result.ok()) {
      result = absl::InternalError(absl::StrCat("formation ", formation, ": child ", c, " (pid ",
                                                children[c], ") ended with ", code));
    }
  }
  (*scheduler)->Stop();
  return result;
}

// The CUDA interop header links with or without CUDA and a GPU: a backend, or
// UNAVAILABLE (no GPU/driver), or UNIMPLEMENTED (built without CUDA).
bool CudaHeaderLinks() {
  stepmesh::CudaBackendOptions cuda_options;
  cuda_options.event_pool_size = 64;
  auto cuda = stepmesh::CreateCudaBackend(0, cuda_options);
  return cuda.ok() || absl::IsUnavailable(cuda.status()) || absl::IsUnimplemented(cuda.status());
}

}  // namespace

int main(int argc, char** argv) {
  int formations = 1;
  int rounds = 3;
  bool child = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--child") {
      child = true;
    } else if (arg == "--formations" && i + 1 < argc) {
      formations = std::atoi(argv[++i]);
    } else if (arg == "--rounds" && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--formations N] [--rounds R]\n", argv[0]);
      return 2;
    }
  }
  if (child) return RunChild(rounds);
  if (!CudaHeaderLinks()) return Fail("scheduler", absl::InternalError("CreateCudaBackend"));
  int failed = 0;
  const absl::Time start = absl::Now();
  for (int f = 0; f < formations; ++f) {
    if (absl::Status st = RunFormation("/proc/self/exe", rounds, f); !st.ok()) {
      ++failed;
      Fail(absl::StrCat("formation ", f), st);
    }
  }
  std::printf(
      "stepmesh consumer: %d of %d formations of %d workers + %d servers passed "
      "(%d rounds of %lldx%lld bf16 each, no barrier), %.1f s\n",
      formations - failed, formations, kWorkers, kServers, rounds, static_cast<long long>(kRows),
      static_cast<long long>(kCols), absl::ToDoubleSeconds(absl::Now() - start));
  return failed == 0 ? 0 : 1;
}
