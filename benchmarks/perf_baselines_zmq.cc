// The ZeroMQ baseline's client (benchmarks/perf_baselines.h): one DEALER
// socket per server, polled together. Its echo side, the ROUTER, runs in
// BaselineServers (perf_baselines.cc).
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "benchmarks/perf_baselines.h"
#include "benchmarks/perf_baselines_io.h"
#include "stepmesh/status.h"

#ifdef STEPMESH_HAVE_ZMQ
#include <zmq.h>
#endif

namespace stepmesh::bench {
namespace {

#ifdef STEPMESH_HAVE_ZMQ
using baseline_io::SizeHeader;

class ZmqClient final : public BaselineClient {
 public:
  ~ZmqClient() override {
    for (void* s : sockets_) zmq_close(s);
    if (ctx_ != nullptr) zmq_ctx_term(ctx_);
  }

  absl::Status Init(const std::vector<base::HostPort>& servers, absl::Duration timeout, int batch) {
    batch_ = batch;
    timeout_ = timeout;
    ctx_ = zmq_ctx_new();
    const int linger = 0, buffer = kZmqSocketBuffer;
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(timeout));
    for (const base::HostPort& hp : servers) {
      void* dealer = zmq_socket(ctx_, ZMQ_DEALER);
      zmq_setsockopt(dealer, ZMQ_LINGER, &linger, sizeof(linger));
      zmq_setsockopt(dealer, ZMQ_SNDTIMEO, &ms, sizeof(ms));
      zmq_setsockopt(dealer, ZMQ_SNDBUF, &buffer, sizeof(buffer));
      zmq_setsockopt(dealer, ZMQ_RCVBUF, &buffer, sizeof(buffer));
      sockets_.push_back(dealer);
      items_.push_back({dealer, 0, ZMQ_POLLIN, 0});
      const std::string endpoint = absl::StrCat("tcp://", hp.host, ":", hp.port);
      if (zmq_connect(dealer, endpoint.c_str()) != 0) {
        return absl::UnavailableError(
            absl::StrCat("zmq connect ", endpoint, ": ", zmq_strerror(zmq_errno())));
      }
    }
    done_.resize(sockets_.size());
    return absl::OkStatus();
  }

  absl::Status Exchange(const void* push, size_t push_bytes, absl::Span<void* const> pull,
                        size_t pull_bytes) override {
    const SizeHeader h{push_bytes, pull_bytes, static_cast<uint64_t>(batch_), 0};
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
    // Every server's reply, whichever lands first; each stays in ZeroMQ's
    // message (zero-copy receive), checked and released.
    std::fill(done_.begin(), done_.end(), false);
    size_t left = sockets_.size();
    const absl::Time deadline = absl::Now() + timeout_;
    while (left > 0) {
      const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (ms <= 0) return absl::DeadlineExceededError("zmq exchange timed out");
      for (size_t i = 0; i < items_.size(); ++i) {
        items_[i].events = done_[i] ? 0 : ZMQ_POLLIN;
        items_[i].revents = 0;
      }
      if (zmq_poll(items_.data(), static_cast<int>(items_.size()), ms) < 0) {
        if (zmq_errno() == EINTR) continue;
        return Error("zmq_poll");
      }
      for (size_t i = 0; i < items_.size(); ++i) {
        if (done_[i] || !(items_[i].revents & ZMQ_POLLIN)) continue;
        zmq_msg_t reply;
        zmq_msg_init(&reply);
        if (zmq_msg_recv(&reply, sockets_[i], ZMQ_DONTWAIT) < 0) {
          zmq_msg_close(&reply);
          if (zmq_errno() == EAGAIN) continue;
          return Error("zmq_msg_recv");
        }
        const size_t n = zmq_msg_size(&reply);
        const bool marked = n == 0 || *static_cast<const uint8_t*>(zmq_msg_data(&reply)) == 1;
        zmq_msg_close(&reply);
        if (n != pull_bytes || !marked) {
          return absl::DataLossError(absl::StrCat("zmq reply of ", n, " bytes from server ", i,
                                                  ", expected ", pull_bytes));
        }
        done_[i] = true;
        --left;
      }
    }
    return absl::OkStatus();
  }

 private:
  static absl::Status Error(absl::string_view what) {
    return absl::UnavailableError(absl::StrCat(what, ": ", zmq_strerror(zmq_errno())));
  }
  void* ctx_ = nullptr;
  int batch_ = 1;
  absl::Duration timeout_;
  std::vector<void*> sockets_;
  std::vector<zmq_pollitem_t> items_;
  std::vector<bool> done_;
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

absl::StatusOr<std::unique_ptr<BaselineClient>> ConnectZmq(
    const std::vector<base::HostPort>& servers, absl::Duration timeout, int batch) {
#ifdef STEPMESH_HAVE_ZMQ
  auto client = std::make_unique<ZmqClient>();
  STEPMESH_RETURN_IF_ERROR(client->Init(servers, timeout, batch));
  return client;
#else
  return absl::UnimplementedError("built without libzmq");
#endif
}

}  // namespace stepmesh::bench
