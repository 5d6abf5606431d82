// libFuzzer target: the TCP transport's receive path — frame reassembly from a
// byte stream read in whatever pieces the kernel hands over, payload
// placement, the checks on each header, and what it does with a peer that
// breaks the framing. A real transport (the acceptor) and a raw socket that
// completed the data handshake as worker 0; the input is what that socket
// sends after the handshake.
//
// Input: byte 0 = k (mod 33) split points, then k little-endian u16 offsets,
// then the stream. The stream is sent twice, to two fresh transports: once in
// one piece and once cut at the split points, the transport polled between
// pieces. Both must report the same frames (type, key, size, status, payload
// bytes) and the same end of the connection: reassembly must not depend on
// where the stream was split. (tests/fuzz/capture_seeds.py seeds it with real
// streams and the split points their sender used.)

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/net.h"
#include "src/core/handshake.h"
#include "src/core/protocol.h"
#include "src/core/transport.h"
#include "src/transport/tcp_fallback/tcp_transport.h"

namespace {

using stepmesh::core::Destination;
using stepmesh::core::FrameContext;
using stepmesh::core::FrameHeader;
using stepmesh::core::NodeId;

constexpr size_t kSlotBytes = 64 * 1024;

// Records what the transport reports, in order.
class RecordingSink final : public stepmesh::core::TransportSink {
 public:
  absl::Status Resolve(NodeId peer, const FrameHeader& header, Destination& out,
                       FrameContext* context) override {
    // A small key space stands in for registered regions: key % 4 == 3 has
    // none (the core would refuse it).
    if (header.key % 4 == 3) return absl::NotFoundError("no region for that key");
    std::fill(slot_.begin(), slot_.end(), std::byte{0});
    out.data = slot_.data();
    out.capacity = slot_.size();
    out.region = 1;
    *context = nullptr;
    return absl::OkStatus();
  }
  void OnFrame(NodeId peer, const FrameHeader& header, FrameContext context,
               absl::Status status) override {
    uint64_t hash = 1469598103934665603ull;  // FNV-1a of the payload as placed
    if (status.ok() && header.payload_bytes <= slot_.size()) {
      for (size_t i = 0; i < header.payload_bytes; ++i) {
        hash = (hash ^ static_cast<uint8_t>(slot_[i])) * 1099511628211ull;
      }
    }
    if (header.payload_bytes > slot_.size() && status.ok()) std::abort();  // overflowed the slot
    log_.push_back(absl::StrCat("frame type ", static_cast<int>(header.type), " key ", header.key,
                                " bytes ", header.payload_bytes, " ", status.code(), " ", hash));
  }
  void OnPeerLost(NodeId peer, absl::Status why) override {
    log_.push_back(absl::StrCat("lost ", why.code()));
    lost_ = true;
  }
  bool lost() const { return lost_; }
  const std::vector<std::string>& log() const { return log_; }

 private:
  std::vector<std::byte> slot_ = std::vector<std::byte>(kSlotBytes);
  std::vector<std::string> log_;
  bool lost_ = false;
};

// Feeds `stream` in pieces ending at `cuts` to a fresh transport; returns what
// it reported, or nothing when the set-up itself failed (not the code under test).
std::vector<std::string> Run(const std::vector<uint8_t>& stream, const std::vector<size_t>& cuts,
                             bool* ok) {
  *ok = false;
  stepmesh::MeshOptions options;
  options.transport = "tcp";
  options.bind_host = "127.0.0.1";
  auto transport = stepmesh::tcp::CreateTcpTransport(options);
  if (!transport.ok()) return {};
  auto endpoint = (*transport)->LocalEndpoint();
  if (!endpoint.ok()) return {};
  const NodeId self = stepmesh::core::ServerId(0), peer = stepmesh::core::WorkerId(0);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::Status accepted;
  std::thread acceptor([&] {
    const stepmesh::core::PeerInfo peers[] = {{peer, ""}};
    accepted = (*transport)->Connect(self, peers, deadline);
  });
  auto hp = stepmesh::base::ParseHostPort(*endpoint);
  absl::StatusOr<stepmesh::base::UniqueFd> fd =
      hp.ok() ? stepmesh::base::ConnectTcp(*hp, deadline)
              : absl::StatusOr<stepmesh::base::UniqueFd>(hp.status());
  absl::Status dialled = fd.ok() ? stepmesh::base::SetNonBlocking(fd->get(), false) : fd.status();
  if (dialled.ok()) {
    dialled = stepmesh::core::DialHandshake(fd->get(), peer, self, "", deadline);
  }
  acceptor.join();
  if (!accepted.ok() || !dialled.ok()) {
    (*transport)->Shutdown();
    return {};
  }
  RecordingSink sink;
  size_t sent = 0;
  bool writable = true;
  for (size_t i = 0; i <= cuts.size(); ++i) {
    const size_t end = i < cuts.size() ? cuts[i] : stream.size();
    while (writable && sent < end) {
      const ssize_t n = ::send(fd->get(), stream.data() + sent, end - sent, MSG_NOSIGNAL);
      if (n <= 0) {
        writable = false;  // the transport closed it (a violation): the rest is moot
        break;
      }
      sent += static_cast<size_t>(n);
    }
    // Let the transport take this piece before the next one is sent.
    for (int p = 0; p < 3; ++p) (void)(*transport)->Poll(sink, absl::ZeroDuration());
  }
  ::shutdown(fd->get(), SHUT_WR);  // end of the stream: the transport must notice
  const absl::Time drain_by = absl::Now() + absl::Seconds(5);
  while (!sink.lost() && absl::Now() < drain_by) {
    (void)(*transport)->Poll(sink, absl::Milliseconds(10));
  }
  (*transport)->Shutdown();
  *ok = true;
  return sink.log();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t k = data[0] % 33;
  if (size < 1 + 2 * k) return 0;
  std::vector<uint8_t> stream(data + 1 + 2 * k, data + size);
  std::vector<size_t> cuts;
  for (size_t i = 0; i < k; ++i) {
    const size_t at = data[1 + 2 * i] | (size_t{data[2 + 2 * i]} << 8);
    if (at > 0 && at < stream.size()) cuts.push_back(at);
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  bool whole_ok = false, cut_ok = false;
  const std::vector<std::string> whole = Run(stream, {}, &whole_ok);
  const std::vector<std::string> pieces = Run(stream, cuts, &cut_ok);
  if (!whole_ok || !cut_ok) return 0;
  if (whole != pieces) {
    std::fprintf(stderr, "fuzz_tcp_stream: reassembly depends on the split points\n");
    for (const std::string& s : whole) std::fprintf(stderr, "  whole:  %s\n", s.c_str());
    for (const std::string& s : pieces) std::fprintf(stderr, "  pieces: %s\n", s.c_str());
    std::abort();
  }
  if (whole.empty() || whole.back().rfind("lost ", 0) != 0) {
    std::fprintf(stderr, "fuzz_tcp_stream: the end of the stream was not reported\n");
    std::abort();
  }
  return 0;
}
