// A participant process for the liveness and rejoin tests, with the tensors
// of the harness (tests/reliability/harness.h layout).
//   stepmesh_reliability_node --scheduler H:P --rank R --workers W --servers S
//       [--role server|worker] [--keys K] [--bytes B] [--timeout-ms T]
//       [--heartbeat-ms H] [--rounds N] [--stop-file F] [--barrier-every N]
//       [--barrier-loop 1]
// server (default): answers every batch with push XOR (0x10 + rank) until
//   every worker is gone (exit 0), or it is killed. With --barrier-loop, a
//   thread enters barrier after barrier meanwhile (the workers' pace).
// worker: round trips on key 0 to every server, checking each reply byte; N
//   rounds then an orderly exit 0 (N = 0: until killed, or until file F
//   exists). Prints "progress R" every 20 rounds and, with --barrier-every,
//   "barrier B round R at T" (T: seconds since the epoch) after each barrier;
//   a barrier refused while the scheduler is away is retried for the timeout.
//   Exit 3 when it cannot join (e.g. the scheduler has not yet seen its
//   previous process die), 1 on a failed round or barrier.
//   Misconfigured on purpose, in rounds 1..N of --bad-rounds N:
//     --bad-push-key K: before each round trip, a request pushing key K+round
//       (never registered on the servers), not waited for until the end; each
//       must fail NOT_FOUND ("bad pushes: N refused NOT_FOUND ...").
//     --bad-pull-key K: the round trip pulls key K (no reply tensor on the
//       servers) and must fail NOT_FOUND naming it ("bad pull refused: ...").
//   --latency 1: prints "latency rounds R p50_us A p99_us B max_us C" of the
//   round trips after the first.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "stepmesh/server.h"
#include "stepmesh/status.h"
#include "stepmesh/worker.h"
#include "tests/support/node_flags.h"

namespace {

uint8_t Mask(int server) { return static_cast<uint8_t>(0x10 + server); }

struct NodeFlags {
  int64_t keys = 2;
  int64_t bytes = 4096;
  int64_t rounds = 0;
  std::string stop_file;
  int64_t barrier_every = 0;
  bool barrier_loop = false;
  int64_t bad_push_key = -1;
  int64_t bad_pull_key = -1;
  int64_t bad_rounds = 0;
  bool latency = false;
};

// A barrier, retried while the scheduler is away (UNAVAILABLE) for up to the
// timeout: an application's way through a scheduler restart.
template <typename Participant>
absl::Status BarrierThroughRestarts(Participant& p, const stepmesh::MeshOptions& options,
                                    const std::atomic<bool>* stop = nullptr) {
  const absl::Time give_up = absl::Now() + options.timeout;
  for (;;) {
    absl::Status s = p.Barrier();
    if (!absl::IsUnavailable(s) || absl::Now() > give_up || (stop != nullptr && stop->load())) {
      return s;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
}

int RunServer(const stepmesh::MeshOptions& options, const NodeFlags& flags) {
  const int64_t keys = flags.keys, bytes = flags.bytes;
  auto server = stepmesh::testing::CreateOrSay<stepmesh::AFTensorServer>(options, "server");
  if (!server.ok()) return 1;

  const int64_t workers = options.num_workers;
  std::vector<std::vector<uint8_t>> recv(keys, std::vector<uint8_t>(bytes * workers));
  std::vector<std::vector<uint8_t>> reply(keys, std::vector<uint8_t>(bytes * workers));
  for (int64_t m = 0; m < keys; ++m) {
    const stepmesh::Shape shape{workers, bytes};
    if (!(*server)
             ->RegisterRecvTensor(100 + m, {recv[m].data(), stepmesh::DType::kUInt8, shape})
             .ok() ||
        !(*server)
             ->RegisterReplyTensor(200 + m, {reply[m].data(), stepmesh::DType::kUInt8, shape})
             .ok()) {
      return 1;
    }
  }
  // Registered before the first barrier: with barriers, no push can find a
  // key missing (a refused first round would leave the workers a batch
  // apart, and a barrier between them would then wait for ever).
  std::atomic<bool> serving{true};
  std::thread barriers;
  if (flags.barrier_loop) {
    barriers = std::thread([&] {
      while (serving.load()) {
        absl::Status s = BarrierThroughRestarts(**server, options, &serving);
        if (!s.ok() && serving.load() && !absl::IsDeadlineExceeded(s)) {
          std::fprintf(stderr, "server %d barrier: %s\n", options.rank, s.ToString().c_str());
          return;
        }
      }
    });
  }
  struct JoinBarriers {
    std::atomic<bool>& serving;
    std::thread& barriers;
    ~JoinBarriers() {
      serving.store(false);
      if (barriers.joinable()) barriers.join();
    }
  } join_barriers{serving, barriers};
  const uint8_t mask = Mask((*server)->rank());
  for (;;) {
    absl::StatusOr<stepmesh::Batch> batch = (*server)->GetBatch(absl::Milliseconds(200));
    if (absl::IsDeadlineExceeded(batch.status())) continue;
    if (!batch.ok()) {
      std::fprintf(stderr, "server %d: %s\n", options.rank, batch.status().ToString().c_str());
      return absl::IsUnavailable(batch.status()) ? 0 : 1;
    }
    std::vector<stepmesh::Reply> replies;
    const stepmesh::BatchTensor& t = batch->tensors[0];
    const int64_t m = static_cast<int64_t>(t.key) - 100;
    for (size_t k = 0; k < batch->workers.size(); ++k) {
      const int w = batch->workers[k];
      const auto* in = static_cast<const uint8_t*>(t.region.data) + w * t.slot_bytes;
      uint8_t* out = reply[m].data() + w * bytes;
      for (int64_t j = 0; j < bytes; ++j) out[j] = in[j] ^ mask;
      replies.push_back({w});
    }
    (void)(*server)->Respond(*batch, replies);
  }
}

int RunWorker(const stepmesh::MeshOptions& options, const NodeFlags& flags) {
  const int64_t bytes = flags.bytes, rounds = flags.rounds;
  auto worker = stepmesh::testing::CreateOrSay<stepmesh::AFTensorWorker>(options, "worker");
  if (!worker.ok()) return 3;
  const int servers = options.num_servers;
  std::vector<uint8_t> push(bytes);
  std::vector<std::vector<uint8_t>> pulls(servers, std::vector<uint8_t>(bytes));
  if (!(*worker)->RegisterPushTensor(100, stepmesh::BytesView(push.data(), bytes)).ok()) return 1;
  std::vector<stepmesh::Pull> pull_list;
  for (int s = 0; s < servers; ++s) {
    if (!(*worker)->RegisterPullTensor(200, s, stepmesh::BytesView(pulls[s].data(), bytes)).ok()) {
      return 1;
    }
    pull_list.push_back({200, s});
  }
  const bool bad_pushes = flags.bad_push_key >= 0 && flags.bad_rounds > 0;
  const bool bad_pulls = flags.bad_pull_key >= 0 && flags.bad_rounds > 0;
  std::vector<uint8_t> bad_tensor(bytes, 0x5a);
  std::vector<std::vector<uint8_t>> bad_pull_tensors;
  std::vector<stepmesh::Pull> bad_pull_list;
  for (int64_t r = 1; bad_pushes && r <= flags.bad_rounds; ++r) {
    if (!(*worker)
             ->RegisterPushTensor(static_cast<stepmesh::Key>(flags.bad_push_key + r),
                                  stepmesh::BytesView(bad_tensor.data(), bytes))
             .ok()) {
      return 1;
    }
  }
  if (bad_pulls) {
    bad_pull_tensors.assign(servers, std::vector<uint8_t>(bytes));
    for (int s = 0; s < servers; ++s) {
      const auto key = static_cast<stepmesh::Key>(flags.bad_pull_key);
      if (!(*worker)
               ->RegisterPullTensor(key, s, stepmesh::BytesView(bad_pull_tensors[s].data(), bytes))
               .ok()) {
        return 1;
      }
      bad_pull_list.push_back({key, s});
    }
  }
  std::vector<stepmesh::RequestHandle> bad_handles;
  int64_t bad_pulls_refused = 0;
  std::vector<int64_t> latencies_ns;
  auto round_trip = [&](int64_t round) -> absl::Status {
    const bool misbehave = round >= 1 && round <= flags.bad_rounds;
    if (bad_pushes && misbehave) {
      const stepmesh::Push bad{static_cast<stepmesh::Key>(flags.bad_push_key + round)};
      absl::StatusOr<stepmesh::RequestHandle> h = (*worker)->PushPull({&bad, 1}, {});
      if (!h.ok()) return h.status();
      bad_handles.push_back(*h);
    }
    const uint8_t fill = static_cast<uint8_t>(round * 7 + options.rank);
    for (int64_t j = 0; j < bytes; ++j) push[j] = static_cast<uint8_t>(fill + j);
    const stepmesh::Push p{100};
    const absl::Time start = absl::Now();
    absl::StatusOr<stepmesh::RequestHandle> h =
        (*worker)->PushPull({&p, 1}, bad_pulls && misbehave ? bad_pull_list : pull_list);
    if (!h.ok()) return h.status();
    absl::Status waited = (*worker)->Wait(*h, options.timeout);
    if (bad_pulls && misbehave) {
      const std::string named = absl::StrCat("pulls key ", flags.bad_pull_key);
      if (!absl::IsNotFound(waited) || !absl::StrContains(waited.message(), named)) {
        return absl::InternalError(
            absl::StrCat("the bad pull was not refused naming its key: ", waited.ToString()));
      }
      std::printf("bad pull refused: %s\n", waited.ToString().c_str());
      std::fflush(stdout);
      ++bad_pulls_refused;
      return absl::OkStatus();
    }
    if (!waited.ok()) return waited;
    if (round > 0) latencies_ns.push_back(absl::ToInt64Nanoseconds(absl::Now() - start));
    for (int s = 0; s < servers; ++s) {
      for (int64_t j = 0; j < bytes; ++j) {
        if (pulls[s][j] != (static_cast<uint8_t>(fill + j) ^ Mask(s))) {
          return absl::DataLossError("reply byte mismatch");
        }
      }
    }
    return absl::OkStatus();
  };
  if (flags.barrier_every > 0) {
    // Everyone registered before the first round (see RunServer).
    if (absl::Status s = BarrierThroughRestarts(**worker, options); !s.ok()) {
      std::fprintf(stderr, "worker %d start barrier: %s\n", options.rank, s.ToString().c_str());
      return 1;
    }
  }
  // The servers take the connection right after the join; the first round may
  // need a retry while they do.
  absl::Status first = round_trip(0);
  for (int tries = 0; !first.ok() && tries < 50; ++tries) {
    absl::SleepFor(absl::Milliseconds(100));
    first = round_trip(0);
  }
  int64_t barrier = 0;
  for (int64_t round = 1; first.ok() && (rounds == 0 || round < rounds); ++round) {
    if (absl::Status s = round_trip(round); !s.ok()) {
      std::fprintf(stderr, "worker %d round %lld: %s\n", options.rank,
                   static_cast<long long>(round), s.ToString().c_str());
      return 1;
    }
    if (round % 20 == 0) {
      std::printf("progress %lld\n", static_cast<long long>(round));
      std::fflush(stdout);
    }
    if (flags.barrier_every > 0 && round % flags.barrier_every == 0) {
      if (absl::Status s = BarrierThroughRestarts(**worker, options); !s.ok()) {
        std::fprintf(stderr, "worker %d barrier %lld: %s\n", options.rank,
                     static_cast<long long>(barrier + 1), s.ToString().c_str());
        return 1;
      }
      std::printf("barrier %lld round %lld at %.3f\n", static_cast<long long>(++barrier),
                  static_cast<long long>(round),
                  absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
      std::fflush(stdout);
    }
    if (!flags.stop_file.empty() && ::access(flags.stop_file.c_str(), F_OK) == 0) {
      std::printf("worker %d: %lld rounds checked, %lld barriers\n", options.rank,
                  static_cast<long long>(round + 1), static_cast<long long>(barrier));
      std::fflush(stdout);
      break;
    }
  }
  if (!first.ok()) {
    std::fprintf(stderr, "worker %d: %s\n", options.rank, first.ToString().c_str());
    return 1;
  }
  if (bad_pushes) {
    std::string first_refusal;
    for (stepmesh::RequestHandle h : bad_handles) {
      absl::Status s = (*worker)->Wait(h, options.timeout * 2);
      if (!absl::IsNotFound(s)) {
        std::fprintf(stderr, "worker %d: a push of an unregistered key ended %s\n", options.rank,
                     s.ToString().c_str());
        return 1;
      }
      if (first_refusal.empty()) first_refusal = s.ToString();
    }
    std::printf("bad pushes: %zu refused (%s)\n", bad_handles.size(), first_refusal.c_str());
  }
  if (bad_pulls && bad_pulls_refused == 0) {
    std::fprintf(stderr, "worker %d: %lld bad pulls refused\n", options.rank,
                 static_cast<long long>(bad_pulls_refused));
    return 1;
  }
  if (flags.latency && !latencies_ns.empty()) {
    std::sort(latencies_ns.begin(), latencies_ns.end());
    const auto at = [&](double q) {
      return latencies_ns[std::min(latencies_ns.size() - 1,
                                   static_cast<size_t>(q * latencies_ns.size()))] /
             1000.0;
    };
    std::printf("latency rounds %zu p50_us %.1f p99_us %.1f max_us %.1f\n", latencies_ns.size(),
                at(0.5), at(0.99), latencies_ns.back() / 1000.0);
  }
  std::fflush(stdout);
  return (*worker)->Shutdown().ok() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<stepmesh::MeshOptions> from_env = stepmesh::testing::TcpNodeOptionsFromEnv();
  if (!from_env) return 2;
  stepmesh::MeshOptions options = *from_env;
  options.role = stepmesh::Role::kServer;
  NodeFlags f;
  // The numeric flags of this program (0 or 1 for the switches).
  const std::pair<std::string_view, int64_t*> numbers[] = {{"--keys", &f.keys},
                                                           {"--bytes", &f.bytes},
                                                           {"--rounds", &f.rounds},
                                                           {"--barrier-every", &f.barrier_every},
                                                           {"--bad-push-key", &f.bad_push_key},
                                                           {"--bad-pull-key", &f.bad_pull_key},
                                                           {"--bad-rounds", &f.bad_rounds}};
  const std::pair<std::string_view, bool*> switches[] = {{"--barrier-loop", &f.barrier_loop},
                                                         {"--latency", &f.latency}};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (stepmesh::testing::ApplyMeshFlag(flag, value, &options)) continue;
    int64_t n = 0;
    const bool numeric = absl::SimpleAtoi(value, &n);
    const auto named = [&](const auto& row) { return row.first == flag; };
    const auto* number = std::find_if(std::begin(numbers), std::end(numbers), named);
    const auto* on_off = std::find_if(std::begin(switches), std::end(switches), named);
    if (flag == "--role" && (value == "server" || value == "worker")) {
      options.role = value == "server" ? stepmesh::Role::kServer : stepmesh::Role::kWorker;
    } else if (flag == "--stop-file") {
      f.stop_file = value;
    } else if (number != std::end(numbers) && numeric) {
      *number->second = n;
    } else if (on_off != std::end(switches) && numeric) {
      *on_off->second = n != 0;
    } else if (flag == "--heartbeat-ms" && numeric) {
      options.heartbeat_interval = absl::Milliseconds(n);
    } else {
      return stepmesh::testing::BadFlag(flag, value);
    }
  }
  return options.role == stepmesh::Role::kServer ? RunServer(options, f) : RunWorker(options, f);
}
