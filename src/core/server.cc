// AFTensorServer: assembles each worker's pushes into batches over contiguous
// registered regions, hands batches out, and sends each worker its own reply.

#include "absl/strings/string_view.h"
#include <algorithm>
#include <array>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "src/core/logging.h"
#include "src/core/mesh.h"
#include "src/core/mesh_node.h"
#include "stepmesh/server.h"
#include "stepmesh/status.h"

namespace stepmesh::core {
namespace {

constexpr int kMaxPushesPerRequest = 16;
constexpr int kAssembliesPerWorker = 64;
constexpr int kBatchSlots = 64;
constexpr size_t kErrorRing = 256;
constexpr uint32_t kSendReplies = 1;
constexpr uint32_t kSendError = 2;

struct RecvRegistration {
  TensorView view;
  WireTensor wire;
  size_t slot_bytes = 0;
  std::unique_ptr<std::atomic<bool>[]> busy;  // per worker: slot holds unanswered data
};

struct ReplyRegistration {
  TensorView view;
  WireTensor wire;
  size_t slot_bytes = 0;
};

// One worker request being received (its parts may arrive one by one).
struct Assembly {
  bool used = false;
  uint64_t request_id = 0;
  uint16_t part_count = 0;
  uint16_t parts_done = 0;
  bool failed = false;
  Key group = 0;
  Key pull_key = Batch::kNoPull;
  TraceStamps stamps;
  int num_keys = 0;
  std::array<Key, kMaxPushesPerRequest> keys{};
  std::array<size_t, kMaxPushesPerRequest> bytes{};
  std::array<RecvRegistration*, kMaxPushesPerRequest> regs{};
};

enum class BatchState : uint8_t { kFree, kCollecting, kReady, kHandedOut, kResponding };

struct WorkerEntry {
  bool present = false;
  uint64_t request_id = 0;
  Key pull_key = Batch::kNoPull;
  TraceStamps stamps;
  size_t reply_bytes = 0;
  ReplyRegistration* reply = nullptr;
  uint32_t pushed_mask = 0;  // bit t: this worker filled slot.tensors[t]
};

struct BatchSlot {
  BatchSlot(int num_workers)
      : entries(num_workers), valid(kMaxPushesPerRequest, std::vector<size_t>(num_workers, 0)) {
    workers.reserve(num_workers);
    pull_keys.reserve(num_workers);
    tensors.reserve(kMaxPushesPerRequest);
    regs.reserve(kMaxPushesPerRequest);
  }
  uint32_t generation = 0;
  BatchState state = BatchState::kFree;
  uint64_t opened_sequence = 0;
  Key group = 0;
  std::vector<WorkerEntry> entries;  // by worker rank
  std::vector<int> workers;          // present, ascending
  std::vector<Key> pull_keys;        // parallel to workers
  std::vector<BatchTensor> tensors;
  std::vector<RecvRegistration*> regs;  // parallel to tensors
  std::vector<std::vector<size_t>> valid;  // [tensor][worker]
  uint64_t handler_ns = 0;
};

struct ErrorRecord {
  NodeId worker = kNoNode;
  uint64_t request_id = 0;
  absl::StatusCode code = absl::StatusCode::kUnknown;
  std::string message;
};

class Server final : public AFTensorServer, public MeshNode {
 public:
  Server(const MeshOptions& options, std::shared_ptr<Backend> backend)
      : MeshNode(options, std::move(backend)),
        assemblies_(options.num_workers, std::vector<Assembly>(kAssembliesPerWorker)),
        lost_workers_(new std::atomic<bool>[options.num_workers]),
        worker_epochs_(new std::atomic<uint32_t>[options.num_workers]),
        seen_epochs_(options.num_workers, 0),
        errors_(kErrorRing) {
    for (int w = 0; w < options.num_workers; ++w) {
      lost_workers_[w] = false;
      worker_epochs_[w] = 0;
    }
    for (int i = 0; i < kBatchSlots; ++i) {
      slots_.push_back(std::make_unique<BatchSlot>(options.num_workers));
      free_slots_.push_back(kBatchSlots - 1 - i);
    }
    ready_.reserve(kBatchSlots);
  }
  ~Server() override { Stop(); }

  absl::Status Init(const TransportFactory& factory) {
    // Made now: making a flag later pins memory, which waits for the whole device.
    STEPMESH_ASSIGN_OR_RETURN(batches_ready_, backend_->CreateHostFlag());
    STEPMESH_ASSIGN_OR_RETURN(batch_cursor_, backend_->CreateHostFlag());
    return Start(factory);
  }

  int rank() const override { return rank_; }
  int num_workers() const override { return options_.num_workers; }
  Backend& backend() override { return *backend_; }

  absl::Status RegisterRecvTensor(Key key, TensorView region) override {
    ::stepmesh::core::MutexLock lock(&reg_mu_);
    STEPMESH_RETURN_IF_ERROR(CheckNewKey(key, recv_regs_.contains(key), "receive"));
    STEPMESH_ASSIGN_OR_RETURN(size_t slot_bytes, SlotBytes(region, "receive"));
    std::vector<NodeId> writers;
    for (int w = 0; w < options_.num_workers; ++w) writers.push_back(PeerId(w));
    STEPMESH_ASSIGN_OR_RETURN(WireTensor wire,
                              RegisterTensor(key, region, options_.num_workers, std::move(writers)));
    auto reg = std::make_unique<RecvRegistration>();
    reg->view = region;
    reg->wire = wire;
    reg->slot_bytes = slot_bytes;
    reg->busy.reset(new std::atomic<bool>[options_.num_workers]);
    for (int w = 0; w < options_.num_workers; ++w) reg->busy[w] = false;
    recv_regs_[key] = std::move(reg);
    return absl::OkStatus();
  }

  absl::Status RegisterReplyTensor(Key key, TensorView region) override {
    ::stepmesh::core::MutexLock lock(&reg_mu_);
    STEPMESH_RETURN_IF_ERROR(CheckNewKey(key, reply_regs_.contains(key), "reply"));
    STEPMESH_ASSIGN_OR_RETURN(size_t slot_bytes, SlotBytes(region, "reply"));
    STEPMESH_ASSIGN_OR_RETURN(WireTensor wire,
                              RegisterTensor(key, region, options_.num_workers, {}));
    reply_regs_[key] =
        std::make_unique<ReplyRegistration>(ReplyRegistration{region, wire, slot_bytes});
    return absl::OkStatus();
  }

  absl::Status Unregister(Key key) override {
    ::stepmesh::core::MutexLock lock(&reg_mu_);
    auto recv = recv_regs_.find(key);
    auto reply = reply_regs_.find(key);
    if (recv == recv_regs_.end() && reply == reply_regs_.end()) {
      return absl::NotFoundError(absl::StrCat("key ", key, " is not registered"));
    }
    if (recv != recv_regs_.end()) {
      for (int w = 0; w < options_.num_workers; ++w) {
        if (recv->second->busy[w].load()) {
          return absl::FailedPreconditionError(
              absl::StrCat("key ", key, " holds data of an unanswered batch"));
        }
      }
    }
    {
      ::stepmesh::core::MutexLock batch_lock(&batch_mu_);
      if (reply != reply_regs_.end()) {
        for (const auto& slot : slots_) {
          if (slot->state != BatchState::kResponding) continue;
          for (const WorkerEntry& e : slot->entries) {
            if (e.reply == reply->second.get()) {
              return absl::FailedPreconditionError(
                  absl::StrCat("key ", key, " is the source of a reply being sent"));
            }
          }
        }
      }
    }
    if (recv != recv_regs_.end()) {
      STEPMESH_RETURN_IF_ERROR(
          UnregisterTensor(recv->second->wire.region, recv->second->view.data, key));
      recv_regs_.erase(recv);
    }
    if (reply != reply_regs_.end()) {
      STEPMESH_RETURN_IF_ERROR(
          UnregisterTensor(reply->second->wire.region, reply->second->view.data, key));
      reply_regs_.erase(reply);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Batch> GetBatch(absl::Duration timeout, BatchPolicy policy) override {
    if (stopped()) return absl::FailedPreconditionError("server is shut down");
    const absl::Time deadline = absl::Now() + timeout;
    // Also wakes when the last worker is gone: nothing can arrive any more.
    AwaitUntil(
        [this] {
          return ready_count_.load(std::memory_order_acquire) > 0 || stopped() ||
                 live_workers() == 0;
        },
        deadline);
    ::stepmesh::core::MutexLock lock(&batch_mu_);
    uint32_t index;
    if (!ready_.empty()) {
      index = ready_.front();
      ready_.erase(ready_.begin());
      ready_count_.fetch_sub(1);
    } else {
      if (stopped()) return absl::CancelledError("server shut down while waiting for a batch");
      if (live_workers() == 0) return absl::UnavailableError("every worker is gone");
      // kReadyByDeadline: the oldest partial batch, if any worker arrived.
      BatchSlot* oldest = nullptr;
      if (policy == BatchPolicy::kReadyByDeadline) {
        for (uint32_t i = 0; i < slots_.size(); ++i) {
          BatchSlot& s = *slots_[i];
          if (s.state == BatchState::kCollecting &&
              (oldest == nullptr || s.opened_sequence < oldest->opened_sequence)) {
            oldest = &s;
            index = i;
          }
        }
      }
      if (oldest == nullptr) {
        return absl::DeadlineExceededError(
            absl::StrCat("no batch within ", absl::FormatDuration(timeout)));
      }
    }
    BatchSlot& slot = *slots_[index];
    slot.state = BatchState::kHandedOut;
    slot.handler_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
    slot.workers.clear();
    slot.pull_keys.clear();
    for (int w = 0; w < options_.num_workers; ++w) {
      if (!slot.entries[w].present) continue;
      slot.workers.push_back(w);
      slot.pull_keys.push_back(slot.entries[w].pull_key);
    }
    Batch batch;
    batch.handle = BatchHandle(index, slot.generation);
    batch.group = slot.group;
    batch.workers = slot.workers;
    batch.tensors = slot.tensors;
    batch.pull_keys = slot.pull_keys;
    return batch;
  }

  absl::Status StreamWaitNextBatch(Stream& stream) override {
    if (stopped()) return absl::FailedPreconditionError("server is shut down");
    return stream.WaitHostFlagNext(*batches_ready_, *batch_cursor_);
  }

  absl::Status Respond(const Batch& batch, absl::Span<const Reply> replies,
                       const SendOptions& send_options) override {
    if (stopped()) return absl::FailedPreconditionError("server is shut down");
    const BatchHandle handle = batch.handle;
    if (!handle.valid() || handle.index() >= slots_.size()) {
      return absl::InvalidArgumentError("invalid batch handle");
    }
    ::stepmesh::core::ReaderMutexLock reg_lock(&reg_mu_);
    ::stepmesh::core::MutexLock lock(&batch_mu_);
    BatchSlot& slot = *slots_[handle.index()];
    if (slot.generation != handle.generation() || slot.state != BatchState::kHandedOut) {
      return absl::FailedPreconditionError("batch already answered (or handle is stale)");
    }
    // Validate everything first: a failed Respond sends nothing.
    for (size_t i = 0; i < replies.size(); ++i) {
      const Reply& reply = replies[i];
      if (reply.worker < 0 || reply.worker >= options_.num_workers ||
          !slot.entries[reply.worker].present) {
        return absl::InvalidArgumentError(
            absl::StrCat("reply to worker ", reply.worker, " which is not in this batch"));
      }
      for (size_t j = 0; j < i; ++j) {
        if (replies[j].worker == reply.worker) {
          return absl::InvalidArgumentError(absl::StrCat("two replies to worker ", reply.worker));
        }
      }
      const WorkerEntry& e = slot.entries[reply.worker];
      if (e.pull_key == Batch::kNoPull) {
        return absl::InvalidArgumentError(
            absl::StrCat("worker ", reply.worker, " pulled nothing from this server"));
      }
      auto it = reply_regs_.find(e.pull_key);
      if (it == reply_regs_.end()) {
        return absl::NotFoundError(absl::StrCat("worker ", reply.worker, " pulls key ",
                                                e.pull_key, ", which has no reply tensor here"));
      }
      const size_t bytes = reply.bytes == kWholeTensor ? it->second->slot_bytes : reply.bytes;
      if (bytes > it->second->slot_bytes) {
        return absl::OutOfRangeError(absl::StrCat("reply of ", bytes, " bytes exceeds the ",
                                                  it->second->slot_bytes, "-byte slot of key ",
                                                  e.pull_key));
      }
    }
    for (int w : slot.workers) {
      if (slot.entries[w].pull_key == Batch::kNoPull) continue;
      bool answered = false;
      for (const Reply& reply : replies) answered = answered || reply.worker == w;
      if (!answered) {
        return absl::InvalidArgumentError(
            absl::StrCat("worker ", w, " pulls key ", slot.entries[w].pull_key, " but got no reply"));
      }
    }
    for (int w : slot.workers) slot.entries[w].reply = nullptr;
    for (const Reply& reply : replies) {
      WorkerEntry& e = slot.entries[reply.worker];
      e.reply = reply_regs_.find(e.pull_key)->second.get();
      e.reply_bytes = reply.bytes == kWholeTensor ? e.reply->slot_bytes : reply.bytes;
    }
    slot.state = BatchState::kResponding;
    absl::Status queued =
        EnqueueSend({kSendReplies, handle.index(), handle.generation(), send_options.ready});
    if (!queued.ok()) slot.state = BatchState::kHandedOut;  // the caller may retry
    return queued;
  }

  absl::Status Barrier() override { return rendezvous_->Barrier(options_.timeout); }

  absl::Status Shutdown() override {
    Stop();
    return absl::OkStatus();
  }

 private:
  int live_workers() const {
    int n = 0;
    for (int w = 0; w < options_.num_workers; ++w) n += !lost_workers_[w].load();
    return n;
  }

  // --- send thread ---
  void ExecuteSend(const SendItem& item, const absl::Status& ready) override {
    if (item.kind == kSendError) {
      SendError(item.index);
      return;
    }
    BatchSlot& slot = *slots_[item.index];
    const uint64_t reply_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
    // Server s starts with the s-th worker (a rotation), so that no worker is
    // every server's last: with every server starting at worker 0, the last
    // worker always waits for all the others' replies, and its next push
    // holds up every server's next batch.
    const size_t n = slot.workers.size();
    for (size_t i = 0; i < n; ++i) {
      const int w = slot.workers[(i + static_cast<size_t>(rank_)) % n];
      WorkerEntry& e = slot.entries[w];
      // Free the worker's receive slots first: its next push may follow our reply at once.
      for (size_t t = 0; t < slot.regs.size(); ++t) {
        if (e.pushed_mask & (1u << t)) slot.regs[t]->busy[w].store(false);
      }
      if (lost_workers_[w].load()) continue;
      FrameHeader h;
      h.src = self_;
      h.dst = PeerId(w);
      h.request_id = e.request_id;
      h.stamps = e.stamps;
      h.stamps.server_handler_ns = slot.handler_ns;
      h.stamps.server_reply_ns = reply_ns;
      absl::Status sent;
      if (!ready.ok()) {
        h.type = FrameType::kError;
        h.status_code = static_cast<uint32_t>(ready.code());
        const std::string text = absl::StrCat("reply's ready event failed: ", ready.message());
        h.payload_bytes = std::min<size_t>(text.size(), 4096);
        sent = transport_->Send(h.dst, h, text.data(), 0, h.payload_bytes);
      } else {
        h.type = FrameType::kReply;
        const std::byte* src = nullptr;
        RegionId region = 0;
        if (e.reply != nullptr) {
          h.key = e.pull_key;
          h.dtype = e.reply->view.dtype;
          h.payload_bytes = e.reply_bytes;
          const size_t offset = w * e.reply->slot_bytes;
          src = e.reply->wire.wire + offset;
          region = e.reply->wire.region;
          sent = StageOut(e.reply->wire, e.reply->view.data, offset, e.reply_bytes);
          SealPayload(h, e.reply->wire, src);
        }
        if (sent.ok()) sent = transport_->Send(h.dst, h, src, region, h.payload_bytes);
      }
      if (!sent.ok()) {
        STEPMESH_LOG(kWarning, "server ", rank_, ": reply to worker ", w, " failed: ",
                     sent.ToString());
      }
    }
    ::stepmesh::core::MutexLock lock(&batch_mu_);
    FreeSlot(item.index);
  }

  void SendError(uint32_t index) {
    ErrorRecord record;
    {
      ::stepmesh::core::MutexLock lock(&error_mu_);
      record = std::move(errors_[index]);
    }
    FrameHeader h;
    h.type = FrameType::kError;
    h.src = self_;
    h.dst = record.worker;
    h.request_id = record.request_id;
    h.status_code = static_cast<uint32_t>(record.code);
    h.payload_bytes = std::min<size_t>(record.message.size(), 4096);
    absl::Status sent = transport_->Send(h.dst, h, record.message.data(), 0, h.payload_bytes);
    if (!sent.ok()) STEPMESH_LOG(kWarning, "error frame not delivered: ", sent.ToString());
  }

  // --- receive thread ---
  absl::StatusOr<Destination> Resolve(NodeId peer, const FrameHeader& h) override {
    const uint32_t w = NodeRank(peer);
    if (NodeRole(peer) != 1 || w >= static_cast<uint32_t>(options_.num_workers)) {
      return absl::PermissionDeniedError("push from a node that is not a worker");
    }
    ForgetPreviousProcess(static_cast<int>(w));
    ::stepmesh::core::ReaderMutexLock lock(&reg_mu_);
    auto it = recv_regs_.find(h.key);
    if (it == recv_regs_.end()) {
      return absl::NotFoundError(
          absl::StrCat("push key ", h.key, " is not registered on server ", rank_));
    }
    RecvRegistration& reg = *it->second;
    if (h.dtype != reg.view.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "push dtype ", DTypeName(h.dtype), " under key ", h.key, " but server ", rank_,
          " registered ", DTypeName(reg.view.dtype)));
    }
    if (h.payload_bytes > reg.slot_bytes) {
      return absl::OutOfRangeError(absl::StrCat("push of ", h.payload_bytes, " bytes under key ",
                                                h.key, " exceeds server ", rank_, "'s ",
                                                reg.slot_bytes, "-byte slot"));
    }
    if (reg.busy[w].exchange(true)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "push under key ", h.key, " while the previous one is still being processed"));
    }
    return Destination{reg.wire.wire + w * reg.slot_bytes, reg.slot_bytes, reg.wire.region};
  }

  void OnFrame(NodeId peer, const FrameHeader& h, absl::Status status) override {
    MarkActivity();
    if (h.type != FrameType::kPush) return;
    const int w = static_cast<int>(NodeRank(peer));
    if (NodeRole(peer) != 1 || w >= options_.num_workers) return;
    ForgetPreviousProcess(w);
    Assembly* a = FindAssembly(w, h);
    if (a == nullptr) {
      QueueError(peer, h.request_id,
                 absl::ResourceExhaustedError("too many requests in flight from this worker"));
      return;
    }
    if (!status.ok()) {
      if (!a->failed) QueueError(peer, h.request_id, status);
      a->failed = true;
    } else {
      // The group (micro-batch name) is the request's first push key.
      if (h.part_index == 0) a->group = h.key;
      RecvRegistration* reg = nullptr;
      {
        ::stepmesh::core::ReaderMutexLock lock(&reg_mu_);
        auto it = recv_regs_.find(h.key);
        if (it != recv_regs_.end()) reg = it->second.get();
      }
      if (reg == nullptr || a->num_keys == kMaxPushesPerRequest) {
        if (!a->failed) {
          QueueError(peer, h.request_id, absl::FailedPreconditionError("key unregistered mid-request"));
        }
        a->failed = true;
      } else {
        a->keys[a->num_keys] = h.key;
        a->bytes[a->num_keys] = h.payload_bytes;
        a->regs[a->num_keys] = reg;
        ++a->num_keys;  // even if damaged: the slot is released with the request
        if (absl::Status intact = CheckPayload(h, reg->wire, reg->wire.wire + w * reg->slot_bytes);
            !intact.ok()) {
          if (!a->failed) QueueError(peer, h.request_id, intact);
          a->failed = true;
        }
      }
      a->stamps.enqueue_ns = h.stamps.enqueue_ns;
      a->stamps.post_ns = h.stamps.post_ns;
      a->stamps.server_arrival_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
    }
    if (++a->parts_done < a->part_count) return;
    for (int i = 0; i < a->num_keys && !a->failed; ++i) {
      // Staged regions: move the worker's bytes from the wire copy to the tensor.
      const RecvRegistration& reg = *a->regs[i];
      if (absl::Status s = StageIn(reg.wire, reg.view.data, w * reg.slot_bytes, a->bytes[i]);
          !s.ok()) {
        QueueError(peer, h.request_id, s);
        a->failed = true;
      }
    }
    if (a->failed) {
      for (int i = 0; i < a->num_keys; ++i) a->regs[i]->busy[w].store(false);
    } else {
      AddToBatch(w, *a);
    }
    a->used = false;
  }

  // Receive thread, before any frame of worker `w`: once a restarted `w`
  // rejoined, drops what its previous process left half-received (request ids
  // restart with the process) and frees the receive slots those pushes held.
  // Slots held by batches the application has not answered stay held.
  void ForgetPreviousProcess(int w) {
    const uint32_t epoch = worker_epochs_[w].load(std::memory_order_acquire);
    if (seen_epochs_[w] == epoch) return;
    seen_epochs_[w] = epoch;
    for (Assembly& a : assemblies_[w]) a.used = false;
    std::vector<const RecvRegistration*> held;
    {
      ::stepmesh::core::MutexLock lock(&batch_mu_);
      for (const auto& slot : slots_) {
        if (slot->state == BatchState::kFree || !slot->entries[w].present) continue;
        for (size_t t = 0; t < slot->regs.size(); ++t) {
          if (slot->entries[w].pushed_mask & (1u << t)) held.push_back(slot->regs[t]);
        }
      }
    }
    // Only this thread sets busy flags, so none can become held meanwhile.
    ::stepmesh::core::ReaderMutexLock lock(&reg_mu_);
    for (auto& [key, reg] : recv_regs_) {
      if (std::find(held.begin(), held.end(), reg.get()) == held.end()) reg->busy[w].store(false);
    }
  }

  Assembly* FindAssembly(int w, const FrameHeader& h) {
    Assembly* spare = nullptr;
    for (Assembly& a : assemblies_[w]) {
      if (a.used && a.request_id == h.request_id) return &a;
      if (!a.used && spare == nullptr) spare = &a;
    }
    if (spare == nullptr) return nullptr;
    *spare = Assembly{};
    spare->used = true;
    spare->request_id = h.request_id;
    spare->part_count = h.part_count;
    spare->pull_key = (h.flags & kFlagHasPull) ? h.pull_key : Batch::kNoPull;
    return spare;
  }

  void AddToBatch(int w, const Assembly& a) {
    ::stepmesh::core::MutexLock lock(&batch_mu_);
    BatchSlot* slot = nullptr;
    uint32_t index = 0;
    for (uint32_t i = 0; i < slots_.size(); ++i) {
      BatchSlot& s = *slots_[i];
      if (s.state == BatchState::kCollecting && s.group == a.group && !s.entries[w].present) {
        slot = &s;
        index = i;
        break;
      }
    }
    if (slot == nullptr) {
      if (free_slots_.empty()) {
        for (int i = 0; i < a.num_keys; ++i) a.regs[i]->busy[w].store(false);
        QueueError(PeerId(w), a.request_id,
                   absl::ResourceExhaustedError("server has too many batches open"));
        return;
      }
      index = free_slots_.back();
      free_slots_.pop_back();
      slot = slots_[index].get();
      slot->generation = slot->generation == UINT32_MAX ? 1 : slot->generation + 1;
      slot->state = BatchState::kCollecting;
      slot->opened_sequence = ++opened_sequence_;
      slot->group = a.group;
      slot->tensors.clear();
      slot->regs.clear();
      for (WorkerEntry& e : slot->entries) e = WorkerEntry{};
    }
    WorkerEntry& e = slot->entries[w];
    e.present = true;
    e.request_id = a.request_id;
    e.pull_key = a.pull_key;
    e.stamps = a.stamps;
    for (int i = 0; i < a.num_keys; ++i) {
      size_t t = 0;
      while (t < slot->tensors.size() && slot->tensors[t].key != a.keys[i]) ++t;
      if (t == slot->tensors.size()) {
        if (t == kMaxPushesPerRequest) continue;  // cannot happen: a request has at most that many
        std::fill(slot->valid[t].begin(), slot->valid[t].end(), 0);
        BatchTensor tensor;
        tensor.key = a.keys[i];
        tensor.region = a.regs[i]->view;
        tensor.slot_bytes = a.regs[i]->slot_bytes;
        tensor.valid_bytes = slot->valid[t];
        slot->tensors.push_back(tensor);
        slot->regs.push_back(a.regs[i]);
      }
      slot->valid[t][w] = a.bytes[i];
      e.pushed_mask |= 1u << t;
    }
    MaybeReady(index);
  }

  void MaybeReady(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(batch_mu_) {
    BatchSlot& slot = *slots_[index];
    if (slot.state != BatchState::kCollecting) return;
    for (int w = 0; w < options_.num_workers; ++w) {
      if (!slot.entries[w].present && !lost_workers_[w].load()) return;
    }
    slot.state = BatchState::kReady;
    ready_.push_back(index);
    ready_count_.fetch_add(1, std::memory_order_seq_cst);
    // Its data is in the receive tensors (staged in, or flushed): a stream
    // waiting for the next batch may go (StreamWaitNextBatch).
    batches_ready_->Store(++batches_counted_);
    NotifyWaiters();
  }

  void FreeSlot(uint32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(batch_mu_) {
    slots_[index]->state = BatchState::kFree;
    free_slots_.push_back(index);
  }

  void QueueError(NodeId worker, uint64_t request_id, const absl::Status& status) {
    uint32_t index;
    {
      ::stepmesh::core::MutexLock lock(&error_mu_);
      index = static_cast<uint32_t>(next_error_++ % errors_.size());
      errors_[index] = {worker, request_id, status.code(), std::string(status.message())};
    }
    STEPMESH_LOG(kInfo, "server ", rank_, ": rejecting request from worker ", NodeRank(worker),
                 ": ", status.ToString());
    if (absl::Status s = EnqueueSend({kSendError, index, 0, nullptr}); !s.ok()) {
      STEPMESH_LOG(kWarning, "cannot report an error to worker ", NodeRank(worker), ": ",
                   s.ToString());
    }
  }

  void HandlePeerLost(NodeId peer, const absl::Status& why) override {
    if (NodeRole(peer) != 1) return;
    const int w = static_cast<int>(NodeRank(peer));
    if (w >= options_.num_workers || lost_workers_[w].exchange(true)) return;
    STEPMESH_LOG(kInfo, "server ", rank_, ": worker ", w, " gone: ", why.ToString());
    ::stepmesh::core::MutexLock lock(&batch_mu_);
    for (uint32_t i = 0; i < slots_.size(); ++i) {
      BatchSlot& slot = *slots_[i];
      if (slot.state != BatchState::kCollecting) continue;
      // Its pushes in batches not yet handed out can never be answered: drop them.
      WorkerEntry& e = slot.entries[w];
      if (e.present) {
        for (size_t t = 0; t < slot.regs.size(); ++t) {
          if (!(e.pushed_mask & (1u << t))) continue;
          slot.valid[t][w] = 0;
          slot.regs[t]->busy[w].store(false);
        }
        e = WorkerEntry{};
        bool anyone = false;
        for (const WorkerEntry& other : slot.entries) anyone = anyone || other.present;
        if (!anyone) {
          FreeSlot(i);
          continue;
        }
      }
      // Batches that waited only for this worker are complete now.
      MaybeReady(i);
    }
    NotifyWaiters();
  }

  // A restarted attention process rejoined under the same rank: accept its
  // connection and count it in batches again. Requests of its previous process
  // were dropped when that was lost; its registrations are the new process's own.
  void HandlePeerJoined(NodeId peer, const std::string& endpoint) override {
    if (NodeRole(peer) != 1 || stopped()) return;
    const int w = static_cast<int>(NodeRank(peer));
    if (w >= options_.num_workers) return;
    // A worker that never looked lost (its old connection still open) is superseded.
    HandlePeerLost(peer, absl::UnavailableError("worker restarted"));
    worker_epochs_[w].fetch_add(1, std::memory_order_acq_rel);
    // Counted before its connection exists, so no batch forms without it meanwhile.
    lost_workers_[w].store(false, std::memory_order_release);
    absl::Status connected =
        transport_->Connect(self_, {PeerInfo{peer, endpoint}}, absl::Now() + options_.timeout);
    if (!connected.ok()) {
      HandlePeerLost(peer, connected);
      STEPMESH_LOG(kWarning, "server ", rank_, ": rejoined worker ", w, " never connected: ",
                   connected.ToString());
      return;
    }
    STEPMESH_LOG(kInfo, "server ", rank_, ": worker ", w, " rejoined at ", endpoint);
  }

  void CancelAll(const absl::Status&) override {
    ::stepmesh::core::MutexLock lock(&batch_mu_);
    ready_.clear();
    ready_count_.store(0);
    // No batch comes any more: streams waiting for one must not wait forever.
    if (batches_ready_ != nullptr) batches_ready_->ReleaseWaiters();
  }

  absl::StatusOr<size_t> SlotBytes(const TensorView& region, absl::string_view what) const {
    if (region.data == nullptr || region.bytes() == 0) {
      return absl::InvalidArgumentError(absl::StrCat("cannot register an empty ", what, " tensor"));
    }
    const int64_t rows = region.shape.rank() > 0 ? region.shape[0] : 1;
    if (rows % options_.num_workers != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " tensor's first dimension ", rows, " is not a multiple of num_workers ",
          options_.num_workers, " (one equal slot per worker)"));
    }
    return region.bytes() / options_.num_workers;
  }

  absl::Status CheckNewKey(Key key, bool exists, absl::string_view what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg_mu_) {
    if (exists) {
      return absl::AlreadyExistsError(absl::StrCat(what, " key ", key, " already registered"));
    }
    if (recv_regs_.size() + reply_regs_.size() >= static_cast<size_t>(options_.max_registrations)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("registration limit ", options_.max_registrations, " reached"));
    }
    return absl::OkStatus();
  }

  ::stepmesh::core::Mutex reg_mu_;
  absl::flat_hash_map<Key, std::unique_ptr<RecvRegistration>> recv_regs_ ABSL_GUARDED_BY(reg_mu_);
  absl::flat_hash_map<Key, std::unique_ptr<ReplyRegistration>> reply_regs_
      ABSL_GUARDED_BY(reg_mu_);

  std::vector<std::vector<Assembly>> assemblies_;  // receive thread only
  std::unique_ptr<std::atomic<bool>[]> lost_workers_;
  // Bumped when a worker's new process rejoins; the receive thread compares.
  std::unique_ptr<std::atomic<uint32_t>[]> worker_epochs_;
  std::vector<uint32_t> seen_epochs_;  // receive thread only

  ::stepmesh::core::Mutex batch_mu_;
  std::vector<std::unique_ptr<BatchSlot>> slots_;
  std::vector<uint32_t> free_slots_ ABSL_GUARDED_BY(batch_mu_);
  std::vector<uint32_t> ready_ ABSL_GUARDED_BY(batch_mu_);
  std::atomic<int> ready_count_{0};
  uint64_t opened_sequence_ ABSL_GUARDED_BY(batch_mu_) = 0;
  // Batches that became ready, for StreamWaitNextBatch, and its device cursor.
  std::unique_ptr<HostFlag> batches_ready_;
  std::unique_ptr<HostFlag> batch_cursor_;
  uint32_t batches_counted_ ABSL_GUARDED_BY(batch_mu_) = 0;

  ::stepmesh::core::Mutex error_mu_;
  std::vector<ErrorRecord> errors_ ABSL_GUARDED_BY(error_mu_);
  uint64_t next_error_ ABSL_GUARDED_BY(error_mu_) = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AFTensorServer>> CreateServer(const MeshOptions& options,
                                                             std::shared_ptr<Backend> backend,
                                                             const TransportFactory& transport) {
  MeshOptions server_options = options;
  server_options.role = Role::kServer;
  STEPMESH_RETURN_IF_ERROR(server_options.Validate());
  if (backend == nullptr) {
    STEPMESH_ASSIGN_OR_RETURN(backend, CreateBackend(options));
  }
  auto server = std::make_unique<Server>(server_options, std::move(backend));
  STEPMESH_RETURN_IF_ERROR(server->Init(transport));
  return server;
}

}  // namespace stepmesh::core

namespace stepmesh {

absl::StatusOr<std::unique_ptr<AFTensorServer>> AFTensorServer::Create(
    const MeshOptions& options, std::shared_ptr<Backend> backend) {
  return core::CreateServer(options, std::move(backend), core::CreateTransport);
}

}  // namespace stepmesh
