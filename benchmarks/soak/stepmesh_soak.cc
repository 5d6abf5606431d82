// Soak: 2 attention workers x 2 FFN servers over TCP in one process for many
// iterations with small payloads, checking every reply byte, and reporting
// resident memory and open descriptors at the start and the end (they must be
// flat: nothing may grow per request).
//
//   stepmesh_soak [--iterations N=1000000] [--bytes B=256] [--workers W=2]
//                 [--servers S=2] [--report-every K=100000] [--max-rss-growth-kb KB=8192]
//
// Exit 0 when every request succeeded with exact bytes and neither RSS (beyond
// the allowance, which covers allocator noise) nor the fd count grew.

#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "stepmesh/scheduler.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"

namespace {

using namespace stepmesh;

long RssKb() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

int OpenFds() {
  DIR* d = opendir("/proc/self/fd");
  int n = 0;
  while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n - 1;
}

struct Config {
  int64_t iterations = 1000000;
  int64_t bytes = 256;
  int workers = 2;
  int servers = 2;
  int64_t report_every = 100000;
  int64_t max_rss_growth_kb = 8192;
};

constexpr Key kPush = 1, kPull = 2;

}  // namespace

int main(int argc, char** argv) {
  Config c;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    int64_t v = 0;
    if (!absl::SimpleAtoi(argv[i + 1], &v)) {
      std::fprintf(stderr, "bad value for %s\n", flag.c_str());
      return 2;
    }
    if (flag == "--iterations")
      c.iterations = v;
    else if (flag == "--bytes")
      c.bytes = v;
    else if (flag == "--workers")
      c.workers = static_cast<int>(v);
    else if (flag == "--servers")
      c.servers = static_cast<int>(v);
    else if (flag == "--report-every")
      c.report_every = v;
    else if (flag == "--max-rss-growth-kb")
      c.max_rss_growth_kb = v;
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }

  // STEPMESH_* variables apply (log level, auth token); the settings below win.
  absl::StatusOr<MeshOptions> from_env = MeshOptions::FromEnv();
  if (!from_env.ok()) {
    std::fprintf(stderr, "stepmesh_soak: %s\n", from_env.status().ToString().c_str());
    return 2;
  }
  MeshOptions base = *from_env;
  base.transport = "tcp";
  base.num_workers = c.workers;
  base.num_servers = c.servers;
  base.scheduler = "127.0.0.1:0";
  base.timeout = absl::Seconds(20);
  base.trace.enabled = false;
  // Blocking: a soak on a small CI box must not starve itself with spinning threads.
  base.threads.poll_mode = PollMode::kBlocking;
  auto scheduler = Scheduler::Start(base);
  if (!scheduler.ok()) {
    std::fprintf(stderr, "scheduler: %s\n", scheduler.status().ToString().c_str());
    return 1;
  }
  base.scheduler = (*scheduler)->address();

  std::atomic<int64_t> done{0};
  std::atomic<int64_t> errors{0};
  std::atomic<bool> stop_servers{false};
  absl::Mutex mu;
  std::string first_error;
  auto fail = [&](const std::string& what) {
    errors.fetch_add(1);
    absl::MutexLock lock(&mu);
    if (first_error.empty()) first_error = what;
  };

  // Participant (role, rank) of the mesh.
  auto options_of = [&](Role role, int rank) {
    MeshOptions o = base;
    o.role = role;
    o.rank = rank;
    return o;
  };
  std::vector<std::thread> threads;
  for (int s = 0; s < c.servers; ++s) {
    threads.emplace_back([&, s] {
      auto server = AFTensorServer::Create(options_of(Role::kServer, s));
      if (!server.ok()) return fail(server.status().ToString());
      std::vector<uint8_t> recv(c.bytes * c.workers), reply(c.bytes * c.workers);
      const Shape shape{c.workers, c.bytes};
      if (!(*server)->RegisterRecvTensor(kPush, {recv.data(), DType::kUInt8, shape}).ok() ||
          !(*server)->RegisterReplyTensor(kPull, {reply.data(), DType::kUInt8, shape}).ok()) {
        return fail("server registration");
      }
      (void)(*server)->Barrier();
      std::vector<Reply> replies;
      while (!stop_servers.load()) {
        auto batch = (*server)->GetBatch(absl::Milliseconds(100));
        if (absl::IsDeadlineExceeded(batch.status())) continue;
        if (!batch.ok()) {
          if (!absl::IsUnavailable(batch.status())) fail(batch.status().ToString());
          break;
        }
        replies.clear();
        for (int w : batch->workers) {
          const uint8_t* in = recv.data() + w * c.bytes;
          uint8_t* out = reply.data() + w * c.bytes;
          for (int64_t j = 0; j < c.bytes; ++j) out[j] = in[j] ^ static_cast<uint8_t>(s + 1);
          replies.push_back({w});
        }
        if (absl::Status r = (*server)->Respond(*batch, replies); !r.ok()) fail(r.ToString());
      }
    });
  }
  std::atomic<int> workers_ready{0};
  for (int w = 0; w < c.workers; ++w) {
    threads.emplace_back([&, w] {
      auto worker = AFTensorWorker::Create(options_of(Role::kWorker, w));
      if (!worker.ok()) return fail(worker.status().ToString());
      std::vector<uint8_t> push(c.bytes);
      std::vector<std::vector<uint8_t>> pull(c.servers, std::vector<uint8_t>(c.bytes));
      if (!(*worker)->RegisterPushTensor(kPush, BytesView(push.data(), c.bytes)).ok()) {
        return fail("push registration");
      }
      std::vector<Pull> pulls;
      for (int s = 0; s < c.servers; ++s) {
        if (!(*worker)->RegisterPullTensor(kPull, s, BytesView(pull[s].data(), c.bytes)).ok()) {
          return fail("pull registration");
        }
        pulls.push_back({kPull, s});
      }
      (void)(*worker)->Barrier();
      workers_ready.fetch_add(1);
      const Push p{kPush};
      for (int64_t i = 0; i < c.iterations; ++i) {
        const uint8_t seed = static_cast<uint8_t>(i * 31 + w * 7);
        std::memset(push.data(), seed, c.bytes);
        auto h = (*worker)->PushPull({&p, 1}, pulls);
        absl::Status s = h.ok() ? (*worker)->Wait(*h, absl::Seconds(20)) : h.status();
        if (!s.ok()) {
          fail(absl::StrCat("worker ", w, " iteration ", i, ": ", s.ToString()));
          break;
        }
        for (int srv = 0; srv < c.servers; ++srv) {
          const uint8_t want = seed ^ static_cast<uint8_t>(srv + 1);
          if (pull[srv][0] != want || pull[srv][c.bytes - 1] != want) {
            fail(absl::StrCat("worker ", w, " iteration ", i, ": wrong reply bytes"));
            break;
          }
        }
        if (w == 0) done.store(i + 1, std::memory_order_relaxed);
      }
      (void)(*worker)->Barrier();
    });
  }

  // Baseline once everything is connected and warmed up.
  while (workers_ready.load() < c.workers && errors.load() == 0)
    absl::SleepFor(absl::Milliseconds(5));
  while (done.load() < std::min<int64_t>(1000, c.iterations) && errors.load() == 0 &&
         workers_ready.load() == c.workers) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const long rss0 = RssKb();
  const int fds0 = OpenFds();
  const absl::Time t0 = absl::Now();
  const int64_t done0 = done.load();
  std::printf("start: iteration %lld rss %ld KiB fds %d\n", static_cast<long long>(done0), rss0,
              fds0);
  std::fflush(stdout);
  int64_t next_report = c.report_every;
  while (done.load() < c.iterations && errors.load() == 0) {
    absl::SleepFor(absl::Milliseconds(50));
    if (done.load() >= next_report) {
      std::printf("  iteration %lld rss %ld KiB fds %d\n", static_cast<long long>(done.load()),
                  RssKb(), OpenFds());
      std::fflush(stdout);
      next_report += c.report_every;
    }
  }
  const long rss1 = RssKb();
  const int fds1 = OpenFds();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  const int64_t done1 = done.load();
  stop_servers.store(true);
  for (auto& t : threads) t.join();
  std::printf("end:   iteration %lld rss %ld KiB fds %d\n", static_cast<long long>(done1), rss1,
              fds1);
  std::printf(
      "%dA%dF, %lld-byte payloads: %.0f iterations/s per worker, rss %+ld KiB, fds %+d, "
      "errors %lld\n",
      c.workers, c.servers, static_cast<long long>(c.bytes),
      (done1 - done0) / std::max(seconds, 1e-9), rss1 - rss0, fds1 - fds0,
      static_cast<long long>(errors.load()));
  if (errors.load() != 0) std::printf("first error: %s\n", first_error.c_str());
  const bool flat = rss1 - rss0 <= c.max_rss_growth_kb && fds1 == fds0;
  if (!flat) std::printf("NOT FLAT: resources grew\n");
  return errors.load() == 0 && flat ? 0 : 1;
}
