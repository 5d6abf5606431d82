// One participant of the elastic-membership tests (tests/core/
// elastic_membership_test.cc) as its own process:
//   stepmesh_elastic_node --role worker|server --scheduler H:P --workers W
//       --servers S --max-workers MW --max-servers MS [--rank R]
//       [--status FILE] [--bytes B] [--timeout-ms T] [--die-after-create]
// A worker pushes to every server of its current membership and checks every
// reply byte (server s answers worker w's push XOR 0x40 + s); a server
// answers every batch. SIGTERM: Leave (drain), then exit. Progress goes to
// FILE (rewritten): "iterations=N epoch=E servers=S retries=R lost=L" for a
// worker, "batches=N epoch=E workers=W" for a server.
// Exit 0: left in order with every byte right; 1: a wrong byte or a failed
// Leave; 2: usage; 3: Create failed (its status on stderr).

#include <signal.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"
#include "tests/support/node_flags.h"

namespace {

std::atomic<bool> g_stop{false};
void OnTerm(int) { g_stop.store(true); }

constexpr stepmesh::Key kPushKey = 1;
constexpr stepmesh::Key kPullKey = 2;
uint8_t Mask(int server) { return static_cast<uint8_t>(0x40 + server); }

void WriteStatus(const std::string& path, const std::string& line) {
  if (path.empty()) return;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << line << "\n";
  }
  std::rename(tmp.c_str(), path.c_str());
}

int RunWorker(stepmesh::AFTensorWorker& worker, size_t bytes, int max_servers,
              const std::string& status_path, absl::Duration timeout) {
  std::vector<uint8_t> push(bytes);
  std::vector<std::vector<uint8_t>> pulls(max_servers, std::vector<uint8_t>(bytes));
  auto view = [](std::vector<uint8_t>& v) {
    return stepmesh::TensorView{v.data(), stepmesh::DType::kUInt8,
                                stepmesh::Shape{static_cast<int64_t>(v.size())},
                                stepmesh::Device::Cpu()};
  };
  if (!worker.RegisterPushTensor(kPushKey, view(push)).ok()) return 1;
  for (int s = 0; s < max_servers; ++s) {
    if (!worker.RegisterPullTensor(kPullKey, s, view(pulls[s])).ok()) return 1;
  }
  uint64_t iterations = 0, retries = 0, lost = 0;
  while (!g_stop.load()) {
    const stepmesh::Membership m = worker.CurrentMembership();
    if (m.servers.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    for (size_t i = 0; i < bytes; ++i) {
      push[i] = static_cast<uint8_t>(worker.rank() * 31 + iterations * 7 + i);
    }
    for (int s : m.servers) std::fill(pulls[s].begin(), pulls[s].end(), 0);
    std::vector<stepmesh::Pull> pull_list;
    for (int s : m.servers) pull_list.push_back({kPullKey, s});
    const stepmesh::Push p{kPushKey, stepmesh::kWholeTensor, m.servers};
    absl::StatusOr<stepmesh::RequestHandle> h = worker.PushPull({&p, 1}, pull_list);
    if (!h.ok()) {
      // A server of this membership left or was lost since it was read.
      if (!absl::IsUnavailable(h.status())) {
        std::fprintf(stderr, "worker %d: post: %s\n", worker.rank(), h.status().ToString().c_str());
        return 1;
      }
      ++retries;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    const absl::Status done = worker.Wait(*h, timeout);
    if (!done.ok()) {
      if (!absl::IsUnavailable(done)) {
        std::fprintf(stderr, "worker %d: wait: %s\n", worker.rank(), done.ToString().c_str());
        return 1;
      }
      ++lost;  // a server was lost with the request in it (never a drained one)
      continue;
    }
    for (int s : m.servers) {
      for (size_t i = 0; i < bytes; ++i) {
        if (pulls[s][i] != (push[i] ^ Mask(s))) {
          std::fprintf(stderr, "worker %d: byte %zu from server %d is %d, want %d\n", worker.rank(),
                       i, s, pulls[s][i], push[i] ^ Mask(s));
          return 1;
        }
      }
    }
    ++iterations;
    if (iterations % 10 == 0) {
      WriteStatus(status_path, absl::StrCat("iterations=", iterations, " epoch=", m.epoch,
                                            " servers=", absl::StrJoin(m.servers, ","),
                                            " retries=", retries, " lost=", lost));
    }
  }
  const absl::Status left = worker.Leave(timeout);
  WriteStatus(status_path, absl::StrCat("iterations=", iterations, " retries=", retries,
                                        " lost=", lost, " left=", left.ok() ? "ok" : "error"));
  if (!left.ok()) {
    std::fprintf(stderr, "worker %d: leave: %s\n", worker.rank(), left.ToString().c_str());
    return 1;
  }
  return 0;
}

int RunServer(stepmesh::AFTensorServer& server, size_t bytes, const std::string& status_path,
              absl::Duration timeout) {
  const int slots = server.num_workers();
  std::vector<uint8_t> recv(bytes * slots), reply(bytes * slots);
  auto view = [slots](std::vector<uint8_t>& v) {
    return stepmesh::TensorView{v.data(), stepmesh::DType::kUInt8,
                                stepmesh::Shape{slots, static_cast<int64_t>(v.size() / slots)},
                                stepmesh::Device::Cpu()};
  };
  if (!server.RegisterRecvTensor(kPushKey, view(recv)).ok()) return 1;
  if (!server.RegisterReplyTensor(kPullKey, view(reply)).ok()) return 1;
  std::atomic<bool> leaving{false};
  absl::Status left;
  std::thread leaver;
  uint64_t batches = 0;
  for (;;) {
    if (g_stop.load() && !leaving.exchange(true)) {
      leaver = std::thread([&] { left = server.Leave(timeout); });
    }
    absl::StatusOr<stepmesh::Batch> batch = server.GetBatch(absl::Milliseconds(50));
    if (!batch.ok()) {
      if (absl::IsDeadlineExceeded(batch.status())) continue;
      if (!leaving.load() && absl::IsUnavailable(batch.status())) {
        // Every worker left: wait for the next to join, or for SIGTERM.
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (leaving.load() &&
          (absl::IsUnavailable(batch.status()) || absl::IsCancelled(batch.status()) ||
           absl::IsFailedPrecondition(batch.status()))) {
        break;
      }
      std::fprintf(stderr, "server %d: %s\n", server.rank(), batch.status().ToString().c_str());
      if (leaver.joinable()) leaver.join();
      return 1;
    }
    std::vector<stepmesh::Reply> replies;
    for (int w : batch->workers) {
      for (size_t i = 0; i < bytes; ++i) {
        reply[w * bytes + i] = recv[w * bytes + i] ^ Mask(server.rank());
      }
      replies.push_back({w, bytes});
    }
    if (absl::Status s = server.Respond(*batch, replies); !s.ok()) {
      std::fprintf(stderr, "server %d: respond: %s\n", server.rank(), s.ToString().c_str());
      if (leaver.joinable()) leaver.join();
      return 1;
    }
    ++batches;
    if (batches % 10 == 0) {
      const stepmesh::Membership m = server.CurrentMembership();
      WriteStatus(status_path, absl::StrCat("batches=", batches, " epoch=", m.epoch,
                                            " workers=", absl::StrJoin(m.workers, ",")));
    }
  }
  leaver.join();
  WriteStatus(status_path, absl::StrCat("batches=", batches, " left=", left.ok() ? "ok" : "error"));
  if (!left.ok()) {
    std::fprintf(stderr, "server %d: leave: %s\n", server.rank(), left.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<stepmesh::MeshOptions> from_env = stepmesh::testing::TcpNodeOptionsFromEnv();
  if (!from_env) return 2;
  stepmesh::MeshOptions options = *from_env;
  options.timeout = absl::Seconds(5);
  std::string role = "worker", status_path;
  size_t bytes = 4096;
  bool die_after_create = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--die-after-create") {
      die_after_create = true;
      continue;
    }
    if (i + 1 >= argc) return 2;
    const std::string value = argv[++i];
    if (stepmesh::testing::ApplyMeshFlag(flag, value, &options)) continue;
    int64_t n = 0;
    const bool numeric = absl::SimpleAtoi(value, &n);
    if (flag == "--role") {
      role = value;
    } else if (flag == "--status") {
      status_path = value;
    } else if (flag == "--max-workers" && numeric) {
      options.max_workers = static_cast<int>(n);
    } else if (flag == "--max-servers" && numeric) {
      options.max_servers = static_cast<int>(n);
    } else if (flag == "--bytes" && numeric) {
      bytes = static_cast<size_t>(n);
    } else {
      return stepmesh::testing::BadFlag(flag, value);
    }
  }
  signal(SIGTERM, OnTerm);
  if (role == "worker") {
    options.role = stepmesh::Role::kWorker;
    auto worker = stepmesh::testing::CreateOrSay<stepmesh::AFTensorWorker>(options, "worker");
    if (!worker.ok()) return 3;
    if (die_after_create) raise(SIGKILL);
    return RunWorker(**worker, bytes, options.ServerCapacity(), status_path, options.timeout);
  }
  if (role == "server") {
    options.role = stepmesh::Role::kServer;
    auto server = stepmesh::testing::CreateOrSay<stepmesh::AFTensorServer>(options, "server");
    if (!server.ok()) return 3;
    if (die_after_create) raise(SIGKILL);
    return RunServer(**server, bytes, status_path, options.timeout);
  }
  return 2;
}
