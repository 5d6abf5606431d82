// Registration, adverts, sends and write completions of the libfabric
// transport (set-up and the receive path are libfabric_transport.cc).

#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/core/protocol.h"
#include "src/transport/libfabric/transport_impl.h"
#include "stepmesh/status.h"

namespace stepmesh::libfabric {

using base::MutexLock;
using core::FrameHeader;
using core::NodeId;
using core::PeerName;
using core::RegionId;
using core::RegionInfo;

namespace {

// Writes that wait for room in the provider's queue to one peer; beyond
// this Send fails RESOURCE_EXHAUSTED naming the peer.
constexpr size_t kMaxQueuedWrites = 4096;

class DirectPoster final : public WritePoster {
 public:
  ssize_t Post(fid_ep* ep, const WriteOp& op) override {
    iovec iov{const_cast<void*>(op.src), op.len};
    void* desc = op.desc;
    fi_rma_iov rma{op.remote_addr, op.len, op.mr_key};
    fi_msg_rma msg{};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = op.dest;
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = op.context;
    msg.data = op.imm;
    return fi_writemsg(ep, &msg, FI_COMPLETION | (op.signal ? FI_REMOTE_CQ_DATA : 0));
  }
};

class ReorderingPoster final : public WritePoster {
 public:
  explicit ReorderingPoster(absl::Duration gap) : gap_(gap) {}
  ssize_t Post(fid_ep*, const WriteOp& op) override {
    MutexLock lock(&mu_);
    if (held_.empty()) last_ = absl::Now();
    held_.push_back(op);
    return 0;
  }
  bool Progress(fid_ep* ep) override {
    MutexLock lock(&mu_);
    if (held_.empty()) return false;
    const absl::Time now = absl::Now();
    if (now - last_ < gap_) return true;
    // Newest first: a frame's last write lands before its earlier ones.
    const ssize_t rc = direct_.Post(ep, held_.back());
    if (rc == 0) {
      held_.pop_back();
      last_ = now;
    }
    return !held_.empty();
  }

 private:
  const absl::Duration gap_;
  DirectPoster direct_;
  base::Mutex mu_;
  std::deque<WriteOp> held_;
  absl::Time last_;
};

}  // namespace

std::unique_ptr<WritePoster> MakeDirectPoster() { return std::make_unique<DirectPoster>(); }
std::unique_ptr<WritePoster> MakeReorderingPoster(absl::Duration gap) {
  return std::make_unique<ReorderingPoster>(gap);
}

std::shared_ptr<SendPeer> LibfabricTransport::PeerFor(NodeId peer) {
  MutexLock lock(&peers_mu_);
  std::shared_ptr<SendPeer>& sp = send_peers_[peer];
  if (sp == nullptr) sp = std::make_shared<SendPeer>();
  return sp;
}

absl::Status LibfabricTransport::RegisterRegion(const RegionInfo& info) {
  if (info.device.kind != DeviceKind::kCpu) {
    // The core stages device memory through pinned host memory instead.
    return absl::UnimplementedError(absl::StrCat(
        "libfabric ", endpoint_->provider(), ": device memory needs FI_HMEM",
        endpoint_->hmem() ? " registration, not implemented yet" : ", which this provider lacks"));
  }
  auto region = std::make_unique<Region>();
  region->info = info;
  auto reg = [&](void* base, size_t bytes, uint64_t access,
                 FidHandle<fid_mr>& out) -> absl::Status {
    uint64_t key;
    {
      MutexLock lock(&regions_mu_);
      key = next_mr_key_++;
    }
    const int rc =
        fi_mr_reg(endpoint_->domain(), base, bytes, access, 0, key, 0, out.out(), nullptr);
    if (rc != 0) {
      return absl::ResourceExhaustedError(endpoint_->Error(
          absl::StrCat("fi_mr_reg of key ", info.key, " (", bytes, " bytes)"), rc));
    }
    return absl::OkStatus();
  };
  STEPMESH_RETURN_IF_ERROR(reg(info.base, info.bytes(), FI_WRITE | FI_READ, region->local));
  if (info.remote_writable) {
    region->slots.resize(info.num_slots);
    for (uint32_t s = 0; s < info.num_slots; ++s) {
      // One MR per slot: a peer holds the key of its own slot only.
      STEPMESH_RETURN_IF_ERROR(reg(static_cast<std::byte*>(info.base) + s * info.slot_bytes,
                                   info.slot_bytes, FI_REMOTE_WRITE, region->slots[s]));
    }
  }
  std::vector<NodeId> owners;
  {
    MutexLock lock(&regions_mu_);
    if (regions_.contains(info.id)) {
      return absl::AlreadyExistsError(
          absl::StrCat("libfabric: region ", info.id, " registered twice"));
    }
    regions_[info.id] = std::move(region);
  }
  if (info.remote_writable) {
    MutexLock lock(&recv_mu_);
    for (uint32_t s = 0; s < info.num_slots && s < info.slot_peers.size(); ++s) {
      receive_slots_[{info.key, info.slot_peers[s]}] = {
          static_cast<std::byte*>(info.base) + s * info.slot_bytes, info.slot_bytes};
      owners.push_back(info.slot_peers[s]);
    }
  }
  for (NodeId peer : owners) SendAdverts(peer);
  return absl::OkStatus();
}

absl::Status LibfabricTransport::UnregisterRegion(RegionId id) {
  std::shared_ptr<std::atomic<int>> in_flight;
  {
    MutexLock lock(&regions_mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return absl::OkStatus();
    in_flight = it->second->in_flight;
  }
  // Writes that read the region finish first (bounded, then the core retries).
  const absl::Time until = absl::Now() + options_.timeout;
  while (in_flight->load() > 0) {
    if (absl::Now() >= until) {
      return absl::FailedPreconditionError(absl::StrCat("libfabric: region ", id, " still has ",
                                                        in_flight->load(),
                                                        " writes in flight; try again"));
    }
    Progress();
    std::this_thread::yield();
  }
  std::unique_ptr<Region> region;
  {
    MutexLock lock(&regions_mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return absl::OkStatus();
    region = std::move(it->second);
    regions_.erase(it);
  }
  if (region->info.remote_writable) {
    {
      MutexLock lock(&recv_mu_);
      for (NodeId peer : region->info.slot_peers) receive_slots_.erase({region->info.key, peer});
    }
    for (NodeId peer : region->info.slot_peers) {
      (void)SendControl(peer, EncodeWithdraw(region->info.key));
    }
  }
  return absl::OkStatus();  // `region` closes its MRs
}

// Advertises every slot `peer` may write, once it said hello.
void LibfabricTransport::SendAdverts(NodeId peer) {
  {
    std::shared_ptr<SendPeer> sp = PeerFor(peer);
    MutexLock lock(&sp->mu);
    if (!sp->hello) return;
  }
  std::vector<std::string> adverts;
  {
    MutexLock lock(&regions_mu_);
    for (const auto& [id, region] : regions_) {
      const RegionInfo& info = region->info;
      if (!info.remote_writable) continue;
      for (uint32_t s = 0; s < info.num_slots && s < info.slot_peers.size(); ++s) {
        if (info.slot_peers[s] != peer) continue;
        Advert a;
        a.key = info.key;
        a.addr = endpoint_->virt_addr()
                     ? reinterpret_cast<uintptr_t>(info.base) + s * info.slot_bytes
                     : 0;
        a.bytes = info.slot_bytes;
        a.mr_key = fi_mr_key(region->slots[s].get());
        adverts.push_back(EncodeAdvert(a));
      }
    }
  }
  for (const std::string& a : adverts) {
    absl::Status st = SendControl(peer, a);
    if (!st.ok())
      STEPMESH_LOG(kDebug, "libfabric: advert to ", PeerName(peer), ": ", st.ToString());
  }
}

absl::Status LibfabricTransport::Send(NodeId peer, const FrameHeader& header, const void* src,
                                      RegionId src_region, size_t bytes) {
  if (shut_down_.load()) return absl::FailedPreconditionError("libfabric: shut down");
  const absl::Time deadline = absl::Now() + options_.timeout;
  Progress();
  std::shared_ptr<SendPeer> sp = PeerFor(peer);
  {
    MutexLock lock(&sp->mu);
    if (sp->expelled) {
      return absl::UnavailableError(
          absl::StrCat("libfabric: ", PeerName(peer), " dropped this node"));
    }
  }
  FrameDescriptor d;
  d.header = header;
  if (bytes == 0 || src_region == 0) {
    if (bytes > kMaxInlineBytes) {
      return absl::InvalidArgumentError(absl::StrCat("libfabric: an unregistered payload of ",
                                                     bytes, " bytes (at most ", kMaxInlineBytes,
                                                     ")"));
    }
    d.inline_bytes.assign(static_cast<const char*>(src), bytes);
    MutexLock lock(&sp->mu);
    d.seq = sp->next_seq++ & kSeqMask;
  } else {
    void* desc = nullptr;
    std::shared_ptr<std::atomic<int>> in_flight;
    {
      MutexLock lock(&regions_mu_);
      auto it = regions_.find(src_region);
      if (it == regions_.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("libfabric: source region ", src_region, " is not registered"));
      }
      const RegionInfo& info = it->second->info;
      const auto* base = static_cast<const std::byte*>(info.base);
      const auto* from = static_cast<const std::byte*>(src);
      if (from < base || from + bytes > base + info.bytes()) {
        return absl::OutOfRangeError(absl::StrCat("libfabric: source outside region ", src_region));
      }
      desc = fi_mr_desc(it->second->local.get());
      in_flight = it->second->in_flight;
    }
    MutexLock lock(&sp->mu);
    sp->mu.AwaitWithDeadline(
        [&] { return shut_down_.load() || (sp->hello && sp->adverts.contains(header.key)); },
        deadline);
    if (!sp->hello) {
      return absl::DeadlineExceededError(absl::StrCat(
          "libfabric: ", PeerName(peer), " never said hello on the control connection (waited ",
          absl::FormatDuration(options_.timeout), ")"));
    }
    auto advert = sp->adverts.find(header.key);
    if (advert == sp->adverts.end()) {
      return absl::DeadlineExceededError(
          absl::StrCat("libfabric: ", PeerName(peer), " never advertised a receive region for key ",
                       header.key, " (waited ", absl::FormatDuration(options_.timeout), ")"));
    }
    const Advert a = advert->second;
    if (bytes > a.bytes) {
      return absl::OutOfRangeError(absl::StrCat("libfabric: ", bytes, " bytes for key ", header.key,
                                                " exceed ", PeerName(peer), "'s slot of ",
                                                a.bytes));
    }
    const uint32_t chunks = static_cast<uint32_t>((bytes + chunk_bytes_ - 1) / chunk_bytes_);
    if (sp->queue.size() + chunks > kMaxQueuedWrites) {
      return absl::ResourceExhaustedError(
          absl::StrCat("libfabric: the write queue to ", PeerName(peer), " is full (",
                       sp->queue.size(), " writes waiting for the provider)"));
    }
    d.seq = sp->next_seq++ & kSeqMask;
    d.chunks = hooks_.signal_last_chunk_only ? 1 : chunks;
    for (uint32_t c = 0; c < chunks; ++c) {
      const size_t off = size_t{c} * chunk_bytes_;
      WriteOp op;
      op.dest = sp->addr;
      op.src = static_cast<const std::byte*>(src) + off;
      op.len = std::min(chunk_bytes_, bytes - off);
      op.desc = desc;
      op.remote_addr = a.addr + off;
      op.mr_key = a.mr_key;
      op.imm = Immediate(sp->tag, d.seq);
      op.signal = !hooks_.signal_last_chunk_only || c + 1 == chunks;
      auto* ctx = new OpContext();
      ctx->peer = peer;
      ctx->seq = d.seq;
      ctx->region_in_flight = in_flight;
      op.context = ctx;
      absl::Status st = PostOrQueue(peer, *sp, op, ctx);
      if (!st.ok()) {
        if (c == 0) return st;  // nothing posted: the send may be retried
        // Some writes are out: the frame is announced and failed, so that
        // the peer does not wait for the rest.
        MutexLock abort(&abort_mu_);
        aborts_.emplace_back(peer, d.seq);
        break;
      }
    }
  }
  return SendControl(peer, EncodeFrame(d));
}

absl::Status LibfabricTransport::PostOrQueue(NodeId peer, SendPeer& sp, const WriteOp& op,
                                             OpContext* ctx) {
  ctx->region_in_flight->fetch_add(1);
  outstanding_.fetch_add(1);
  {
    MutexLock lock(&tx_mu_);
    live_.insert(ctx);
  }
  if (sp.queue.empty()) {
    ssize_t rc = poster_->Post(endpoint_->ep(), op);
    if (rc == -FI_EAGAIN) {
      ReapTransmits();  // progress may free room
      rc = poster_->Post(endpoint_->ep(), op);
    }
    if (rc == 0) return absl::OkStatus();
    if (rc != -FI_EAGAIN) {
      Finish(ctx, absl::OkStatus());
      return absl::UnavailableError(
          endpoint_->Error(absl::StrCat("fi_writemsg to ", PeerName(peer)), static_cast<int>(rc)));
    }
  }
  sp.queue.emplace_back(op, ctx);
  queued_.fetch_add(1);
  return absl::OkStatus();
}

void LibfabricTransport::Finish(OpContext* ctx, absl::Status status) {
  if (!status.ok()) {
    STEPMESH_LOG_LIMITED(warnings_, kWarning, "libfabric: a write to ", PeerName(ctx->peer),
                         " failed: ", status.ToString());
    MutexLock lock(&abort_mu_);
    aborts_.emplace_back(ctx->peer, ctx->seq);
  }
  ctx->region_in_flight->fetch_sub(1);
  outstanding_.fetch_sub(1);
  {
    MutexLock lock(&tx_mu_);
    live_.erase(ctx);
  }
  delete ctx;
}

void LibfabricTransport::DropQueue(SendPeer& sp) {
  for (auto& [op, ctx] : sp.queue) {
    queued_.fetch_sub(1);
    Finish(ctx, absl::OkStatus());
  }
  sp.queue.clear();
}

void LibfabricTransport::ReapTransmits() {
  fi_cq_data_entry entries[32];
  for (int round = 0; round < 16; ++round) {
    std::vector<std::pair<OpContext*, absl::Status>> done;
    {
      MutexLock lock(&tx_mu_);
      const ssize_t n = fi_cq_read(endpoint_->tx_cq(), entries, 32);
      if (n == -FI_EAVAIL) {
        fi_cq_err_entry err{};
        if (fi_cq_readerr(endpoint_->tx_cq(), &err, 0) > 0 && err.op_context != nullptr) {
          done.emplace_back(
              static_cast<OpContext*>(err.op_context),
              absl::UnavailableError(absl::StrCat(
                  "libfabric ", endpoint_->provider(), ": ",
                  fi_cq_strerror(endpoint_->tx_cq(), err.prov_errno, err.err_data, nullptr, 0))));
        }
      } else if (n > 0) {
        for (ssize_t i = 0; i < n; ++i) {
          done.emplace_back(static_cast<OpContext*>(entries[i].op_context), absl::OkStatus());
        }
      } else {
        return;
      }
    }
    for (auto& [ctx, status] : done) Finish(ctx, std::move(status));
  }
}

// Reaps write completions, posts what waited for room, tells peers of failed
// writes. Any thread.
void LibfabricTransport::Progress() {
  ReapTransmits();
  if (queued_.load(std::memory_order_relaxed) > 0) {
    std::vector<std::pair<NodeId, std::shared_ptr<SendPeer>>> peers;
    {
      MutexLock lock(&peers_mu_);
      for (const auto& [id, sp] : send_peers_) peers.emplace_back(id, sp);
    }
    for (auto& [id, sp] : peers) {
      MutexLock lock(&sp->mu);
      while (!sp->queue.empty()) {
        auto [op, ctx] = sp->queue.front();
        const ssize_t rc = poster_->Post(endpoint_->ep(), op);
        if (rc == -FI_EAGAIN) break;
        sp->queue.pop_front();
        queued_.fetch_sub(1);
        if (rc != 0) {
          Finish(ctx, absl::UnavailableError(endpoint_->Error(
                          absl::StrCat("fi_writemsg to ", PeerName(id)), static_cast<int>(rc))));
        }
      }
    }
  }
  poster_->Progress(endpoint_->ep());
  std::vector<std::pair<NodeId, uint32_t>> aborts;
  {
    MutexLock lock(&abort_mu_);
    aborts.swap(aborts_);
  }
  for (auto [peer, seq] : aborts) (void)SendControl(peer, EncodeAbort(seq));
}

}  // namespace stepmesh::libfabric
