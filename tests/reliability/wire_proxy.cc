#include "tests/reliability/wire_proxy.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/net.h"
#include "src/base/tsan.h"
#include "src/core/frame.h"
#include "src/core/handshake.h"
#include "stepmesh/status.h"
#include "tests/support/forwarding_transport.h"

namespace stepmesh::testing {
namespace {

constexpr size_t kReadChunk = 64 << 10;
constexpr size_t kMaxBuffered = 4 << 20;  // per direction, before reading pauses

// One direction of a proxied connection, followed frame by frame.
struct Stream {
  explicit Stream(bool dialler) : from_dialler(dialler) {
    handshake_left = dialler ? core::kHelloBytes : 0;
  }

  const bool from_dialler;
  size_t handshake_left;
  bool awaiting_hello = true;  // the dialler's hello decides both sides' handshake length
  std::vector<std::byte> hello;
  bool raw = false;  // a stream that stopped making sense is forwarded as it is
  std::array<std::byte, core::kFrameBytes> header{};
  size_t header_got = 0;
  uint64_t payload_left = 0;
  uint64_t payload_done = 0;
  std::optional<FaultAction> fault;                              // for the frame in flight
  uint64_t keep_payload = std::numeric_limits<uint64_t>::max();  // kTruncate
  bool cut = false;  // the link closes once `out` is written
  std::vector<std::byte> out;
  size_t out_pos = 0;

  size_t pending() const { return out.size() - out_pos; }
};

struct Link {
  base::UniqueFd down;  // the dialler's connection to the proxy
  base::UniqueFd up;    // the proxy's connection to the real listener
  Stream to_up{true};
  Stream to_down{false};
  // The proxy stands for the network between two transports: in TSan builds
  // it passes on what the sender released to the receiver (src/base/tsan.h),
  // as the kernel does between the two ends of one connection.
  base::SocketCausality down_causality;
  base::SocketCausality up_causality;
};

class WireProxy {
 public:
  WireProxy(base::UniqueFd listener, base::HostPort upstream, std::shared_ptr<FaultPlan> plan)
      : listener_(std::move(listener)), upstream_(std::move(upstream)), plan_(std::move(plan)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~WireProxy() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Run() {
    while (!stop_.load()) {
      const size_t polled = links_.size();
      std::vector<pollfd> fds{{listener_.get(), POLLIN, 0}};
      for (const auto& link : links_) {
        fds.push_back({link->down.get(), Events(link->to_up, link->to_down), 0});
        fds.push_back({link->up.get(), Events(link->to_down, link->to_up), 0});
      }
      if (::poll(fds.data(), fds.size(), 20) < 0 && errno != EINTR) break;
      std::vector<std::unique_ptr<Link>> live;
      for (size_t i = 0; i < polled; ++i) {
        Link& link = *links_[i];
        bool open = true;
        const short down = fds[1 + 2 * i].revents;
        const short up = fds[2 + 2 * i].revents;
        if (down & (POLLIN | POLLHUP | POLLERR))
          open = Pump(link.down.get(), link.down_causality, link.to_up, link.to_down);
        if (open && (up & (POLLIN | POLLHUP | POLLERR))) {
          open = Pump(link.up.get(), link.up_causality, link.to_down, link.to_up);
        }
        if (open && (down & POLLOUT)) {
          open = Flush(link.down.get(), link.down_causality, link.to_down);
        }
        if (open && (up & POLLOUT)) open = Flush(link.up.get(), link.up_causality, link.to_up);
        if (open && ((link.to_up.cut && link.to_up.pending() == 0) ||
                     (link.to_down.cut && link.to_down.pending() == 0))) {
          open = false;  // a truncated frame: the sender "died" mid-frame
        }
        if (open) {
          live.push_back(std::move(links_[i]));
        } else {
          Close(link);
        }
      }
      links_ = std::move(live);
      if (fds[0].revents & POLLIN) Accept();
    }
    for (const auto& link : links_) Close(*link);
  }

  // Reads while the written side keeps up; writes what is pending.
  static short Events(const Stream& reading, const Stream& writing) {
    short events = 0;
    if (!reading.cut && reading.pending() < kMaxBuffered) events |= POLLIN;
    if (writing.pending() > 0) events |= POLLOUT;
    return events;
  }

  void Accept() {
    const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    auto link = std::make_unique<Link>();
    link->down.Reset(fd);
    absl::StatusOr<base::UniqueFd> up = base::ConnectTcp(upstream_, absl::Now() + absl::Seconds(2));
    if (!up.ok()) return;  // the dialler sees its connection close
    link->up = *std::move(up);
    if (!base::SetNonBlocking(link->down.get(), true).ok() ||
        !base::SetNonBlocking(link->up.get(), true).ok()) {
      return;
    }
    link->down_causality = base::SocketCausality::ForSocket(link->down.get());
    link->up_causality = base::SocketCausality::ForSocket(link->up.get());
    links_.push_back(std::move(link));
  }

  // Reads what `fd` has into `stream`; false when the link is done.
  bool Pump(int fd, const base::SocketCausality& causality, Stream& stream, Stream& other) {
    std::byte chunk[kReadChunk];
    const ssize_t n = ::recv(fd, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n >= 0) causality.Acquire();
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    if (n == 0) return false;
    Feed(stream, other, chunk, static_cast<size_t>(n));
    return true;
  }

  // Writes what is pending on `stream` to `fd`; false when the link is done.
  static bool Flush(int fd, const base::SocketCausality& causality, Stream& stream) {
    while (stream.pending() > 0) {
      causality.Release();
      const ssize_t n = ::send(fd, stream.out.data() + stream.out_pos, stream.pending(),
                               MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
      stream.out_pos += static_cast<size_t>(n);
    }
    stream.out.clear();
    stream.out_pos = 0;
    return true;
  }

  // What a peer that is going away leaves behind is delivered, briefly, then
  // both ends see the connection close.
  static void Close(Link& link) {
    const absl::Time until = absl::Now() + absl::Milliseconds(200);
    for (auto [fd, causality, stream] :
         {std::tuple{link.down.get(), &link.down_causality, &link.to_down},
          std::tuple{link.up.get(), &link.up_causality, &link.to_up}}) {
      while (stream->pending() > 0 && Flush(fd, *causality, *stream) && absl::Now() < until) {
        pollfd p{fd, POLLOUT, 0};
        ::poll(&p, 1, 10);
      }
    }
    ::shutdown(link.down.get(), SHUT_RDWR);
    ::shutdown(link.up.get(), SHUT_RDWR);
  }

  void Append(Stream& s, const std::byte* data, size_t n) {
    s.out.insert(s.out.end(), data, data + n);
  }

  // Follows `stream` through the handshake and then frame by frame,
  // damaging the frames the plan's byte-level rules select.
  void Feed(Stream& s, Stream& other, const std::byte* data, size_t n) {
    while (n > 0 && !s.cut) {
      if (s.raw) {
        Append(s, data, n);
        return;
      }
      if (s.handshake_left > 0) {
        const size_t take = std::min(n, s.handshake_left);
        if (s.from_dialler && s.awaiting_hello) s.hello.insert(s.hello.end(), data, data + take);
        Append(s, data, take);
        s.handshake_left -= take;
        data += take;
        n -= take;
        if (s.handshake_left == 0 && s.from_dialler && s.awaiting_hello) {
          const bool auth = core::HelloAsksAuth(s.hello.data());
          s.awaiting_hello = false;
          s.handshake_left = core::HandshakeBytesAfterHello(true, auth);
          other.awaiting_hello = false;
          other.handshake_left = core::HandshakeBytesAfterHello(false, auth);
        }
        continue;
      }
      if (!s.from_dialler && s.awaiting_hello) {  // bytes before any hello: not ours to follow
        s.raw = true;
        continue;
      }
      if (s.header_got < core::kFrameBytes) {
        const size_t take = std::min(n, core::kFrameBytes - s.header_got);
        std::memcpy(s.header.data() + s.header_got, data, take);
        s.header_got += take;
        data += take;
        n -= take;
        if (s.header_got == core::kFrameBytes) StartFrame(s);
        continue;
      }
      uint64_t take = std::min<uint64_t>(n, s.payload_left);
      if (s.fault == FaultAction::kTruncate) {
        take = std::min<uint64_t>(take, s.keep_payload - s.payload_done);
      }
      const size_t at = s.out.size();
      Append(s, data, static_cast<size_t>(take));
      if (s.fault == FaultAction::kCorruptPayload && s.payload_done == 0 && take > 0) {
        s.out[at] ^= std::byte{0x5A};
      }
      s.payload_done += take;
      s.payload_left -= take;
      data += take;
      n -= static_cast<size_t>(take);
      if (s.fault == FaultAction::kTruncate && s.payload_done == s.keep_payload) {
        s.cut = true;
      } else if (s.payload_left == 0) {
        s.header_got = 0;
      }
    }
  }

  void StartFrame(Stream& s) {
    absl::StatusOr<core::FrameHeader> h = core::DecodeFrame(s.header);
    s.fault.reset();
    s.keep_payload = std::numeric_limits<uint64_t>::max();
    if (!h.ok()) {
      Append(s, s.header.data(), s.header.size());
      s.raw = true;
      return;
    }
    if (std::optional<FaultRule> rule = plan_->Match(*h, /*wire=*/true)) s.fault = rule->action;
    if (s.fault == FaultAction::kCorruptHeader) {
      s.header[20] ^= std::byte{0x01};  // inside `key`: only the CRC can tell
    }
    if (s.fault == FaultAction::kTruncate) s.keep_payload = h->payload_bytes / 2;
    Append(s, s.header.data(), s.header.size());
    s.payload_left = h->payload_bytes;
    s.payload_done = 0;
    if (s.fault == FaultAction::kTruncate && s.keep_payload == 0) {
      s.cut = true;
    } else if (s.payload_left == 0) {
      s.header_got = 0;
    }
  }

  base::UniqueFd listener_;
  const base::HostPort upstream_;
  const std::shared_ptr<FaultPlan> plan_;
  std::vector<std::unique_ptr<Link>> links_;  // proxy thread only
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The transport with its listener behind a WireProxy.
class WireProxyTransport final : public ForwardingTransport {
 public:
  WireProxyTransport(std::unique_ptr<core::Transport> inner, std::shared_ptr<FaultPlan> plan)
      : ForwardingTransport(std::move(inner)), plan_(std::move(plan)) {}

  absl::StatusOr<std::string> LocalEndpoint() override {
    if (endpoint_.empty()) {
      STEPMESH_ASSIGN_OR_RETURN(std::string inner, ForwardingTransport::LocalEndpoint());
      STEPMESH_ASSIGN_OR_RETURN(base::HostPort upstream, base::ParseHostPort(inner));
      STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd listener, base::ListenTcp(upstream.host, 0));
      STEPMESH_ASSIGN_OR_RETURN(uint16_t port, base::LocalPort(listener.get()));
      endpoint_ = absl::StrCat(upstream.host, ":", port);
      proxy_ = std::make_unique<WireProxy>(std::move(listener), std::move(upstream), plan_);
    }
    return endpoint_;
  }

  void Shutdown() override {
    ForwardingTransport::Shutdown();
    proxy_.reset();
  }

 private:
  const std::shared_ptr<FaultPlan> plan_;
  std::string endpoint_;
  std::unique_ptr<WireProxy> proxy_;
};

}  // namespace

std::unique_ptr<core::Transport> WrapWithWireProxy(std::unique_ptr<core::Transport> inner,
                                                   std::shared_ptr<FaultPlan> plan) {
  return std::make_unique<WireProxyTransport>(std::move(inner), std::move(plan));
}

}  // namespace stepmesh::testing
