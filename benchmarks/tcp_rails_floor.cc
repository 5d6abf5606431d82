// tcp_rails_floor: the hand-written floor of the TCP rails benchmark
// (benchmarks/tcp_rails_bench.sh, docs/benchmarks.md "TCP rails"). The same
// exchange as stepmesh_perf 1A1F -- a push on one socket, a reply back -- with
// no library: the reply cut into one piece per socket (one socket per rail),
// the pieces written at once by one thread per socket and read at once by one
// thread per socket, straight into the destination. With --sockets 1 it is
// the one-socket floor of the same run.
//
//   tcp_rails_floor --role server --listen A:P[,B:P] [--sessions N] [--deadline-s S]
//   tcp_rails_floor --role client --connect A:P[,B:P] [--sockets K] [--push B]
//       [--pull B] [--iters N] [--warmup W] [--rx threads|poll] [--wait spin|block]
//       [--label NAME]
//
// The server accepts a session on its first listener (a hello: sockets, push
// and pull sizes, a pattern seed), then one connection on each further
// listener it uses, and serves it until the client closes socket 0. The client
// prints one row (` NAME iters t_min t_p50 t_p99 t_mean Gb/s`, microseconds)
// and when and on which socket each piece's first and last byte arrived
// (p50, from the request's send): pieces that cross side by side arrive
// together, pieces that cross one after the other do not. Every reply is
// compared byte for byte (outside the timed region). --rx poll reads every
// socket on one thread (poll + non-blocking recv), as the transport does.
// --wait block (the default) sleeps in recv and on condition variables;
// spin busy-polls on both ends while a message is due (yielding the CPU), as
// the library's adaptive mode does -- with four such threads on two cores
// shared with other work, spinning is the slower of the two.
// Socket buffers and TCP_NODELAY as the TCP transport sets them.

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/base/net.h"
#include "stepmesh/status.h"

namespace stepmesh::bench {
namespace {

constexpr int kSocketBuffer = 8 << 20;  // as tcp_transport_impl.h's kSocketBufferBytes
constexpr size_t kMaxSockets = 4;
constexpr uint64_t kMaxBytes = uint64_t{1} << 30;
constexpr absl::Duration kIoTimeout = absl::Seconds(30);

using Clock = std::chrono::steady_clock;
double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

struct Hello {
  uint64_t sockets = 1;
  uint64_t push = 0;
  uint64_t pull = 0;
  uint64_t seed = 0;
  uint64_t spin = 0;  // both ends busy-poll (--wait spin), or block
};

// Piece i of a `pull`-byte reply cut for k sockets: [Offset(i), Offset(i+1)).
size_t Offset(size_t pull, size_t k, size_t i) {
  const size_t piece = (pull / k + 4095) / 4096 * 4096;  // page-aligned, as the rails cut
  return std::min(pull, piece * i);
}

void Fill(std::vector<char>& out, uint64_t seed) {
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>((i * 131 + seed) >> 3);
}

absl::Status Configure(int fd) {
  STEPMESH_RETURN_IF_ERROR(base::SetNoDelay(fd));
  STEPMESH_RETURN_IF_ERROR(base::SetBufferSizes(fd, kSocketBuffer));
  const timeval tv = absl::ToTimeval(kIoTimeout);
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    return absl::InternalError(base::ErrnoMessage("setsockopt timeouts", errno));
  }
  return absl::OkStatus();
}

absl::Status Send(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError(base::ErrnoMessage("send", errno));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Receive of exactly `bytes`; `first` (if given) gets the time the first
// byte was there. Blocking, or with `spin` busy-polled (non-blocking recv,
// the CPU yielded between empty tries), as the library's adaptive receive
// thread does while a reply is due.
absl::Status Receive(int fd, void* data, size_t bytes, bool spin,
                     Clock::time_point* first = nullptr) {
  char* p = static_cast<char*>(data);
  const absl::Time deadline = absl::Now() + kIoTimeout;
  for (uint32_t idle = 0; bytes > 0;) {
    const int flags = spin ? MSG_DONTWAIT : first != nullptr ? 0 : MSG_WAITALL;
    const ssize_t n = ::recv(fd, p, bytes, flags);
    if (n < 0 && (errno == EINTR || (spin && errno == EAGAIN))) {
      if (++idle % 4096 == 0 && absl::Now() > deadline) {
        return absl::DeadlineExceededError("recv timed out");
      }
      std::this_thread::yield();
      continue;
    }
    if (n == 0) return absl::UnavailableError("the peer closed");
    if (n < 0) return absl::UnavailableError(base::ErrnoMessage("recv", errno));
    if (first != nullptr) *first = Clock::now();
    first = nullptr;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Runs `work(i)` for i in 1..k-1 on one thread each, once per Go(); Go runs
// piece 0 on the calling thread and returns when every piece is done. The
// threads wait for a round on a condition variable, or with `spin` polling
// (yielding the CPU), so a round starts without a wake-up.
class Crew {
 public:
  template <typename F>
  Crew(size_t k, bool spin, F work) : k_(k), spin_(spin) {
    for (size_t i = 1; i < k; ++i) {
      threads_.emplace_back([this, i, work] {
        for (uint64_t mine = 0;; ++mine) {
          Await([&] { return stop_.load() || round_.load() > mine; }, cv_);
          if (stop_.load()) return;
          const absl::Status s = work(i);
          std::lock_guard<std::mutex> lock(mu_);
          if (!s.ok() && failure_.ok()) failure_ = s;
          done_.fetch_add(1);
          done_cv_.notify_one();
        }
      });
    }
  }
  ~Crew() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  template <typename F>
  absl::Status Go(F piece0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_.store(0);
      round_.fetch_add(1);
    }
    cv_.notify_all();
    absl::Status s = piece0();
    Await([&] { return done_.load() == k_ - 1; }, done_cv_);
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) s = failure_;
    return s;
  }

 private:
  template <typename P>
  void Await(P ready, std::condition_variable& cv) {
    if (spin_) {
      while (!ready()) std::this_thread::yield();
      return;
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv.wait(lock, ready);
  }

  size_t k_;
  bool spin_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::atomic<uint64_t> round_{0};
  std::atomic<size_t> done_{0};
  std::atomic<bool> stop_{false};
  absl::Status failure_;
  std::vector<std::thread> threads_;
};

absl::Status Serve(std::vector<base::UniqueFd>& listeners, absl::Time deadline) {
  STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd first, base::AcceptTcp(listeners[0].get(), deadline));
  STEPMESH_RETURN_IF_ERROR(Configure(first.get()));
  Hello hello;
  STEPMESH_RETURN_IF_ERROR(Receive(first.get(), &hello, sizeof(hello), /*spin=*/false));
  if (hello.sockets < 1 || hello.sockets > listeners.size() || hello.push > kMaxBytes ||
      hello.pull > kMaxBytes) {
    return absl::InvalidArgumentError(absl::StrCat("hello: sockets ", hello.sockets, " (of ",
                                                   listeners.size(), "), push ", hello.push,
                                                   ", pull ", hello.pull));
  }
  const size_t k = hello.sockets;
  std::vector<base::UniqueFd> fds;
  fds.push_back(std::move(first));
  for (size_t i = 1; i < k; ++i) {
    STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd fd, base::AcceptTcp(listeners[i].get(), deadline));
    STEPMESH_RETURN_IF_ERROR(Configure(fd.get()));
    fds.push_back(std::move(fd));
  }
  std::vector<char> push(hello.push + sizeof(uint64_t)), reply(hello.pull);
  Fill(reply, hello.seed);
  // How long each socket's send() of its piece took (it returns once the
  // kernel took the bytes: the copy, and what the kernel sends inline).
  std::vector<std::vector<double>> took(k);
  auto write_piece = [&](size_t i) {
    const size_t from = Offset(reply.size(), k, i), to = Offset(reply.size(), k, i + 1);
    const Clock::time_point t0 = Clock::now();
    absl::Status s = Send(fds[i].get(), reply.data() + from, to - from);
    took[i].push_back(Micros(Clock::now() - t0));
    return s;
  };
  const bool spin = hello.spin != 0;
  Crew crew(k, spin, write_piece);
  for (;;) {
    // A request: its number, then the push.
    const absl::Status got = Receive(fds[0].get(), push.data(), push.size(), spin);
    if (!got.ok()) break;  // the client closed: the session is over
    STEPMESH_RETURN_IF_ERROR(crew.Go([&] { return write_piece(0); }));
  }
  std::string line;
  for (size_t i = 0; i < k; ++i) {
    std::sort(took[i].begin(), took[i].end());
    if (!took[i].empty()) {
      absl::StrAppend(&line, " socket ", i, " ", took[i][took[i].size() / 2]);
    }
  }
  std::fprintf(stderr, "tcp_rails_floor server: %zu socket(s), send() of a piece p50 us:%s\n", k,
               line.c_str());
  return absl::OkStatus();
}

struct Sample {
  double total = 0;
  double first[kMaxSockets] = {};
  double last[kMaxSockets] = {};
};

// One thread per socket: each reads its piece (blocking); poll: one thread
// reads whatever socket has bytes.
absl::Status ReceivePoll(std::vector<base::UniqueFd>& fds, std::vector<char>& into, bool spin,
                         Clock::time_point start, Sample& s) {
  const size_t k = fds.size();
  std::vector<size_t> got(k, 0);
  size_t open = k;
  const absl::Time deadline = absl::Now() + kIoTimeout;
  while (open > 0) {
    if (absl::Now() > deadline) return absl::DeadlineExceededError("reply timed out");
    pollfd pfd[kMaxSockets];
    size_t which[kMaxSockets], n = 0;
    for (size_t i = 0; i < k; ++i) {
      if (got[i] == Offset(into.size(), k, i + 1) - Offset(into.size(), k, i)) continue;
      pfd[n] = {fds[i].get(), POLLIN, 0};
      which[n++] = i;
    }
    const int ready = ::poll(pfd, n, spin ? 0 : 1000);
    if (ready < 0 && errno != EINTR) {
      return absl::UnavailableError(base::ErrnoMessage("poll", errno));
    }
    if (ready <= 0 && spin) std::this_thread::yield();
    for (size_t j = 0; j < n; ++j) {
      if (pfd[j].revents == 0) continue;
      const size_t i = which[j];
      const size_t from = Offset(into.size(), k, i), want = Offset(into.size(), k, i + 1) - from;
      const ssize_t r = ::recv(fds[i].get(), into.data() + from + got[i], want - got[i], 0);
      if (r == 0) return absl::UnavailableError("the server closed");
      if (r < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        return absl::UnavailableError(base::ErrnoMessage("recv", errno));
      }
      if (got[i] == 0) s.first[i] = Micros(Clock::now() - start);
      got[i] += static_cast<size_t>(r);
      if (got[i] == want) {
        s.last[i] = Micros(Clock::now() - start);
        --open;
      }
    }
  }
  return absl::OkStatus();
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

struct ClientFlags {
  std::vector<std::string> connect;
  size_t sockets = 1;
  uint64_t push = 65536, pull = 1835008;
  int iters = 300, warmup = 20;
  bool poll = false;
  bool spin = false;
  std::string label;
};

absl::Status RunClient(const ClientFlags& f) {
  const size_t k = f.sockets;
  if (k < 1 || k > f.connect.size() || k > kMaxSockets) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sockets ", k, ": want 1..", std::min(f.connect.size(), kMaxSockets)));
  }
  const absl::Time deadline = absl::Now() + kIoTimeout;
  std::vector<base::UniqueFd> fds;
  Hello hello{k, f.push, f.pull, static_cast<uint64_t>(absl::ToUnixMicros(absl::Now())),
              f.spin ? 1u : 0u};
  for (size_t i = 0; i < k; ++i) {
    STEPMESH_ASSIGN_OR_RETURN(base::HostPort to, base::ParseHostPort(f.connect[i]));
    STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd fd, base::ConnectTcp(to, deadline));
    STEPMESH_RETURN_IF_ERROR(Configure(fd.get()));
    // The hello first: the server accepts the other sockets only after it.
    if (i == 0) STEPMESH_RETURN_IF_ERROR(Send(fd.get(), &hello, sizeof(hello)));
    fds.push_back(std::move(fd));
  }
  std::vector<char> push(f.push + sizeof(uint64_t), 7), into(f.pull), expected(f.pull);
  Fill(expected, hello.seed);
  Clock::time_point start;
  Sample s;
  auto read_piece = [&](size_t i) {
    const size_t from = Offset(into.size(), k, i), to = Offset(into.size(), k, i + 1);
    Clock::time_point first = start;
    absl::Status r = Receive(fds[i].get(), into.data() + from, to - from, f.spin, &first);
    s.first[i] = Micros(first - start);
    s.last[i] = Micros(Clock::now() - start);
    return r;
  };
  Crew crew(f.poll ? 1 : k, f.spin, read_piece);
  std::vector<Sample> samples;
  for (int it = 0; it < f.warmup + f.iters; ++it) {
    std::memset(into.data(), 0, into.size());
    std::memcpy(push.data(), &it, sizeof(it));
    start = Clock::now();
    STEPMESH_RETURN_IF_ERROR(Send(fds[0].get(), push.data(), push.size()));
    STEPMESH_RETURN_IF_ERROR(f.poll ? ReceivePoll(fds, into, f.spin, start, s)
                                    : crew.Go([&] { return read_piece(0); }));
    s.total = Micros(Clock::now() - start);
    if (into != expected) {
      return absl::DataLossError(absl::StrCat("iteration ", it, ": the reply differs"));
    }
    if (it >= f.warmup) samples.push_back(s);
  }
  std::vector<double> total;
  for (const Sample& x : samples) total.push_back(x.total);
  double mean = 0;
  for (double t : total) mean += t / static_cast<double>(total.size());
  const double p50 = Percentile(total, 0.5);
  std::printf(" %-14s %6d %9.2f %9.2f %9.2f %9.2f %8.2f\n", f.label.c_str(), f.iters,
              Percentile(total, 0), p50, Percentile(total, 0.99), mean,
              static_cast<double>(f.pull + f.push) * 8 / (p50 * 1000));
  std::string arrivals;
  for (size_t i = 0; i < k; ++i) {
    std::vector<double> first, last;
    for (const Sample& x : samples) {
      first.push_back(x.first[i]);
      last.push_back(x.last[i]);
    }
    absl::StrAppend(&arrivals, " socket ", i, " ", Percentile(first, 0.5), "/",
                    Percentile(last, 0.5));
  }
  std::printf(" %-14s first/last byte p50 us:%s\n", f.label.c_str(), arrivals.c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

absl::Status Main(int argc, char** argv) {
  std::string role;
  ClientFlags f;
  std::vector<std::string> listen;
  int sessions = 1, deadline_s = 600;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(flag, ": needs a value"));
    const std::string v = argv[++i];
    bool ok = true;
    if (flag == "--role") {
      role = v;
    } else if (flag == "--listen") {
      listen = absl::StrSplit(v, ',');
    } else if (flag == "--connect") {
      f.connect = absl::StrSplit(v, ',');
    } else if (flag == "--sockets") {
      ok = absl::SimpleAtoi(v, &f.sockets);
    } else if (flag == "--push") {
      ok = absl::SimpleAtoi(v, &f.push) && f.push <= kMaxBytes;
    } else if (flag == "--pull") {
      ok = absl::SimpleAtoi(v, &f.pull) && f.pull <= kMaxBytes;
    } else if (flag == "--iters") {
      ok = absl::SimpleAtoi(v, &f.iters) && f.iters > 0;
    } else if (flag == "--warmup") {
      ok = absl::SimpleAtoi(v, &f.warmup) && f.warmup >= 0;
    } else if (flag == "--rx") {
      ok = v == "threads" || v == "poll";
      f.poll = v == "poll";
    } else if (flag == "--wait") {
      ok = v == "spin" || v == "block";
      f.spin = v == "spin";
    } else if (flag == "--label") {
      f.label = v;
    } else if (flag == "--sessions") {
      ok = absl::SimpleAtoi(v, &sessions) && sessions > 0;
    } else if (flag == "--deadline-s") {
      ok = absl::SimpleAtoi(v, &deadline_s) && deadline_s > 0;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", flag));
    }
    if (!ok) return absl::InvalidArgumentError(absl::StrCat(flag, " ", v, ": bad value"));
  }
  if (role == "server") {
    if (listen.empty() || listen.size() > kMaxSockets) {
      return absl::InvalidArgumentError("--listen: want 1 to 4 host:port");
    }
    std::vector<base::UniqueFd> listeners;
    for (const std::string& at : listen) {
      STEPMESH_ASSIGN_OR_RETURN(base::HostPort hp, base::ParseHostPort(at));
      STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd fd, base::ListenTcp(hp.host, hp.port));
      STEPMESH_RETURN_IF_ERROR(base::SetBufferSizes(fd.get(), kSocketBuffer));
      listeners.push_back(std::move(fd));
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(deadline_s);
    for (int s = 0; s < sessions; ++s) STEPMESH_RETURN_IF_ERROR(Serve(listeners, deadline));
    return absl::OkStatus();
  }
  if (role == "client") {
    if (f.label.empty()) f.label = absl::StrCat("floor-", f.sockets, "sock", f.poll ? "-poll" : "");
    return RunClient(f);
  }
  return absl::InvalidArgumentError("--role: want server or client");
}

}  // namespace
}  // namespace stepmesh::bench

int main(int argc, char** argv) {
  const absl::Status s = stepmesh::bench::Main(argc, argv);
  if (!s.ok()) {
    std::fprintf(stderr, "tcp_rails_floor: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
