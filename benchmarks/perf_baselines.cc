#include "benchmarks/perf_baselines.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "benchmarks/perf_baselines_io.h"
#include "stepmesh/status.h"

#ifdef STEPMESH_HAVE_ZMQ
#include <zmq.h>
#endif

namespace stepmesh::bench {
namespace {

using baseline_io::ConfigureRaw;
using baseline_io::LowWater;
using baseline_io::ReadAll;
using baseline_io::ReceiveQueued;
using baseline_io::SizeHeader;
using baseline_io::SpinReadAll;
using baseline_io::WriteAll;

// How long a spinning echo connection busy-polls for the next header before it
// falls back to a blocking receive (the library's adaptive mode does the same):
// the gap between two iterations is far shorter, the gap while other methods
// run far longer, and a spinner left running then would steal their CPU.
constexpr absl::Duration kHeaderSpin = absl::Milliseconds(20);

// The AF batch barrier: an FFN server computes on every worker's push
// together, so it answers none before all of them arrived. `spin` waits by
// busy-polling (the spin discipline), otherwise on a condition variable.
class CyclicBarrier {
 public:
  // False on timeout (a client vanished): the caller drops its connection.
  bool Arrive(uint64_t parties, absl::Duration timeout, bool spin) {
    if (parties <= 1) return true;
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t generation = generation_.load(std::memory_order_relaxed);
    if (++arrived_ >= parties) {
      arrived_ = 0;
      generation_.store(generation + 1, std::memory_order_release);
      cv_.notify_all();
      return true;
    }
    if (spin) {
      lock.unlock();
      const absl::Time deadline = absl::Now() + timeout;
      for (uint32_t i = 1; generation_.load(std::memory_order_acquire) == generation; ++i) {
        if (i % 1024 == 0 && absl::Now() > deadline) return false;
        std::this_thread::yield();  // as the library's empty spin rounds do
      }
      return true;
    }
    return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                        [&] { return generation_.load(std::memory_order_relaxed) != generation; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t arrived_ = 0;
  std::atomic<uint64_t> generation_{0};
};
constexpr size_t kMaxBaselineBytes = size_t{1} << 30;  // refuse absurd sizes from a stray peer

class BaselineServersImpl final : public BaselineServers {
 public:
  ~BaselineServersImpl() override {
    stop_ = true;
    // shutdown() wakes the blocked accept() and recv() calls.
    if (listener_.valid()) ::shutdown(listener_.get(), SHUT_RDWR);
    if (acceptor_.joinable()) acceptor_.join();
    {
      absl::MutexLock lock(&mu_);
      for (int fd : conn_fds_) ::shutdown(fd, SHUT_RDWR);
    }
    for (std::thread& t : conns_) t.join();
    if (zmq_thread_.joinable()) zmq_thread_.join();
#ifdef STEPMESH_HAVE_ZMQ
    if (zmq_ctx_ != nullptr) zmq_ctx_term(zmq_ctx_);
#endif
  }

  absl::Status Init(const std::string& host, uint16_t raw_port, uint16_t zmq_port, int sockbuf) {
    sockbuf_ = sockbuf;
    STEPMESH_ASSIGN_OR_RETURN(listener_, base::ListenTcp(host, raw_port));
    acceptor_ = std::thread([this] { AcceptLoop(); });
    if (zmq_port != 0) {
#ifdef STEPMESH_HAVE_ZMQ
      zmq_ctx_ = zmq_ctx_new();
      void* router = zmq_socket(zmq_ctx_, ZMQ_ROUTER);
      const int linger = 0, buffer = kZmqSocketBuffer;
      zmq_setsockopt(router, ZMQ_LINGER, &linger, sizeof(linger));
      zmq_setsockopt(router, ZMQ_SNDBUF, &buffer, sizeof(buffer));
      zmq_setsockopt(router, ZMQ_RCVBUF, &buffer, sizeof(buffer));
      const std::string endpoint = absl::StrCat("tcp://", host, ":", zmq_port);
      if (zmq_bind(router, endpoint.c_str()) != 0) {
        const std::string why = zmq_strerror(zmq_errno());
        zmq_close(router);
        return absl::UnavailableError(absl::StrCat("zmq bind ", endpoint, ": ", why));
      }
      zmq_thread_ = std::thread([this, router] { ZmqLoop(router); });
#endif
    }
    return absl::OkStatus();
  }

 private:
  void AcceptLoop() {
    while (!stop_) {
      sockaddr_storage addr{};
      socklen_t len = sizeof(addr);
      const int fd =
          ::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR) continue;
        return;  // shut down (or the listener failed): no more clients
      }
      absl::MutexLock lock(&mu_);
      conn_fds_.push_back(fd);
      conns_.emplace_back([this, fd] { Serve(base::UniqueFd(fd)); });
    }
  }

  // One client connection, its own thread (so the connections of different
  // workers are served at once): read a header and the push in the client's
  // discipline, wait for the batch, write the pull back.
  void Serve(base::UniqueFd fd) {
    // A long timeout: a client idles here while the other methods run.
    if (!ConfigureRaw(fd.get(), sockbuf_, absl::Seconds(600)).ok()) return;
    std::vector<char> in, out;
    LowWater lw(fd.get());
    bool spinning = false;  // the previous request asked for the spin discipline
    for (;;) {
      SizeHeader h;
      const absl::Status got =
          spinning ? SpinReadAll(lw, &h, sizeof(h), kHeaderSpin, absl::InfiniteFuture())
                   : ReadAll(lw, &h, sizeof(h), absl::InfiniteFuture());
      if (!got.ok()) break;
      if (h.push_bytes > kMaxBaselineBytes || h.pull_bytes > kMaxBaselineBytes) break;
      spinning = h.mode == static_cast<uint64_t>(RawMode::kSpin) ||
                 h.mode == static_cast<uint64_t>(RawMode::kTwoThreads);
      lw.Enable(h.low_water != 0);
      if (in.size() < h.push_bytes) in.resize(h.push_bytes);
      if (out.size() < h.pull_bytes) out.resize(h.pull_bytes, 1);
      const absl::Status push =
          spinning ? SpinReadAll(lw, in.data(), h.push_bytes, absl::InfiniteDuration(),
                                 absl::Now() + absl::Seconds(60))
                   : ReadAll(lw, in.data(), h.push_bytes, absl::Now() + absl::Seconds(60));
      if (!push.ok()) break;
      if (!batch_.Arrive(h.batch, absl::Seconds(60), spinning)) break;
      iovec iov{out.data(), h.pull_bytes};
      if (h.pull_bytes > 0 && !WriteAll(fd.get(), &iov, 1).ok()) break;
    }
    absl::MutexLock lock(&mu_);
    conn_fds_.erase(std::find(conn_fds_.begin(), conn_fds_.end(), fd.get()));
  }

#ifdef STEPMESH_HAVE_ZMQ
  // ROUTER: requests of every worker arrive here as [identity, header, push];
  // once `batch` of them are in, each gets [identity, reply] (the batch barrier).
  void ZmqLoop(void* router) {
    std::vector<char> out;
    std::vector<std::string> waiting;  // identities of this round's requests
    uint64_t batch = 1, pull_bytes = 0;
    while (!stop_) {
      zmq_pollitem_t item{router, 0, ZMQ_POLLIN, 0};
      // A short poll timeout so the loop notices stop_ promptly.
      if (zmq_poll(&item, 1, 100) <= 0) continue;
      for (;;) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, router, ZMQ_DONTWAIT) < 0) {
          zmq_msg_close(&part);
          break;  // drained
        }
        std::string id(static_cast<const char*>(zmq_msg_data(&part)), zmq_msg_size(&part));
        // The rest of a multipart message is delivered atomically with its first part.
        SizeHeader h;
        bool more = zmq_msg_more(&part);
        if (more) {
          zmq_msg_recv(&part, router, 0);
          if (zmq_msg_size(&part) == sizeof(h)) std::memcpy(&h, zmq_msg_data(&part), sizeof(h));
          more = zmq_msg_more(&part);
        }
        // The push is consumed where it landed in ZeroMQ's message (no copy out).
        while (more && zmq_msg_recv(&part, router, 0) >= 0) more = zmq_msg_more(&part);
        zmq_msg_close(&part);
        batch = std::max<uint64_t>(1, h.batch);
        pull_bytes = std::min<uint64_t>(h.pull_bytes, kMaxBaselineBytes);
        waiting.push_back(std::move(id));
        if (waiting.size() < batch) continue;
        // Only grows, and only between rounds: every reply of the previous
        // round was received (its worker pushed again), so no zero-copy reply
        // still points into the old buffer.
        if (out.size() < pull_bytes) out.resize(pull_bytes, 1);
        for (const std::string& to : waiting) {
          zmq_send(router, to.data(), to.size(), ZMQ_SNDMORE);
          zmq_msg_t reply;
          zmq_msg_init_data(&reply, out.data(), pull_bytes, nullptr, nullptr);
          if (zmq_msg_send(&reply, router, 0) < 0) zmq_msg_close(&reply);
        }
        waiting.clear();
      }
    }
    zmq_close(router);
  }
  void* zmq_ctx_ = nullptr;
#endif

  int sockbuf_ = 0;
  CyclicBarrier batch_;
  std::atomic<bool> stop_{false};
  base::UniqueFd listener_;
  std::thread acceptor_;
  std::thread zmq_thread_;
  absl::Mutex mu_;
  std::vector<std::thread> conns_ ABSL_GUARDED_BY(mu_);
  std::vector<int> conn_fds_ ABSL_GUARDED_BY(mu_);
};

class RawTcpClient final : public BaselineClient {
 public:
  RawTcpClient(std::vector<base::UniqueFd> fds, int batch, const RawDiscipline& discipline,
               absl::Duration timeout)
      : fds_(std::move(fds)),
        batch_(batch),
        mode_(discipline.mode),
        low_water_(discipline.low_water),
        timeout_(timeout),
        state_(fds_.size()) {
    for (const base::UniqueFd& fd : fds_) {
      polls_.push_back({fd.get(), 0, 0});
      marks_.emplace_back(fd.get(), low_water_);
    }
  }

  absl::Status Exchange(const void* push, size_t push_bytes, absl::Span<void* const> pull,
                        size_t pull_bytes) override {
    const SizeHeader h{push_bytes, pull_bytes, static_cast<uint64_t>(batch_),
                       static_cast<uint64_t>(mode_), low_water_ ? 1u : 0u};
    if (mode_ == RawMode::kNaive) return ExchangeNaive(h, push, pull);
    return ExchangeOverlapped(h, push, pull);
  }

 private:
  struct Conn {
    size_t sent = 0;      // of header + push
    size_t received = 0;  // of the reply
  };

  // The old row: each server in turn, blocking, no low-water mark. Not a floor.
  absl::Status ExchangeNaive(const SizeHeader& h, const void* push, absl::Span<void* const> pull) {
    for (const base::UniqueFd& fd : fds_) {
      iovec iov[2] = {{const_cast<SizeHeader*>(&h), sizeof(h)},
                      {const_cast<void*>(push), h.push_bytes}};
      STEPMESH_RETURN_IF_ERROR(WriteAll(fd.get(), iov, h.push_bytes > 0 ? 2 : 1));
    }
    for (size_t s = 0; s < fds_.size(); ++s) {
      STEPMESH_RETURN_IF_ERROR(ReadAll(marks_[s], pull[s], h.pull_bytes, absl::InfiniteFuture()));
    }
    return absl::OkStatus();
  }

  // Non-blocking sendmsg of what is left of header + push; true if bytes went.
  absl::StatusOr<bool> SendSome(size_t s, const SizeHeader& h, const void* push) {
    Conn& c = state_[s];
    const size_t out_bytes = sizeof(h) + h.push_bytes;
    iovec iov[2];
    int n_iov = 0;
    if (c.sent < sizeof(h)) {
      iov[n_iov++] = {reinterpret_cast<char*>(const_cast<SizeHeader*>(&h)) + c.sent,
                      sizeof(h) - c.sent};
      if (h.push_bytes > 0) iov[n_iov++] = {const_cast<void*>(push), h.push_bytes};
    } else {
      iov[n_iov++] = {static_cast<char*>(const_cast<void*>(push)) + (c.sent - sizeof(h)),
                      out_bytes - c.sent};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n_iov;
    const ssize_t n = ::sendmsg(fds_[s].get(), &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      c.sent += static_cast<size_t>(n);
      return true;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return absl::UnavailableError(base::ErrnoMessage("raw-tcp sendmsg", errno));
    }
    return false;
  }

  // Non-blocking recv of what is queued of server s's reply; true if bytes came.
  absl::StatusOr<bool> ReceiveSome(size_t s, void* into, size_t pull_bytes) {
    Conn& c = state_[s];
    return ReceiveQueued(fds_[s].get(), static_cast<char*>(into) + c.received,
                         pull_bytes - c.received, &c.received);
  }

  // One loop over every connection, so server 1's push goes out while server
  // 0's reply comes in: sends wherever the socket takes bytes; receives where
  // poll() reports the connection readable, which with the low-water mark
  // means the rest of the reply or 256 KiB of it is queued (the library's
  // receive thread reads on the same readiness), or, without it, wherever a
  // non-blocking recv finds bytes. When nothing progresses: kSpin tries again
  // at once; kBlock sleeps in poll() until some connection is ready, and with
  // a single reply left, in ReadAll on that one.
  absl::Status ExchangeOverlapped(const SizeHeader& h, const void* push,
                                  absl::Span<void* const> pull) {
    const size_t out_bytes = sizeof(h) + h.push_bytes;
    for (Conn& c : state_) c = Conn{};
    size_t sending = fds_.size(), receiving = h.pull_bytes > 0 ? fds_.size() : 0;
    const absl::Time deadline = absl::Now() + timeout_;
    for (uint32_t idle = 0; sending + receiving > 0;) {
      bool progress = false;
      for (size_t s = 0; s < fds_.size(); ++s) {
        Conn& c = state_[s];
        if (c.sent < out_bytes) {
          STEPMESH_ASSIGN_OR_RETURN(const bool sent, SendSome(s, h, push));
          progress |= sent;
          if (c.sent == out_bytes) --sending;
        }
        const bool want_in = c.received < h.pull_bytes;
        if (want_in) marks_[s].Want(h.pull_bytes - c.received);
        polls_[s].events =
            static_cast<int16_t>((c.sent < out_bytes ? POLLOUT : 0) | (want_in ? POLLIN : 0));
        polls_[s].revents = 0;
      }
      // With the mark, read where poll() says the mark is reached; without
      // it (the plain rows), try every connection still receiving.
      if (receiving > 0 && (!low_water_ || ::poll(polls_.data(), polls_.size(), 0) > 0)) {
        for (size_t s = 0; s < fds_.size(); ++s) {
          if (low_water_ && !(polls_[s].revents & (POLLIN | POLLHUP | POLLERR))) continue;
          if (state_[s].received == h.pull_bytes) continue;
          STEPMESH_ASSIGN_OR_RETURN(const bool got, ReceiveSome(s, pull[s], h.pull_bytes));
          progress |= got;
          if (state_[s].received == h.pull_bytes) --receiving;
        }
      }
      if (progress) {
        idle = 0;
        continue;
      }
      if (mode_ == RawMode::kSpin) {
        if (++idle % 1024 == 0 && absl::Now() > deadline) {
          return absl::DeadlineExceededError("raw-tcp exchange timed out");
        }
        std::this_thread::yield();
        continue;
      }
      if (sending == 0 && receiving == 1) {
        for (size_t s = 0; s < fds_.size(); ++s) {
          Conn& c = state_[s];
          if (c.received == h.pull_bytes) continue;
          STEPMESH_RETURN_IF_ERROR(ReadAll(marks_[s], static_cast<char*>(pull[s]) + c.received,
                                           h.pull_bytes - c.received, deadline));
          c.received = h.pull_bytes;
          receiving = 0;
        }
        continue;
      }
      const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (left_ms <= 0) return absl::DeadlineExceededError("raw-tcp exchange timed out");
      if (::poll(polls_.data(), polls_.size(), static_cast<int>(left_ms)) < 0 && errno != EINTR) {
        return absl::UnavailableError(base::ErrnoMessage("raw-tcp poll", errno));
      }
    }
    return absl::OkStatus();
  }

  std::vector<base::UniqueFd> fds_;
  int batch_;
  RawMode mode_;
  bool low_water_;
  absl::Duration timeout_;
  std::vector<Conn> state_;      // per connection, reset each exchange
  std::vector<pollfd> polls_;    // per connection, prepared once
  std::vector<LowWater> marks_;  // per connection: its receive low-water mark
};

// kTwoThreads: the library's shape — a send thread writes the push to every
// server while the calling thread receives the replies, so the two copies run
// on two cores. The send thread spins for kSenderSpin after a push (as the
// library's adaptive send thread), then sleeps until the next one.
class RawTcpTwoThreadClient final : public BaselineClient {
 public:
  RawTcpTwoThreadClient(std::vector<base::UniqueFd> fds, int batch, absl::Duration timeout)
      : fds_(std::move(fds)), batch_(batch), timeout_(timeout), received_(fds_.size()) {
    for (const base::UniqueFd& fd : fds_) {
      polls_.push_back({fd.get(), POLLIN, 0});
      marks_.emplace_back(fd.get(), true);
    }
    sender_ = std::thread([this] { SendLoop(); });
  }
  ~RawTcpTwoThreadClient() override {
    stop_.store(true, std::memory_order_seq_cst);
    {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_one();
    }
    sender_.join();
  }

  absl::Status Exchange(const void* push, size_t push_bytes, absl::Span<void* const> pull,
                        size_t pull_bytes) override {
    header_ = SizeHeader{push_bytes, pull_bytes, static_cast<uint64_t>(batch_),
                         static_cast<uint64_t>(RawMode::kTwoThreads), 1};
    push_ = push;
    const uint64_t seq = posted_.load(std::memory_order_relaxed) + 1;
    posted_.store(seq, std::memory_order_seq_cst);  // publishes header_ and push_
    if (sleeping_.load(std::memory_order_seq_cst)) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_one();
    }
    const absl::Time deadline = absl::Now() + timeout_;
    std::fill(received_.begin(), received_.end(), 0);
    size_t receiving = pull_bytes > 0 ? fds_.size() : 0;
    for (uint32_t idle = 0; receiving > 0 || done_.load(std::memory_order_acquire) != seq;) {
      bool progress = false;
      if (receiving > 0) {
        for (size_t s = 0; s < fds_.size(); ++s) {
          marks_[s].Want(pull_bytes - received_[s]);
          polls_[s].events = received_[s] < pull_bytes ? POLLIN : 0;
          polls_[s].revents = 0;
        }
        if (::poll(polls_.data(), polls_.size(), 0) > 0) {
          for (size_t s = 0; s < fds_.size(); ++s) {
            if (!(polls_[s].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            if (received_[s] == pull_bytes) continue;
            STEPMESH_ASSIGN_OR_RETURN(
                const bool got,
                ReceiveQueued(fds_[s].get(), static_cast<char*>(pull[s]) + received_[s],
                              pull_bytes - received_[s], &received_[s]));
            progress |= got;
            if (received_[s] == pull_bytes) --receiving;
          }
        }
      }
      if (progress) {
        idle = 0;
        continue;
      }
      if (++idle % 1024 == 0 && absl::Now() > deadline) {
        return absl::DeadlineExceededError("raw-tcp exchange timed out");
      }
      std::this_thread::yield();
    }
    return send_status_;  // written by the send thread before done_
  }

 private:
  static constexpr absl::Duration kSenderSpin = absl::Milliseconds(1);

  void SendLoop() {
    uint64_t handled = 0;
    absl::Time last = absl::Now();
    while (!stop_.load(std::memory_order_acquire)) {
      if (posted_.load(std::memory_order_acquire) == handled) {
        if (absl::Now() - last < kSenderSpin) {
          std::this_thread::yield();
          continue;
        }
        // Announce, then re-check (Exchange stores posted_ before it reads
        // sleeping_): a push posted meanwhile is seen here or notified.
        sleeping_.store(true, std::memory_order_seq_cst);
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait_for(lock, std::chrono::milliseconds(50), [&] {
            return stop_.load(std::memory_order_seq_cst) ||
                   posted_.load(std::memory_order_seq_cst) != handled;
          });
        }
        sleeping_.store(false, std::memory_order_relaxed);
        continue;
      }
      handled = posted_.load(std::memory_order_acquire);
      absl::Status status;
      for (const base::UniqueFd& fd : fds_) {
        iovec iov[2] = {{&header_, sizeof(header_)},
                        {const_cast<void*>(push_), header_.push_bytes}};
        status = WriteAll(fd.get(), iov, header_.push_bytes > 0 ? 2 : 1);
        if (!status.ok()) break;
      }
      send_status_ = status;
      last = absl::Now();
      done_.store(handled, std::memory_order_release);
    }
  }

  std::vector<base::UniqueFd> fds_;
  int batch_;
  absl::Duration timeout_;
  std::vector<size_t> received_;  // per connection, this exchange
  std::vector<pollfd> polls_;
  std::vector<LowWater> marks_;
  // The job: written by Exchange before posted_, read by the send thread after.
  SizeHeader header_;
  const void* push_ = nullptr;
  absl::Status send_status_;  // written by the send thread before done_
  std::atomic<uint64_t> posted_{0};
  std::atomic<uint64_t> done_{0};
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread sender_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<BaselineServers>> BaselineServers::Start(const std::string& host,
                                                                        uint16_t raw_port,
                                                                        uint16_t zmq_port,
                                                                        int sockbuf) {
  auto servers = std::make_unique<BaselineServersImpl>();
  STEPMESH_RETURN_IF_ERROR(servers->Init(host, raw_port, ZmqAvailable() ? zmq_port : 0, sockbuf));
  return servers;
}

absl::StatusOr<std::unique_ptr<BaselineClient>> ConnectRawTcp(
    const std::vector<base::HostPort>& servers, int sockbuf, absl::Duration timeout, int batch,
    const RawDiscipline& discipline) {
  std::vector<base::UniqueFd> fds;
  for (const base::HostPort& hp : servers) {
    STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd fd, base::ConnectTcp(hp, absl::Now() + timeout));
    // Blocking sockets (ConnectTcp may hand back a non-blocking one): the
    // spinning paths pass MSG_DONTWAIT, the blocking ones rely on SO_RCVTIMEO.
    STEPMESH_RETURN_IF_ERROR(base::SetNonBlocking(fd.get(), false));
    STEPMESH_RETURN_IF_ERROR(ConfigureRaw(fd.get(), sockbuf, timeout));
    fds.push_back(std::move(fd));
  }
  if (discipline.mode == RawMode::kTwoThreads) {
    return std::make_unique<RawTcpTwoThreadClient>(std::move(fds), batch, timeout);
  }
  return std::make_unique<RawTcpClient>(std::move(fds), batch, discipline, timeout);
}

}  // namespace stepmesh::bench
