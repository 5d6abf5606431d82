// link_delay: holds every packet of one netfilter queue for a fixed delay
// (plus uniform jitter), then lets it go: the one-way latency of an emulated
// link (scripts/cluster.sh).
//
//   link_delay --queue N --delay-us D [--jitter-us J]
//
// Why a program: this kernel has neither the netem nor the fq qdisc (so no
// queueing delay and no earliest-departure-time pacing), and no tc gact
// action. The netfilter queue is kernel-side: packets stay in the kernel,
// this program only learns each packet's id (NFQNL_COPY_META: no payload
// crosses) and issues the verdict when it is due. So TCP keeps its semantics
// (segments are delayed, never proxied or re-segmented; GSO packets are
// queued whole), but the delay has the granularity of a user-space timer:
// a wake-up on a loaded machine adds tens of microseconds, which is why
// scripts/cluster.sh measures the RTT it got and prints it. Packets leave in
// the order they came (netem with jitter can reorder; this never does).
// Exits on SIGTERM/SIGINT, first accepting everything it holds.

#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <string>

extern "C" {
#include <libnetfilter_queue/libnetfilter_queue.h>
}

namespace {

volatile sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

struct Held {
  uint32_t id;
  int64_t due_ns;
};

struct State {
  std::deque<Held> held;
  int64_t delay_ns = 0;
  int64_t jitter_ns = 0;
  int64_t last_due_ns = 0;
  std::mt19937_64 rng{std::random_device{}()};
};

int OnPacket(nfq_q_handle*, nfgenmsg*, nfq_data* nfa, void* data) {
  auto* s = static_cast<State*>(data);
  const nfqnl_msg_packet_hdr* ph = nfq_get_msg_packet_hdr(nfa);
  if (ph == nullptr) return 0;
  int64_t due = NowNs() + s->delay_ns;
  if (s->jitter_ns > 0) {
    std::uniform_int_distribution<int64_t> d(-s->jitter_ns, s->jitter_ns);
    due += d(s->rng);
  }
  // First in, first out: a packet never overtakes an earlier one.
  if (due < s->last_due_ns) due = s->last_due_ns;
  s->last_due_ns = due;
  s->held.push_back({ntohl(ph->packet_id), due});
  return 0;
}

bool ParseInt(const char* text, long* out) {
  char* end = nullptr;
  errno = 0;
  *out = std::strtol(text, &end, 10);
  return errno == 0 && end != text && *end == '\0' && *out >= 0;
}

int Usage(const char* why) {
  std::fprintf(stderr, "link_delay: %s\nusage: link_delay --queue N --delay-us D [--jitter-us J]\n",
               why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  long queue = -1, delay_us = -1, jitter_us = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    long* target = flag == "--queue"       ? &queue
                   : flag == "--delay-us"  ? &delay_us
                   : flag == "--jitter-us" ? &jitter_us
                                           : nullptr;
    if (target == nullptr) return Usage(("unknown flag " + flag).c_str());
    if (i + 1 >= argc || !ParseInt(argv[++i], target)) {
      return Usage((flag + " needs a non-negative integer").c_str());
    }
  }
  if (queue < 0 || queue > 65535) return Usage("--queue N in [0, 65535] is required");
  if (delay_us < 0) return Usage("--delay-us is required");
  if (jitter_us > delay_us) return Usage("--jitter-us must not exceed --delay-us");

  State s;
  s.delay_ns = delay_us * 1000;
  s.jitter_ns = jitter_us * 1000;
  // The default timer slack (50 us) would be larger than the delays we model.
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  signal(SIGTERM, OnSignal);
  signal(SIGINT, OnSignal);

  nfq_handle* h = nfq_open();
  if (h == nullptr) {
    std::perror("link_delay: nfq_open");
    return 1;
  }
  nfq_q_handle* qh = nfq_create_queue(h, static_cast<uint16_t>(queue), &OnPacket, &s);
  if (qh == nullptr) {
    std::fprintf(stderr, "link_delay: cannot bind netfilter queue %ld: %s\n", queue,
                 std::strerror(errno));
    nfq_close(h);
    return 1;
  }
  if (nfq_set_mode(qh, NFQNL_COPY_META, 0) < 0 || nfq_set_queue_maxlen(qh, 1 << 16) < 0) {
    std::fprintf(stderr, "link_delay: cannot configure queue %ld\n", queue);
    return 1;
  }
  // Whole GSO packets (the kernel would otherwise segment them for us).
  nfq_set_queue_flags(qh, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO);
  nfnl_rcvbufsiz(nfq_nfnlh(h), 16 << 20);
  const int fd = nfq_fd(h);
  std::printf("link_delay: queue %ld, delay %ld us, jitter %ld us\n", queue, delay_us, jitter_us);
  std::fflush(stdout);

  alignas(8) static char buf[1 << 16];
  uint64_t packets = 0;
  while (!g_stop) {
    // Release what is due: one batch verdict covers every id up to the last.
    const int64_t now = NowNs();
    uint32_t last = 0;
    bool any = false;
    while (!s.held.empty() && s.held.front().due_ns <= now) {
      last = s.held.front().id;
      any = true;
      s.held.pop_front();
      ++packets;
    }
    if (any) nfq_set_verdict_batch(qh, last, NF_ACCEPT);
    timespec timeout{1, 0};  // idle: wake each second to check for a signal
    if (!s.held.empty()) {
      const int64_t wait = s.held.front().due_ns - NowNs();
      timeout = wait > 0 ? timespec{wait / 1000000000, wait % 1000000000} : timespec{0, 0};
    }
    pollfd p{fd, POLLIN, 0};
    const int ready = ppoll(&p, 1, &timeout, nullptr);
    if (ready < 0 && errno != EINTR) {
      std::perror("link_delay: ppoll");
      break;
    }
    if (ready > 0) {
      // Drain what is there without blocking.
      for (int i = 0; i < 64; ++i) {
        const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n < 0) {
          if (errno == ENOBUFS) {
            std::fprintf(stderr, "link_delay: queue %ld overran its socket (packets lost)\n",
                         queue);
            continue;
          }
          break;
        }
        nfq_handle_packet(h, buf, static_cast<int>(n));
      }
    }
  }
  if (!s.held.empty()) nfq_set_verdict_batch(qh, s.held.back().id, NF_ACCEPT);
  std::printf("link_delay: queue %ld released %llu packets\n", queue,
              static_cast<unsigned long long>(packets + s.held.size()));
  nfq_destroy_queue(qh);
  nfq_close(h);
  return 0;
}
