#include "benchmarks/perf_baselines.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "stepmesh/status.h"

#ifdef STEPMESH_HAVE_ZMQ
#include <zmq.h>
#endif

namespace stepmesh::bench {
namespace {

// Size header of both baselines: push bytes, then pull bytes (host order:
// both ends are this program on the same architecture).
struct SizeHeader {
  uint64_t push_bytes = 0;
  uint64_t pull_bytes = 0;
  uint64_t batch = 1;  // clients the server hears from before it answers any (an AF batch)
};

// The AF batch barrier for the raw floor: an FFN server computes on every
// worker's push together, so it answers none before all of them arrived.
class CyclicBarrier {
 public:
  // False on timeout (a client vanished): the caller drops its connection.
  bool Arrive(uint64_t parties, absl::Duration timeout) {
    if (parties <= 1) return true;
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t generation = generation_;
    if (++arrived_ >= parties) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return true;
    }
    return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                        [&] { return generation_ != generation; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t arrived_ = 0;
  uint64_t generation_ = 0;
};
constexpr size_t kMaxBaselineBytes = size_t{1} << 30;  // refuse absurd sizes from a stray peer

// Blocking sockets with kernel timeouts: a stuck peer fails the call instead
// of hanging the benchmark.
absl::Status SetTimeouts(int fd, absl::Duration timeout) {
  timeval tv = absl::ToTimeval(timeout);
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    return absl::InternalError(base::ErrnoMessage("setsockopt timeouts", errno));
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, iovec* iov, int iovcnt) {
  while (iovcnt > 0) {
    const ssize_t n = ::writev(fd, iov, iovcnt);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(base::ErrnoMessage("raw-tcp writev", errno));
    }
    size_t left = static_cast<size_t>(n);
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, void* data, size_t bytes) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n == 0) return absl::UnavailableError("raw-tcp peer closed");
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(base::ErrnoMessage("raw-tcp recv", errno));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status ConfigureRaw(int fd, int sockbuf, absl::Duration timeout) {
  STEPMESH_RETURN_IF_ERROR(base::SetNoDelay(fd));
  if (sockbuf > 0) STEPMESH_RETURN_IF_ERROR(base::SetBufferSizes(fd, sockbuf));
  return SetTimeouts(fd, timeout);
}

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
      void* rep = zmq_socket(zmq_ctx_, ZMQ_REP);
      const int linger = 0, rcvtimeo = 100;
      zmq_setsockopt(rep, ZMQ_LINGER, &linger, sizeof(linger));
      // Short receive timeout so the loop notices stop_ promptly.
      zmq_setsockopt(rep, ZMQ_RCVTIMEO, &rcvtimeo, sizeof(rcvtimeo));
      const std::string endpoint = absl::StrCat("tcp://", host, ":", zmq_port);
      if (zmq_bind(rep, endpoint.c_str()) != 0) {
        const std::string why = zmq_strerror(zmq_errno());
        zmq_close(rep);
        return absl::UnavailableError(absl::StrCat("zmq bind ", endpoint, ": ", why));
      }
      zmq_thread_ = std::thread([this, rep] { ZmqLoop(rep); });
#endif
    }
    return absl::OkStatus();
  }

 private:
  void AcceptLoop() {
    while (!stop_) {
      sockaddr_storage addr{};
      socklen_t len = sizeof(addr);
      const int fd = ::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&addr), &len,
                               SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR) continue;
        return;  // shut down (or the listener failed): no more clients
      }
      absl::MutexLock lock(&mu_);
      conn_fds_.push_back(fd);
      conns_.emplace_back([this, fd] { Serve(base::UniqueFd(fd)); });
    }
  }

  // One client, blocking: read a header and the push, write the pull back.
  void Serve(base::UniqueFd fd) {
    // A long timeout: a client idles here while the other methods run.
    if (!ConfigureRaw(fd.get(), sockbuf_, absl::Seconds(600)).ok()) return;
    std::vector<char> in, out;
    for (;;) {
      SizeHeader h;
      if (!ReadAll(fd.get(), &h, sizeof(h)).ok()) break;
      if (h.push_bytes > kMaxBaselineBytes || h.pull_bytes > kMaxBaselineBytes) break;
      if (in.size() < h.push_bytes) in.resize(h.push_bytes);
      if (out.size() < h.pull_bytes) out.resize(h.pull_bytes, 1);
      if (!ReadAll(fd.get(), in.data(), h.push_bytes).ok()) break;
      if (!batch_.Arrive(h.batch, absl::Seconds(60))) break;
      iovec iov{out.data(), h.pull_bytes};
      if (h.pull_bytes > 0 && !WriteAll(fd.get(), &iov, 1).ok()) break;
    }
    absl::MutexLock lock(&mu_);
    conn_fds_.erase(std::find(conn_fds_.begin(), conn_fds_.end(), fd.get()));
  }

#ifdef STEPMESH_HAVE_ZMQ
  void ZmqLoop(void* rep) {
    std::vector<char> out;
    while (!stop_) {
      zmq_msg_t header, payload;
      zmq_msg_init(&header);
      if (zmq_msg_recv(&header, rep, 0) < 0) {
        zmq_msg_close(&header);
        continue;  // timeout (check stop_) or interrupted
      }
      SizeHeader h;
      if (zmq_msg_size(&header) == sizeof(h)) std::memcpy(&h, zmq_msg_data(&header), sizeof(h));
      zmq_msg_close(&header);
      // The push is consumed where it landed in ZeroMQ's message (no copy out).
      zmq_msg_init(&payload);
      while (zmq_msg_recv(&payload, rep, 0) < 0 && zmq_errno() == EAGAIN && !stop_) {
      }
      zmq_msg_close(&payload);
      if (h.pull_bytes > kMaxBaselineBytes) h.pull_bytes = 0;
      if (out.size() < h.pull_bytes) out.resize(h.pull_bytes, 1);
      // Zero-copy reply: the buffer outlives the send since it is only resized
      // to grow before the next request, after this reply left.
      zmq_msg_t reply;
      zmq_msg_init_data(&reply, out.data(), h.pull_bytes, nullptr, nullptr);
      zmq_msg_send(&reply, rep, 0);
    }
    zmq_close(rep);
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
  RawTcpClient(std::vector<base::UniqueFd> fds, int batch) : fds_(std::move(fds)), batch_(batch) {}

  absl::Status Exchange(const void* push, size_t push_bytes, absl::Span<void* const> pull,
                        size_t pull_bytes) override {
    const SizeHeader h{push_bytes, pull_bytes, static_cast<uint64_t>(batch_)};
    // Header and payload in one writev, as the TCP transport sends frame + payload.
    for (const base::UniqueFd& fd : fds_) {
      iovec iov[2] = {{const_cast<SizeHeader*>(&h), sizeof(h)},
                      {const_cast<void*>(push), push_bytes}};
      STEPMESH_RETURN_IF_ERROR(WriteAll(fd.get(), iov, push_bytes > 0 ? 2 : 1));
    }
    for (size_t s = 0; s < fds_.size(); ++s) {
      STEPMESH_RETURN_IF_ERROR(ReadAll(fds_[s].get(), pull[s], pull_bytes));
    }
    return absl::OkStatus();
  }

 private:
  std::vector<base::UniqueFd> fds_;
  int batch_;
};

#ifdef STEPMESH_HAVE_ZMQ
class ZmqClient final : public BaselineClient {
 public:
  ~ZmqClient() override {
    for (void* s : sockets_) zmq_close(s);
    if (ctx_ != nullptr) zmq_ctx_term(ctx_);
  }

  absl::Status Init(const std::vector<base::HostPort>& servers, absl::Duration timeout) {
    ctx_ = zmq_ctx_new();
    const int linger = 0;
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(timeout));
    for (const base::HostPort& hp : servers) {
      void* req = zmq_socket(ctx_, ZMQ_REQ);
      zmq_setsockopt(req, ZMQ_LINGER, &linger, sizeof(linger));
      zmq_setsockopt(req, ZMQ_RCVTIMEO, &ms, sizeof(ms));
      zmq_setsockopt(req, ZMQ_SNDTIMEO, &ms, sizeof(ms));
      sockets_.push_back(req);
      const std::string endpoint = absl::StrCat("tcp://", hp.host, ":", hp.port);
      if (zmq_connect(req, endpoint.c_str()) != 0) {
        return absl::UnavailableError(
            absl::StrCat("zmq connect ", endpoint, ": ", zmq_strerror(zmq_errno())));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Exchange(const void* push, size_t push_bytes, absl::Span<void* const> pull,
                        size_t pull_bytes) override {
    const SizeHeader h{push_bytes, pull_bytes};
    for (void* s : sockets_) {
      if (zmq_send(s, &h, sizeof(h), ZMQ_SNDMORE) < 0) return Error("zmq_send header");
      // Zero-copy, as StepMesh's ZMQ van sends tensors (zmq_msg_init_data).
      zmq_msg_t msg;
      zmq_msg_init_data(&msg, const_cast<void*>(push), push_bytes, nullptr, nullptr);
      if (zmq_msg_send(&msg, s, 0) < 0) {
        zmq_msg_close(&msg);
        return Error("zmq_msg_send");
      }
    }
    for (size_t i = 0; i < sockets_.size(); ++i) {
      const int n = zmq_recv(sockets_[i], pull[i], pull_bytes, 0);
      if (n < 0) return Error("zmq_recv");
      if (static_cast<size_t>(n) != pull_bytes) {
        return absl::DataLossError(absl::StrCat("zmq reply of ", n, " bytes, expected ", pull_bytes));
      }
    }
    return absl::OkStatus();
  }

 private:
  static absl::Status Error(absl::string_view what) {
    return absl::UnavailableError(absl::StrCat(what, ": ", zmq_strerror(zmq_errno())));
  }
  void* ctx_ = nullptr;
  std::vector<void*> sockets_;
};
#endif

}  // namespace

bool ZmqAvailable() {
#ifdef STEPMESH_HAVE_ZMQ
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<BaselineServers>> BaselineServers::Start(const std::string& host,
                                                                        uint16_t raw_port,
                                                                        uint16_t zmq_port,
                                                                        int sockbuf) {
  auto servers = std::make_unique<BaselineServersImpl>();
  STEPMESH_RETURN_IF_ERROR(servers->Init(host, raw_port, ZmqAvailable() ? zmq_port : 0, sockbuf));
  return servers;
}

absl::StatusOr<std::unique_ptr<BaselineClient>> ConnectRawTcp(
    const std::vector<base::HostPort>& servers, int sockbuf, absl::Duration timeout, int batch) {
  std::vector<base::UniqueFd> fds;
  for (const base::HostPort& hp : servers) {
    STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd fd, base::ConnectTcp(hp, absl::Now() + timeout));
    // ConnectTcp may hand back a non-blocking socket; the floor is blocking I/O.
    STEPMESH_RETURN_IF_ERROR(base::SetNonBlocking(fd.get(), false));
    STEPMESH_RETURN_IF_ERROR(ConfigureRaw(fd.get(), sockbuf, timeout));
    fds.push_back(std::move(fd));
  }
  return std::make_unique<RawTcpClient>(std::move(fds), batch);
}

absl::StatusOr<std::unique_ptr<BaselineClient>> ConnectZmq(
    const std::vector<base::HostPort>& servers, absl::Duration timeout) {
#ifdef STEPMESH_HAVE_ZMQ
  auto client = std::make_unique<ZmqClient>();
  STEPMESH_RETURN_IF_ERROR(client->Init(servers, timeout));
  return client;
#else
  return absl::UnimplementedError("built without libzmq");
#endif
}

}  // namespace stepmesh::bench
