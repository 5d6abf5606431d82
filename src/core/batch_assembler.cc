#include "src/core/batch_assembler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace stepmesh::core {

BatchSlot::BatchSlot(int num_workers)
    : entries(num_workers), valid(kMaxPushesPerRequest, std::vector<size_t>(num_workers, 0)) {
  workers.reserve(num_workers);
  pull_keys.reserve(num_workers);
  tensors.reserve(kMaxPushesPerRequest);
  regs.reserve(kMaxPushesPerRequest);
}

void BatchSlot::ReleaseReceiveSlots(int w) {
  for (size_t t = 0; t < regs.size(); ++t) {
    if (entries[w].pushed_mask & (1u << t)) regs[t]->busy[w].store(false);
  }
}

BatchAssembler::BatchAssembler(int num_workers, const LostPeers& lost, bool trace)
    : num_workers_(num_workers),
      lost_(lost),
      trace_(trace),
      assemblies_(num_workers, std::vector<Assembly>(kAssembliesPerWorker)),
      excuses_(num_workers),
      awaited_after_(num_workers, 0),
      late_(num_workers) {
  for (int i = 0; i < kBatchSlots; ++i) {
    slots_.push_back(std::make_unique<BatchSlot>(num_workers));
    free_slots_.push_back(kBatchSlots - 1 - i);
  }
  ready_.reserve(kBatchSlots);
}

// ---- receive thread ----

Assembly* BatchAssembler::FindAssembly(int w, const FrameHeader& h) {
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
  spare->pull_key = (h.flags & kFlagHasPull) ? h.pull_key : kNoPull;
  return spare;
}

BatchAssembler::Arrival BatchAssembler::AddPart(int w, const FrameHeader& h, RecvRegistration* reg,
                                                const absl::Status& status) {
  Arrival out;
  Assembly* a = FindAssembly(w, h);
  if (a == nullptr) {
    if (reg != nullptr) reg->busy[w].store(false);
    out.report = absl::ResourceExhaustedError("too many requests in flight from this worker");
    return out;
  }
  const auto fail = [&](const absl::Status& why) {
    if (!a->failed) out.report = why;
    a->failed = true;
  };
  // The group (micro-batch name) is the request's stage when it names one,
  // else its first push key, also for a part that failed: a refused request
  // excuses its worker from that batch.
  if (h.part_index == 0) a->group = (h.flags & kFlagStage) ? Key{h.status_code} : h.key;
  if (!status.ok()) {
    if (reg != nullptr) reg->busy[w].store(false);
    fail(status);
  } else if (a->num_keys == kMaxPushesPerRequest) {
    reg->busy[w].store(false);
    fail(absl::InvalidArgumentError(
        absl::StrCat("more than ", kMaxPushesPerRequest, " pushes in one request")));
  } else {
    a->keys[a->num_keys] = h.key;
    a->bytes[a->num_keys] = h.payload_bytes;
    a->regs[a->num_keys] = reg;
    ++a->num_keys;
    a->stamps.enqueue_ns = h.stamps.enqueue_ns;
    a->stamps.post_ns = h.stamps.post_ns;
    a->stamps.server_arrival_ns = trace_ ? MonotonicNowNs() : 0;
  }
  if (++a->parts_done < a->part_count) return out;
  if (a->failed) {
    out.ready = Abandon(w, *a);
  } else {
    out.complete = a;
  }
  return out;
}

bool BatchAssembler::Abandon(int w, Assembly& a) {
  for (int i = 0; i < a.num_keys; ++i) a.regs[i]->busy[w].store(false);
  a.used = false;
  return Excuse(w, a.group);
}

bool BatchAssembler::Excuse(int w, Key group) {
  base::MutexLock lock(&mu_);
  BatchSlot* oldest = nullptr;
  uint32_t index = 0;
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    BatchSlot& s = *slots_[i];
    if (s.state != BatchState::kCollecting || s.group != group) continue;
    const WorkerEntry& e = s.entries[w];
    if (e.present || e.excused) continue;
    if (oldest == nullptr || s.opened_sequence < oldest->opened_sequence) {
      oldest = &s;
      index = i;
    }
  }
  if (oldest != nullptr) {
    oldest->entries[w].excused = true;
    return MaybeReady(index);
  }
  PendingExcuses& p = excuses_[w];
  if (p.count == kPendingExcuses) {
    std::move(p.groups.begin() + 1, p.groups.end(), p.groups.begin());  // the oldest goes
    --p.count;
  }
  p.groups[p.count++] = group;
  return false;
}

bool BatchAssembler::TakePendingExcuse(int w, Key group) {
  PendingExcuses& p = excuses_[w];
  for (int i = 0; i < p.count; ++i) {
    if (p.groups[i] != group) continue;
    std::move(p.groups.begin() + i + 1, p.groups.begin() + p.count, p.groups.begin() + i);
    --p.count;
    return true;
  }
  return false;
}

absl::Status BatchAssembler::Commit(int w, Assembly& a, bool* ready) {
  *ready = false;
  base::MutexLock lock(&mu_);
  BatchSlot* slot = nullptr;
  uint32_t index = 0;
  // The oldest batch of the group still waiting for `w`: with two open (a
  // worker ahead of the others opened the second), joining a younger one
  // first would leave each waiting for a worker that waits on the other.
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    BatchSlot& s = *slots_[i];
    if (s.state == BatchState::kCollecting && s.group == a.group && !s.entries[w].present &&
        !s.entries[w].excused && (slot == nullptr || s.opened_sequence < slot->opened_sequence)) {
      slot = &s;
      index = i;
    }
  }
  // `w` is back in this group: an excuse of its still pending is spent.
  TakePendingExcuse(w, a.group);
  // A joiner's request whose batch already went without it: handed out alone.
  const bool first = awaited_after_[w] == kAwaitAfterFirst;
  uint64_t late_seq = 0;
  const bool late = awaited_after_[w] != 0 && awaited_after_[w] != kAwaitNever &&
                    TakeLate(w, a.group, /*newest=*/first, &late_seq);
  if (late) slot = nullptr;
  if (slot == nullptr) slot = OpenSlot(a.group, w, &index);
  if (slot != nullptr && late) {
    for (int o = 0; o < num_workers_; ++o) slot->entries[o].excused = o != w;
  }
  if (first && slot != nullptr) {
    // Batches opened from now on wait for it; notes of batches older than
    // the one this request belongs to are of steps it did not take part in.
    const uint64_t anchor = late ? late_seq : slot->opened_sequence;
    LateNotes& notes = late_[w];
    int kept = 0;
    for (int i = 0; i < notes.count; ++i) {
      if (notes.notes[i].seq > anchor) notes.notes[kept++] = notes.notes[i];
    }
    notes.count = kept;
    awaited_after_[w] = opened_sequence_;
  }
  if (slot == nullptr) {
    for (int i = 0; i < a.num_keys; ++i) a.regs[i]->busy[w].store(false);
    a.used = false;
    return absl::ResourceExhaustedError("server has too many batches open");
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
  a.used = false;
  *ready = MaybeReady(index);
  return absl::OkStatus();
}

BatchSlot* BatchAssembler::OpenSlot(Key group, int opener, uint32_t* index) {
  if (free_slots_.empty()) return nullptr;
  *index = free_slots_.back();
  free_slots_.pop_back();
  BatchSlot* slot = slots_[*index].get();
  slot->generation = slot->generation == UINT32_MAX ? 1 : slot->generation + 1;
  slot->state = BatchState::kCollecting;
  slot->opened_sequence = ++opened_sequence_;
  slot->group = group;
  slot->tensors.clear();
  slot->regs.clear();
  for (int w = 0; w < num_workers_; ++w) {
    slot->entries[w] = WorkerEntry{};
    // A worker whose request for this group was refused before any batch of
    // it was open: this batch goes without it.
    if (w != opener && excuses_[w].count > 0)
      slot->entries[w].excused = TakePendingExcuse(w, group);
  }
  return slot;
}

bool BatchAssembler::MaybeReady(uint32_t index) {
  BatchSlot& slot = *slots_[index];
  if (slot.state != BatchState::kCollecting) return false;
  for (int w = 0; w < num_workers_; ++w) {
    const WorkerEntry& e = slot.entries[w];
    if (!e.present && !e.excused && !lost_.lost(w) && awaited_after_[w] < slot.opened_sequence) {
      return false;
    }
  }
  slot.state = BatchState::kReady;
  NoteLate(slot);
  ready_.push_back(index);
  ready_count_.fetch_add(1, std::memory_order_seq_cst);
  // Its data is in the receive tensors (staged in, or flushed): a stream
  // waiting for the next batch may go.
  if (ready_counter_ != nullptr) ready_counter_->Store(++batches_counted_);
  return true;
}

std::vector<const RecvRegistration*> BatchAssembler::ForgetWorker(int w) {
  for (Assembly& a : assemblies_[w]) a.used = false;
  std::vector<const RecvRegistration*> held;
  base::MutexLock lock(&mu_);
  excuses_[w] = PendingExcuses{};  // the previous process's refusals
  for (const auto& slot : slots_) {
    if (slot->state == BatchState::kFree || !slot->entries[w].present) continue;
    for (size_t t = 0; t < slot->regs.size(); ++t) {
      if (slot->entries[w].pushed_mask & (1u << t)) held.push_back(slot->regs[t]);
    }
  }
  return held;
}

// ---- any thread ----

std::optional<Batch> BatchAssembler::TakeReady() {
  base::MutexLock lock(&mu_);
  if (ready_.empty()) return std::nullopt;
  const uint32_t index = ready_.front();
  ready_.erase(ready_.begin());
  ready_count_.fetch_sub(1);
  return HandOut(index);
}

std::optional<Batch> BatchAssembler::TakeOldestPartial() {
  base::MutexLock lock(&mu_);
  const BatchSlot* oldest = nullptr;
  uint32_t index = 0;
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    const BatchSlot& s = *slots_[i];
    if (s.state == BatchState::kCollecting &&
        (oldest == nullptr || s.opened_sequence < oldest->opened_sequence)) {
      oldest = &s;
      index = i;
    }
  }
  if (oldest == nullptr) return std::nullopt;
  NoteLate(*slots_[index]);
  return HandOut(index);
}

Batch BatchAssembler::HandOut(uint32_t index) {
  BatchSlot& slot = *slots_[index];
  slot.state = BatchState::kHandedOut;
  slot.handler_ns = trace_ ? MonotonicNowNs() : 0;
  slot.workers.clear();
  slot.pull_keys.clear();
  for (int w = 0; w < num_workers_; ++w) {
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

void BatchAssembler::Release(uint32_t index) {
  base::MutexLock lock(&mu_);
  FreeSlot(index);
}

void BatchAssembler::FreeSlot(uint32_t index) {
  slots_[index]->state = BatchState::kFree;
  free_slots_.push_back(index);
}

bool BatchAssembler::ReplySourceInUse(const ReplyRegistration* reg) {
  base::MutexLock lock(&mu_);
  for (const auto& slot : slots_) {
    if (slot->state != BatchState::kResponding) continue;
    for (const WorkerEntry& e : slot->entries) {
      if (e.reply == reg) return true;
    }
  }
  return false;
}

bool BatchAssembler::PullKeyAwaited(Key key) {
  base::MutexLock lock(&mu_);
  for (const auto& slot : slots_) {
    if (slot->state == BatchState::kFree) continue;
    for (const WorkerEntry& e : slot->entries) {
      if (e.present && e.pull_key == key) return true;
    }
  }
  return false;
}

void BatchAssembler::DropWorker(int w) {
  base::MutexLock lock(&mu_);
  excuses_[w] = PendingExcuses{};
  late_[w] = LateNotes{};
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    BatchSlot& slot = *slots_[i];
    if (slot.state != BatchState::kCollecting) continue;
    WorkerEntry& e = slot.entries[w];
    if (e.present) {
      for (size_t t = 0; t < slot.regs.size(); ++t) {
        if (e.pushed_mask & (1u << t)) slot.valid[t][w] = 0;
      }
      slot.ReleaseReceiveSlots(w);
      e = WorkerEntry{};
      bool anyone = false;
      for (const WorkerEntry& other : slot.entries) anyone = anyone || other.present;
      if (!anyone) {
        FreeSlot(i);
        continue;
      }
    }
    MaybeReady(i);
  }
}

void BatchAssembler::NoteLate(const BatchSlot& slot) {
  for (int w = 0; w < num_workers_; ++w) {
    const uint64_t after = awaited_after_[w];
    // Only joiners: live, not awaited by this batch, and not gone for good.
    if (after == 0 || after == kAwaitNever || after < slot.opened_sequence) continue;
    if (slot.entries[w].present || lost_.lost(w)) continue;
    LateNotes& notes = late_[w];
    if (notes.count == kLateNotes) {
      std::move(notes.notes.begin() + 1, notes.notes.end(), notes.notes.begin());
      --notes.count;
    }
    notes.notes[notes.count++] = LateNote{slot.group, slot.opened_sequence};
  }
}

bool BatchAssembler::TakeLate(int w, Key group, bool newest, uint64_t* seq) {
  LateNotes& notes = late_[w];
  int at = -1;
  for (int i = 0; i < notes.count; ++i) {
    if (notes.notes[i].group != group) continue;
    at = i;
    if (!newest) break;
  }
  if (at < 0) return false;
  *seq = notes.notes[at].seq;
  std::move(notes.notes.begin() + at + 1, notes.notes.begin() + notes.count,
            notes.notes.begin() + at);
  --notes.count;
  return true;
}

void BatchAssembler::AwaitAfterFirstRequest(int w) {
  base::MutexLock lock(&mu_);
  awaited_after_[w] = kAwaitAfterFirst;
  late_[w] = LateNotes{};
}

bool BatchAssembler::StopAwaiting(int w) {
  base::MutexLock lock(&mu_);
  awaited_after_[w] = kAwaitNever;
  bool ready = false;
  for (uint32_t i = 0; i < slots_.size(); ++i) ready |= MaybeReady(i);
  return ready;
}

bool BatchAssembler::NothingToHandOut() {
  base::MutexLock lock(&mu_);
  for (const auto& slot : slots_) {
    if (slot->state == BatchState::kCollecting || slot->state == BatchState::kReady) return false;
  }
  return true;
}

bool BatchAssembler::MoreThanOneToHandOut() {
  base::MutexLock lock(&mu_);
  if (ready_.size() > 1) return true;
  for (const auto& slot : slots_) {
    if (slot->state == BatchState::kCollecting) return true;
  }
  return false;
}

bool BatchAssembler::Idle() {
  base::MutexLock lock(&mu_);
  return free_slots_.size() == slots_.size();
}

void BatchAssembler::ClearReady() {
  base::MutexLock lock(&mu_);
  ready_.clear();
  ready_count_.store(0);
  // No batch comes any more: streams waiting for one must not wait forever.
  if (ready_counter_ != nullptr) ready_counter_->ReleaseWaiters();
}

}  // namespace stepmesh::core
