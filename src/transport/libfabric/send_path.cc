// Registration, adverts, sends and write completions of the libfabric
// transport (set-up and the receive path are libfabric_transport.cc).

#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <array>
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
  ssize_t Post(fid_ep* ep, const WriteOp& op) override {
    MutexLock lock(&mu_);
    if (held_.empty()) last_ = absl::Now();
    held_.emplace_back(ep, op);
    return 0;
  }
  bool Progress() override {
    MutexLock lock(&mu_);
    if (held_.empty()) return false;
    const absl::Time now = absl::Now();
    if (now - last_ < gap_) return true;
    // Newest first: a frame's last write lands before its earlier ones.
    const ssize_t rc = direct_.Post(held_.back().first, held_.back().second);
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
  std::deque<std::pair<fid_ep*, WriteOp>> held_;
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

bool LibfabricTransport::CanAccess(const Device& device) const {
  // hmem(): asked for (a CUDA backend, GPUDirect not off) and advertised.
  return device.kind == DeviceKind::kCpu || (device.kind == DeviceKind::kCuda && first().hmem());
}

absl::Status LibfabricTransport::RegisterRegion(const RegionInfo& info) {
  const bool device = info.device.kind != DeviceKind::kCpu;
  if (device && !CanAccess(info.device)) {
    // The core stages device memory through pinned host memory instead.
    return absl::FailedPreconditionError(absl::StrCat(
        "libfabric ", first().provider(), ": ", DeviceName(info.device), " memory for key ",
        info.key,
        info.device.kind != DeviceKind::kCuda ? " is not CUDA memory"
        : hmem_wanted_                        ? " needs FI_HMEM, which this provider lacks"
                       : " is not registered in place: FI_HMEM was not asked for (a host "
                         "backend, or STEPMESH_RDMA_GPUDIRECT=off)"));
  }
  auto region = std::make_unique<Region>();
  region->info = info;
  // fi_mr_regattr for every MR: host memory is FI_HMEM_SYSTEM, CUDA memory
  // FI_HMEM_CUDA with its device (the provider fails it without CUDA support;
  // the core then stages the tensor, as on the RDMA path).
  auto reg = [&](FabricEndpoint& rail, void* base, size_t bytes, uint64_t access,
                 FidHandle<fid_mr>& out) -> absl::Status {
    uint64_t key;
    {
      MutexLock lock(&regions_mu_);
      key = next_mr_key_++;
    }
    const iovec iov{base, bytes};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = key;
    attr.iface = device ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
    if (device) attr.device.cuda = info.device.index;
    const int rc = fi_mr_regattr(rail.domain(), &attr, 0, out.out());
    if (rc != 0) {
      return absl::ResourceExhaustedError(
          rail.Error(absl::StrCat("fi_mr_regattr of key ", info.key, " (", bytes, " bytes",
                                  device ? absl::StrCat(", ", DeviceName(info.device)) : "", ")"),
                     rc));
    }
    return absl::OkStatus();
  };
  // Every rail is a domain of its own: each registers the region.
  region->local.resize(rails_.size());
  if (info.remote_writable) region->slots.resize(rails_.size());
  for (size_t r = 0; r < rails_.size(); ++r) {
    FabricEndpoint& rail = *rails_[r];
    STEPMESH_RETURN_IF_ERROR(
        reg(rail, info.base, info.bytes(), FI_WRITE | FI_READ, region->local[r]));
    region->descs[r] = fi_mr_desc(region->local[r].get());
    if (!info.remote_writable) continue;
    region->slots[r].resize(info.num_slots);
    for (uint32_t s = 0; s < info.num_slots; ++s) {
      // One MR per slot: a peer holds the key of its own slot only.
      STEPMESH_RETURN_IF_ERROR(reg(rail, static_cast<std::byte*>(info.base) + s * info.slot_bytes,
                                   info.slot_bytes, FI_REMOTE_WRITE, region->slots[r][s]));
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
        a.addr =
            first().virt_addr() ? reinterpret_cast<uintptr_t>(info.base) + s * info.slot_bytes : 0;
        a.bytes = info.slot_bytes;
        for (const auto& rail_slots : region->slots)
          a.mr_keys.push_back(fi_mr_key(rail_slots[s].get()));
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
    std::array<void*, kMaxRails> descs;
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
      descs = it->second->descs;
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
    const Advert& a = advert->second;
    if (bytes > a.bytes) {
      return absl::OutOfRangeError(absl::StrCat("libfabric: ", bytes, " bytes for key ", header.key,
                                                " exceed ", PeerName(peer), "'s slot of ",
                                                a.bytes));
    }
    // Striping: a payload of at least stripe_min_bytes_ is split into one
    // page-aligned piece per rail both ends have (and the advert keys);
    // every chunk of every piece carries the frame's immediate and is counted.
    const size_t rails = std::min(sp->addrs.size(), a.mr_keys.size());
    const size_t stripes = bytes >= stripe_min_bytes_ && rails > 1 ? rails : 1;
    constexpr size_t kPage = 4096;
    const size_t piece =
        stripes == 1 ? bytes : ((bytes + stripes - 1) / stripes + kPage - 1) / kPage * kPage;
    uint32_t chunks = 0;
    for (size_t off = 0; off < bytes; off += piece) {
      chunks +=
          static_cast<uint32_t>((std::min(piece, bytes - off) + chunk_bytes_ - 1) / chunk_bytes_);
    }
    if (sp->queue.size() + chunks > kMaxQueuedWrites) {
      return absl::ResourceExhaustedError(
          absl::StrCat("libfabric: the write queue to ", PeerName(peer), " is full (",
                       sp->queue.size(), " writes waiting for the provider)"));
    }
    d.seq = sp->next_seq++ & kSeqMask;
    d.chunks = hooks_.signal_last_chunk_only ? 1 : chunks;
    uint32_t c = 0;
    bool failed = false;
    for (size_t start = 0, rail = 0; start < bytes && !failed; start += piece, ++rail) {
      const size_t end = std::min(bytes, start + piece);
      for (size_t off = start; off < end; off += chunk_bytes_, ++c) {
        WriteOp op;
        op.rail = static_cast<uint32_t>(rail);
        op.dest = sp->addrs[rail];
        op.src = static_cast<const std::byte*>(src) + off;
        op.len = std::min(chunk_bytes_, end - off);
        op.desc = descs[rail];
        op.remote_addr = a.addr + off;
        op.mr_key = a.mr_keys[rail];
        op.imm = Immediate(sp->tag, d.seq);
        op.signal = !hooks_.signal_last_chunk_only || c + 1 == chunks;
        auto* ctx = new OpContext();
        ctx->peer = peer;
        ctx->seq = d.seq;
        ctx->rail = op.rail;
        ctx->region_in_flight = in_flight;
        op.context = ctx;
        absl::Status st = PostOrQueue(peer, *sp, op, ctx);
        if (!st.ok()) {
          if (c == 0) return st;  // nothing posted: the send may be retried
          // Some writes are out: the frame is announced and failed, so that
          // the peer does not wait for the rest.
          MutexLock abort(&abort_mu_);
          aborts_.push_back({peer, d.seq, std::string(st.message())});
          failed = true;
          break;
        }
      }
    }
  }
  WakeSleeper();
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
    FabricEndpoint& rail = *rails_[op.rail];
    ssize_t rc = poster_->Post(rail.ep(), op);
    if (rc == -FI_EAGAIN) {
      ReapTransmits(rail);  // progress may free room
      rc = poster_->Post(rail.ep(), op);
    }
    if (rc == 0) return absl::OkStatus();
    if (rc != -FI_EAGAIN) {
      Finish(ctx, absl::OkStatus());
      return absl::UnavailableError(
          rail.Error(absl::StrCat("fi_writemsg to ", PeerName(peer)), static_cast<int>(rc)));
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
    aborts_.push_back({ctx->peer, ctx->seq, std::string(status.message())});
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
  for (const auto& rail : rails_) ReapTransmits(*rail);
}

void LibfabricTransport::ReapTransmits(FabricEndpoint& rail) {
  fi_cq_data_entry entries[32];
  for (int round = 0; round < 16; ++round) {
    std::vector<std::pair<OpContext*, absl::Status>> done;
    {
      MutexLock lock(&tx_mu_);
      const ssize_t n = fi_cq_read(rail.tx_cq(), entries, 32);
      if (n == -FI_EAVAIL) {
        fi_cq_err_entry err{};
        if (fi_cq_readerr(rail.tx_cq(), &err, 0) > 0 && err.op_context != nullptr) {
          // The rail (NIC) is named: a stripe failing says which.
          done.emplace_back(
              static_cast<OpContext*>(err.op_context),
              absl::UnavailableError(absl::StrCat(
                  "libfabric ", rail.provider(), " ", rail.Name(), ": ",
                  fi_cq_strerror(rail.tx_cq(), err.prov_errno, err.err_data, nullptr, 0), " (err ",
                  err.err, ")")));
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
        FabricEndpoint& rail = *rails_[op.rail];
        const ssize_t rc = poster_->Post(rail.ep(), op);
        if (rc == -FI_EAGAIN) break;
        sp->queue.pop_front();
        queued_.fetch_sub(1);
        if (rc != 0) {
          Finish(ctx, absl::UnavailableError(rail.Error(
                          absl::StrCat("fi_writemsg to ", PeerName(id)), static_cast<int>(rc))));
        }
      }
    }
  }
  poster_->Progress();
  std::vector<AbortNote> aborts;
  {
    MutexLock lock(&abort_mu_);
    aborts.swap(aborts_);
  }
  for (const AbortNote& a : aborts) (void)SendControl(a.peer, EncodeAbort(a.seq, a.reason));
}

}  // namespace stepmesh::libfabric
