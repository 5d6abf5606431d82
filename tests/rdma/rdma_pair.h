#pragma once
// Two RDMA transports (a worker and a server) on one fake fabric, each with a
// receive thread calling Poll; the test thread acts as the send thread.

#include <atomic>
#include <catch2/catch.hpp>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "src/base/sync.h"
#include "src/transport/rdma/rdma_transport.h"
#include "tests/rdma/fake_verbs.h"

namespace stepmesh::core {

using base::Mutex;
using base::MutexLock;
using rdma::CreateRdmaTransport;
using testing::FakeFabric;
using testing::FakeFabricOptions;
using testing::FakeNicSpec;

inline constexpr NodeId kWorker = WorkerId(0);
inline constexpr NodeId kServer = ServerId(0);
inline constexpr NodeId kOtherWorker = WorkerId(1);

struct Event {
  bool lost = false;
  NodeId peer = kNoNode;
  FrameHeader header;
  absl::Status status;
};

class RecordingSink final : public TransportSink {
 public:
  std::function<absl::StatusOr<Destination>(NodeId, const FrameHeader&)> resolve;

  absl::Status Resolve(NodeId peer, const FrameHeader& header, Destination& out,
                       FrameContext*) override {
    if (!resolve) return absl::NotFoundError("no destination in this test");
    absl::StatusOr<Destination> dest = resolve(peer, header);
    if (dest.ok()) out = *dest;
    return dest.status();
  }
  void OnFrame(NodeId peer, const FrameHeader& header, FrameContext, absl::Status status) override {
    MutexLock lock(&mu_);
    events_.push_back({false, peer, header, std::move(status)});
  }
  void OnPeerLost(NodeId peer, absl::Status why) override {
    MutexLock lock(&mu_);
    events_.push_back({true, peer, {}, std::move(why)});
  }
  // Waits until `n` events were recorded; returns a copy of them.
  std::vector<Event> WaitFor(size_t n, absl::Duration timeout = absl::Seconds(5)) {
    MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return events_.size() >= n; };
    mu_.AwaitWithTimeout(enough, timeout);
    return events_;
  }
  std::vector<Event> events() {
    MutexLock lock(&mu_);
    return events_;
  }
  bool AnyLoss() {
    MutexLock lock(&mu_);
    for (const Event& e : events_) {
      if (e.lost) return true;
    }
    return false;
  }

 private:
  Mutex mu_;
  std::vector<Event> events_ ABSL_GUARDED_BY(mu_);
};

struct Node {
  std::unique_ptr<Transport> transport;
  RecordingSink sink;
  std::thread poller;
  std::atomic<bool> stop{false};

  void StartPolling() {
    poller = std::thread([this] {
      while (!stop) {
        absl::Status st = transport->Poll(sink, absl::Milliseconds(5));
        if (!st.ok()) break;
      }
    });
  }
  void StopPolling() {
    stop = true;
    if (transport) transport->Wake();
    if (poller.joinable()) poller.join();
  }
  ~Node() { StopPolling(); }
};

inline FrameHeader Header(FrameType type, NodeId src, NodeId dst, uint64_t key, size_t bytes,
                          uint64_t request = 1) {
  FrameHeader h;
  h.type = type;
  h.src = src;
  h.dst = dst;
  h.key = key;
  h.request_id = request;
  h.payload_bytes = bytes;
  h.part_count = 1;
  return h;
}

// What each end of a worker-server pair connects to: the server accepts
// `worker_peers` (the worker's endpoint), the worker dials `server_peers`.
struct PairPeers {
  std::vector<PeerInfo> worker_peers;
  std::vector<PeerInfo> server_peers;
};
inline PairPeers PeersOf(core::Transport& worker, core::Transport& server) {
  auto wep = worker.LocalEndpoint();
  auto sep = server.LocalEndpoint();
  REQUIRE(wep.ok());
  REQUIRE(sep.ok());
  return {{{kWorker, *wep}}, {{kServer, *sep}}};
}

struct PairConfig {
  MeshOptions options;  // both ends
  FakeFabricOptions fabric;
  FakeNicSpec worker_nic;
  FakeNicSpec server_nic;
  testing::FakeHostSpec worker_host;
  testing::FakeHostSpec server_host;
  bool copy_on_fork = false;  // the kernel copies pinned pages on fork
  PairConfig() {
    options.timeout = absl::Seconds(3);
    worker_nic.name = "fake_w";
    worker_nic.ipv4 = 0x0A000001;
    server_nic.name = "fake_s";
    server_nic.ipv4 = 0x0A000002;
  }
};

// A worker and a server connected over a fresh fabric.
struct Pair {
  FakeFabric fabric;
  Node worker;
  Node server;

  explicit Pair(const PairConfig& config = PairConfig()) : fabric(config.fabric) {
    fabric.SetKernelCopyOnFork(config.copy_on_fork);
    MeshOptions worker_options = config.options;
    worker_options.role = Role::kWorker;
    MeshOptions server_options = config.options;
    server_options.role = Role::kServer;
    auto w = CreateRdmaTransport(worker_options,
                                 fabric.AddHost({config.worker_nic}, config.worker_host));
    auto s = CreateRdmaTransport(server_options,
                                 fabric.AddHost({config.server_nic}, config.server_host));
    REQUIRE(w.ok());
    REQUIRE(s.ok());
    worker.transport = *std::move(w);
    server.transport = *std::move(s);
    const PairPeers peers = PeersOf(*worker.transport, *server.transport);
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    auto accepted = std::async(std::launch::async, [&] {
      return server.transport->Connect(kServer, peers.worker_peers, deadline);
    });
    const absl::Status dialled = worker.transport->Connect(kWorker, peers.server_peers, deadline);
    const absl::Status accept = accepted.get();
    INFO(dialled.ToString() << " / " << accept.ToString());
    REQUIRE(dialled.ok());
    REQUIRE(accept.ok());
  }
  ~Pair() {
    worker.StopPolling();
    server.StopPolling();
  }
  // The QP numbers of the worker's / server's QPs (QP 0 first).
  std::vector<uint32_t> WorkerQps() { return fabric.QpNumbers("fake_w"); }
  std::vector<uint32_t> ServerQps() { return fabric.QpNumbers("fake_s"); }
};

// A server receive region with one slot per worker and a worker pull region.
// Declare before the Pair: the fabric may still read these while the
// transports drain.
struct Buffers {
  static constexpr size_t kSlot = 1 << 20;
  std::vector<std::byte> recv = std::vector<std::byte>(2 * kSlot);  // slots: other, worker
  std::vector<std::byte> src = std::vector<std::byte>(kSlot);
  std::vector<std::byte> pull = std::vector<std::byte>(kSlot);
  std::vector<std::byte> reply = std::vector<std::byte>(kSlot);

  // Receive regions name each slot's writer; send regions are local only.
  static RegionInfo Region(RegionId id, uint64_t key, std::vector<std::byte>& memory,
                           uint32_t num_slots = 1, std::vector<NodeId> writers = {}) {
    RegionInfo r;
    r.id = id;
    r.key = key;
    r.base = memory.data();
    r.slot_bytes = kSlot;
    r.num_slots = num_slots;
    r.remote_writable = !writers.empty();
    r.slot_peers = std::move(writers);
    return r;
  }
  RegionInfo Recv() { return Region(1, 7, recv, 2, {kOtherWorker, kWorker}); }
  RegionInfo Src() { return Region(2, 7, src); }
  RegionInfo Pull() { return Region(3, 9, pull, 1, {kServer}); }
  RegionInfo Reply() { return Region(4, 9, reply); }
  std::byte* WorkerSlot() { return recv.data() + kSlot; }
};

inline void Fill(std::byte* p, size_t n, uint8_t seed) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>(seed + i * 7 + (i >> 9));
}
inline bool Same(const std::byte* p, size_t n, uint8_t seed) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != static_cast<std::byte>(seed + i * 7 + (i >> 9))) return false;
  }
  return true;
}

// Resolves pushes into the worker's slot and replies into the pull region.
inline void ResolveToBuffers(Pair& pair, Buffers& buf) {
  pair.server.sink.resolve = [&buf](NodeId, const FrameHeader&) -> absl::StatusOr<Destination> {
    return Destination{buf.WorkerSlot(), Buffers::kSlot, 1};
  };
  pair.worker.sink.resolve = [&buf](NodeId, const FrameHeader&) -> absl::StatusOr<Destination> {
    return Destination{buf.pull.data(), Buffers::kSlot, 3};
  };
}

inline void RegisterAll(Pair& pair, Buffers& buf) {
  REQUIRE(pair.server.transport->RegisterRegion(buf.Recv()).ok());
  REQUIRE(pair.server.transport->RegisterRegion(buf.Reply()).ok());
  REQUIRE(pair.worker.transport->RegisterRegion(buf.Src()).ok());
  REQUIRE(pair.worker.transport->RegisterRegion(buf.Pull()).ok());
}

inline absl::Status Push(Pair& pair, Buffers& buf, size_t bytes, uint64_t request) {
  return pair.worker.transport->Send(kServer,
                                     Header(FrameType::kPush, kWorker, kServer, 7, bytes, request),
                                     buf.src.data(), 2, bytes);
}

inline absl::Status Reply(Pair& pair, Buffers& buf, size_t bytes, uint64_t request) {
  return pair.server.transport->Send(kWorker,
                                     Header(FrameType::kReply, kServer, kWorker, 9, bytes, request),
                                     buf.reply.data(), 4, bytes);
}

// Registers every buffer, lands frames in them and starts both receive threads.
inline void Serve(Pair& pair, Buffers& buf) {
  RegisterAll(pair, buf);
  ResolveToBuffers(pair, buf);
  pair.worker.StartPolling();
  pair.server.StartPolling();
}

// Pushes `bytes` of pattern `seed` (request 1) and checks that they arrive,
// byte-exact in the worker's slot, as the server's event number `nth` (1-based),
// waiting at most `wait`.
inline void PushChecked(Pair& pair, Buffers& buf, size_t bytes, uint8_t seed, size_t nth = 1,
                        absl::Duration wait = absl::Seconds(5)) {
  Fill(buf.src.data(), bytes, seed);
  REQUIRE(Push(pair, buf, bytes, 1).ok());
  auto events = pair.server.sink.WaitFor(nth, wait);
  REQUIRE(events.size() == nth);
  INFO(events[nth - 1].status.ToString());
  CHECK_FALSE(events[nth - 1].lost);
  CHECK(events[nth - 1].status.ok());
  CHECK(events[nth - 1].header.payload_bytes == bytes);
  CHECK(Same(buf.WorkerSlot(), bytes, seed));
}

// The same for a reply of `bytes` into the worker's pull region.
inline void ReplyChecked(Pair& pair, Buffers& buf, size_t bytes, uint8_t seed, size_t nth = 1) {
  Fill(buf.reply.data(), bytes, seed);
  REQUIRE(Reply(pair, buf, bytes, 1).ok());
  auto events = pair.worker.sink.WaitFor(nth);
  REQUIRE(events.size() == nth);
  INFO(events[nth - 1].status.ToString());
  CHECK_FALSE(events[nth - 1].lost);
  CHECK(events[nth - 1].status.ok());
  CHECK(Same(buf.pull.data(), bytes, seed));
}

}  // namespace stepmesh::core
