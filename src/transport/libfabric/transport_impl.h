#pragma once
// The libfabric transport's class, shared by its phase files:
//   libfabric_transport.cc  set-up, control messages, receive path, shutdown
//   send_path.cc            registration, adverts, sends, posting, TX completions
// Internal to src/transport/libfabric/.

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "src/base/net.h"
#include "src/base/rate_limit.h"
#include "src/base/sync.h"
#include "src/core/transport.h"
#include "src/transport/libfabric/fabric_endpoint.h"
#include "src/transport/libfabric/fabric_wire.h"
#include "src/transport/libfabric/frame_assembler.h"
#include "src/transport/libfabric/libfabric_transport.h"

namespace stepmesh::libfabric {

// One posted (or queued) write, the op_context of its TX completion.
struct OpContext {
  fi_context2 fi;  // first: FI_CONTEXT/FI_CONTEXT2 providers use it
  core::NodeId peer = core::kNoNode;
  uint32_t seq = 0;
  uint32_t rail = 0;
  std::shared_ptr<std::atomic<int>> region_in_flight;
};

// What this node needs to write to one peer. `mu` guards the rest.
struct SendPeer {
  base::Mutex mu;
  bool hello = false;     // the peer's hello arrived: addr and tag are valid
  bool expelled = false;  // it dropped this node (kExpel): sends fail until its next hello
  uint64_t epoch = 0;
  // The peer's address on each rail both ends have (rail r writes to the
  // peer's rail r): min(our rails, its rails) entries.
  std::vector<fi_addr_t> addrs;
  uint32_t tag = 0;
  uint32_t next_seq = 0;
  absl::flat_hash_map<uint64_t, Advert> adverts;
  std::deque<std::pair<WriteOp, OpContext*>> queue;  // writes the provider refused (EAGAIN)
};

// What this node knows of one peer's writes to it (under recv_mu_).
struct RecvPeer {
  uint32_t tag = 0;
  bool has_tag = false;   // assigned with our first hello to it
  uint64_t epoch = 0;     // of the peer's last hello
  uint64_t answered = 0;  // the peer epoch our hello answered
  bool expelled = false;  // dropped for a protocol violation, until its next hello
  FrameAssembler frames;
};

// Every MR exists once per rail (each rail is its own domain: EFA keys and
// descriptors are per device).
struct Region {
  core::RegionInfo info;
  std::vector<FidHandle<fid_mr>> local;               // [rail]
  std::array<void*, kMaxRails> descs{};               // fi_mr_desc of local[rail]
  std::vector<std::vector<FidHandle<fid_mr>>> slots;  // remote_writable: [rail][slot]
  std::shared_ptr<std::atomic<int>> in_flight = std::make_shared<std::atomic<int>>(0);
};

// A write that failed at this node: its frame's receiver is told (kAbort).
struct AbortNote {
  core::NodeId peer = core::kNoNode;
  uint32_t seq = 0;
  std::string reason;
};

class LibfabricTransport final : public core::Transport {
 public:
  LibfabricTransport(const MeshOptions& options, std::unique_ptr<core::Transport> control,
                     std::vector<std::unique_ptr<FabricEndpoint>> rails, LibfabricHooks hooks);
  ~LibfabricTransport() override;

  absl::string_view name() const override { return "libfabric"; }
  // Device memory where the provider has FI_HMEM (send_path.cc); the core
  // stages the rest, and a device region whose registration fails.
  bool CanAccess(const Device& device) const override;
  absl::StatusOr<std::string> LocalEndpoint() override;
  absl::Status Connect(core::NodeId self, absl::Span<const core::PeerInfo> peers,
                       absl::Time deadline) override;
  absl::Status RegisterRegion(const core::RegionInfo& region) override;
  absl::Status UnregisterRegion(core::RegionId id) override;
  absl::Status Send(core::NodeId peer, const core::FrameHeader& header, const void* src,
                    core::RegionId src_region, size_t bytes) override;
  absl::Status Poll(core::TransportSink& sink, absl::Duration max_wait) override;
  void Wake() override { control_->Wake(); }
  int WaitFd() const override { return wait_epoll_.get(); }
  void Shutdown() override;

  // From the control connection (libfabric_transport.cc).
  void OnControl(core::NodeId peer, absl::string_view bytes, core::TransportSink& sink);
  void OnPeerLost(core::NodeId peer, absl::Status why, core::TransportSink& sink);

 private:
  // libfabric_transport.cc
  absl::Status SendControl(core::NodeId peer, const std::string& body);
  std::string HelloFor(core::NodeId peer);
  void OnHello(core::NodeId peer, const Hello& hello);
  void Expel(core::NodeId peer, absl::Status why, core::TransportSink& sink);
  void ReadReceives(core::TransportSink& sink);
  void ReadReceives(FabricEndpoint& rail, core::TransportSink& sink);
  void DeliverReady(core::NodeId peer, core::TransportSink& sink);
  void Deliver(core::NodeId peer, PendingFrame& frame, core::TransportSink& sink);
  absl::Status CheckLanding(core::NodeId writer, const core::FrameHeader& header,
                            const core::Destination& dest);
  void ExpireWaiting(core::TransportSink& sink);
  bool Busy();
  // Blocks in the rails' CQ wait fds and the control connection's (at most
  // `max_wait`); false where this transport cannot (shm: no wait object).
  bool SleepInWaitFds(absl::Duration max_wait);
  void SetUpWaitFds();

  // send_path.cc
  std::shared_ptr<SendPeer> PeerFor(core::NodeId peer);
  void SendAdverts(core::NodeId peer);
  absl::Status PostOrQueue(core::NodeId peer, SendPeer& sp, const WriteOp& op, OpContext* ctx);
  void Progress();
  void ReapTransmits();
  void ReapTransmits(FabricEndpoint& rail);
  void Finish(OpContext* ctx, absl::Status status);
  // Wakes a receive thread asleep in the wait fds: writes posted need progress.
  void WakeSleeper() {
    if (sleeping_.load()) control_->Wake();
  }
  void DropQueue(SendPeer& sp);

  const MeshOptions options_;
  const LibfabricHooks hooks_;
  std::unique_ptr<core::Transport> control_;
  std::vector<std::unique_ptr<FabricEndpoint>> rails_;  // never empty; [0] is the first NIC
  FabricEndpoint& first() const { return *rails_.front(); }
  std::unique_ptr<WritePoster> poster_;
  const uint64_t epoch_;
  size_t chunk_bytes_;
  size_t stripe_min_bytes_;
  const bool hmem_wanted_;  // a CUDA backend and GPUDirect not off: FI_HMEM asked for
  // Blocking progress (docs/libfabric.md, "Progress"): an epoll over every
  // rail's receive-CQ wait fd and the control connection's WaitFd; invalid
  // when a rail has no wait fd, or in spin mode.
  base::UniqueFd wait_epoll_;
  std::atomic<bool> sleeping_{false};
  std::atomic<core::NodeId> self_{core::kNoNode};
  std::atomic<bool> shut_down_{false};
  base::RateLimiter warnings_{5, absl::Seconds(10)};

  base::Mutex ctl_mu_;  // one control send at a time
  base::Mutex av_mu_;   // the endpoint's address-vector cache, published_
  absl::flat_hash_map<core::NodeId, std::vector<std::string>> published_;  // roster (raw)

  base::Mutex peers_mu_;
  absl::flat_hash_map<core::NodeId, std::shared_ptr<SendPeer>> send_peers_;

  base::Mutex recv_mu_;
  absl::flat_hash_map<core::NodeId, RecvPeer> recv_peers_;
  std::vector<core::NodeId> tag_owner_ = std::vector<core::NodeId>(kMaxTags, core::kNoNode);
  uint32_t next_tag_ = 0;
  struct Landing {
    std::byte* data = nullptr;
    size_t bytes = 0;
  };
  absl::flat_hash_map<std::pair<uint64_t, core::NodeId>, Landing> receive_slots_;

  base::Mutex regions_mu_;
  absl::flat_hash_map<core::RegionId, std::unique_ptr<Region>> regions_;
  uint64_t next_mr_key_ = 1;

  base::Mutex tx_mu_;  // the TX CQ and the live contexts
  absl::flat_hash_set<OpContext*> live_;
  std::atomic<int> outstanding_{0};  // posted or queued writes
  std::atomic<int> queued_{0};       // of which queued
  base::Mutex abort_mu_;
  std::vector<AbortNote> aborts_;  // to tell peers
};

}  // namespace stepmesh::libfabric
