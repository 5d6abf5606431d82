// The server's batch assembler on its own: assembly of multi-part requests,
// the batch slot states, the deadline policy and cleanup when a worker is
// lost, driven by hand-made frame headers (no transport, no threads).

#include "src/core/batch_assembler.h"

#include <catch2/catch.hpp>
#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"

namespace stepmesh::core {
namespace {

// A receive region of `num_workers` slots of `slot_bytes`, none busy.
struct Region {
  Region(Key key, int num_workers, size_t slot_bytes) : memory(num_workers * slot_bytes) {
    reg.view = BytesView(memory.data(), memory.size());
    reg.wire.wire = memory.data();
    reg.slot_bytes = slot_bytes;
    reg.busy.reset(new std::atomic<bool>[num_workers]);
    for (int w = 0; w < num_workers; ++w) reg.busy[w] = false;
    this->key = key;
  }
  // What Resolve does before a push lands: reserve worker w's slot.
  RecvRegistration* Reserve(int w) {
    REQUIRE_FALSE(reg.busy[w].exchange(true));
    return &reg;
  }
  bool busy(int w) const { return reg.busy[w].load(); }

  Key key = 0;
  std::vector<std::byte> memory;
  RecvRegistration reg;
};

FrameHeader Push(int w, uint64_t request, Key key, uint16_t part, uint16_t parts, size_t bytes = 8,
                 Key pull = kNoPull) {
  FrameHeader h;
  h.type = FrameType::kPush;
  h.src = WorkerId(w);
  h.request_id = request;
  h.key = key;
  h.part_index = part;
  h.part_count = parts;
  h.payload_bytes = bytes;
  if (pull != kNoPull) {
    h.flags = kFlagHasPull;
    h.pull_key = pull;
  }
  return h;
}

// A whole request of worker `w` (one part per region), committed to its batch.
// Returns whether that made a batch ready.
bool Deliver(BatchAssembler& assembler, int w, uint64_t request, std::vector<Region*> parts,
             Key pull = kNoPull) {
  BatchAssembler::Arrival arrival;
  for (size_t i = 0; i < parts.size(); ++i) {
    arrival = assembler.AddPart(w,
                                Push(w, request, parts[i]->key, static_cast<uint16_t>(i),
                                     static_cast<uint16_t>(parts.size()), 8 + w, pull),
                                parts[i]->Reserve(w), absl::OkStatus());
    REQUIRE(arrival.report.ok());
    if (i + 1 < parts.size()) REQUIRE(arrival.complete == nullptr);
  }
  REQUIRE(arrival.complete != nullptr);
  bool ready = false;
  REQUIRE(assembler.Commit(w, *arrival.complete, &ready).ok());
  return ready;
}

// Answers a handed-out batch and lets its replies "go out".
void AnswerAndRelease(BatchAssembler& assembler, const Batch& batch) {
  uint32_t answered = ~0u;
  REQUIRE(assembler
              .Respond(batch.handle,
                       [&](BatchSlot& slot, uint32_t index) {
                         CHECK(slot.state == BatchState::kResponding);
                         answered = index;
                         return absl::OkStatus();
                       })
              .ok());
  BatchSlot& slot = assembler.responding(answered);
  for (int w : batch.workers) slot.ReleaseReceiveSlots(w);
  assembler.Release(answered);
}

TEST_CASE("assembler: a batch is ready once every live worker's request is complete",
          "[assembler]") {
  LostPeers lost(2);
  BatchAssembler assembler(2, lost, /*trace=*/false);
  Region a(10, 2, 64), b(11, 2, 64);

  CHECK_FALSE(Deliver(assembler, 0, 1, {&a, &b}, /*pull=*/7));
  CHECK_FALSE(assembler.HasReady());
  CHECK_FALSE(assembler.TakeReady().has_value());
  CHECK(Deliver(assembler, 1, 1, {&a, &b}));
  REQUIRE(assembler.HasReady());

  std::optional<Batch> batch = assembler.TakeReady();
  REQUIRE(batch.has_value());
  CHECK_FALSE(assembler.HasReady());
  CHECK(batch->group == 10);  // the first push key names the micro-batch
  REQUIRE(batch->workers.size() == 2);
  CHECK(batch->workers[0] == 0);
  CHECK(batch->workers[1] == 1);
  CHECK(batch->pull_keys[0] == 7);
  CHECK(batch->pull_keys[1] == kNoPull);
  REQUIRE(batch->tensors.size() == 2);
  CHECK(batch->tensors[0].key == 10);
  CHECK(batch->tensors[1].key == 11);
  CHECK(batch->tensors[0].valid_bytes[0] == 8);
  CHECK(batch->tensors[0].valid_bytes[1] == 9);
  CHECK(a.busy(0));
  CHECK(b.busy(1));

  AnswerAndRelease(assembler, *batch);
  CHECK_FALSE(a.busy(0));
  CHECK_FALSE(b.busy(1));
  // The handle went stale with the answer.
  CHECK(assembler.Respond(batch->handle, [](BatchSlot&, uint32_t) { return absl::OkStatus(); })
            .code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("assembler: requests of different groups fill different batches", "[assembler]") {
  LostPeers lost(2);
  BatchAssembler assembler(2, lost, false);
  Region a(10, 2, 64), b(20, 2, 64);
  Deliver(assembler, 0, 1, {&a});
  Deliver(assembler, 0, 2, {&b});  // a second micro-batch of worker 0
  Deliver(assembler, 1, 1, {&b});  // worker 1 starts with the second
  std::optional<Batch> first = assembler.TakeReady();
  REQUIRE(first.has_value());
  CHECK(first->group == 20);
  CHECK_FALSE(assembler.TakeReady().has_value());
  Deliver(assembler, 1, 2, {&a});
  std::optional<Batch> second = assembler.TakeReady();
  REQUIRE(second.has_value());
  CHECK(second->group == 10);
  CHECK(second->handle != first->handle);
}

TEST_CASE("assembler: a failed part fails the request once and frees its slots", "[assembler]") {
  LostPeers lost(1);
  BatchAssembler assembler(1, lost, false);
  Region a(10, 1, 64), b(11, 1, 64), c(12, 1, 64);

  BatchAssembler::Arrival first =
      assembler.AddPart(0, Push(0, 5, 10, 0, 3), a.Reserve(0), absl::OkStatus());
  CHECK(first.report.ok());
  BatchAssembler::Arrival bad =
      assembler.AddPart(0, Push(0, 5, 11, 1, 3), b.Reserve(0), absl::DataLossError("checksum"));
  CHECK(bad.report.code() == absl::StatusCode::kDataLoss);
  CHECK(bad.complete == nullptr);
  CHECK_FALSE(b.busy(0));  // the failed part's slot at once
  BatchAssembler::Arrival last = assembler.AddPart(0, Push(0, 5, 12, 2, 3), c.Reserve(0),
                                                   absl::InvalidArgumentError("second error"));
  CHECK(last.report.ok());  // reported once per request
  CHECK(last.complete == nullptr);
  CHECK_FALSE(a.busy(0));  // the rest when the request ends
  CHECK_FALSE(c.busy(0));
  CHECK_FALSE(assembler.HasReady());

  // The assembly is free again: the next request completes normally.
  CHECK(Deliver(assembler, 0, 6, {&a}));
}

// Worker `w`'s request `request` under `key`, refused on arrival (Resolve failed).
BatchAssembler::Arrival Refused(BatchAssembler& assembler, int w, uint64_t request, Key key) {
  return assembler.AddPart(w, Push(w, request, key, 0, 1), nullptr,
                           absl::NotFoundError("not registered"));
}

TEST_CASE("assembler: a refused request excuses its worker from the batch it would join",
          "[assembler][alone]") {
  LostPeers lost(3);
  BatchAssembler assembler(3, lost, false);
  Region r(10, 3, 64);
  CHECK_FALSE(Deliver(assembler, 0, 1, {&r}));
  CHECK_FALSE(Deliver(assembler, 2, 1, {&r}));
  // Worker 1's request for the group is refused: the batch goes without it.
  BatchAssembler::Arrival refused = Refused(assembler, 1, 1, 10);
  CHECK(refused.report.code() == absl::StatusCode::kNotFound);
  CHECK(refused.ready);
  std::optional<Batch> batch = assembler.TakeReady();
  REQUIRE(batch.has_value());
  CHECK(batch->workers == std::vector<int>{0, 2});
  AnswerAndRelease(assembler, *batch);
  // Its next request joins the next batch with everyone, as before.
  CHECK_FALSE(Deliver(assembler, 1, 2, {&r}));
  CHECK_FALSE(Deliver(assembler, 0, 2, {&r}));
  CHECK(Deliver(assembler, 2, 2, {&r}));
  batch = assembler.TakeReady();
  REQUIRE(batch.has_value());
  CHECK(batch->workers == std::vector<int>{0, 1, 2});
}

TEST_CASE("assembler: a refusal before its batch opened excuses the worker from the next one",
          "[assembler][alone]") {
  LostPeers lost(2);
  BatchAssembler assembler(2, lost, false);
  Region r(10, 2, 64), other(20, 2, 64);
  // Refused before anyone opened a batch of group 10.
  CHECK_FALSE(Refused(assembler, 1, 1, 10).ready);
  // Another group is not affected.
  CHECK_FALSE(Deliver(assembler, 0, 1, {&other}));
  // The next batch of group 10 goes without worker 1 ...
  CHECK(Deliver(assembler, 0, 2, {&r}));
  std::optional<Batch> batch = assembler.TakeReady();
  REQUIRE(batch.has_value());
  CHECK(batch->group == 10);
  CHECK(batch->workers == std::vector<int>{0});
  AnswerAndRelease(assembler, *batch);
  // ... and only that one.
  CHECK_FALSE(Deliver(assembler, 0, 3, {&r}));
  CHECK(Deliver(assembler, 1, 2, {&r}));
}

TEST_CASE("assembler: a worker back in its group spends its pending excuse", "[assembler][alone]") {
  LostPeers lost(2);
  BatchAssembler assembler(2, lost, false);
  Region r(10, 2, 64);
  CHECK_FALSE(Refused(assembler, 1, 1, 10).ready);
  // Worker 1 sends its next request before worker 0 sent the refused round's.
  CHECK_FALSE(Deliver(assembler, 1, 2, {&r}));
  CHECK(Deliver(assembler, 0, 1, {&r}));  // they pair up again
  std::optional<Batch> batch = assembler.TakeReady();
  REQUIRE(batch.has_value());
  CHECK(batch->workers == std::vector<int>{0, 1});
  AnswerAndRelease(assembler, *batch);
  CHECK_FALSE(Deliver(assembler, 0, 2, {&r}));  // no stale excuse makes worker 0 go alone
  CHECK(Deliver(assembler, 1, 3, {&r}));
}

TEST_CASE("assembler: with two batches of a group open, a worker joins the older",
          "[assembler][alone]") {
  LostPeers lost(2);
  BatchAssembler assembler(2, lost, false);
  Region a(1, 2, 64), b(2, 2, 64), g(10, 2, 64), g_next(10, 2, 64);
  // Recycle two batch slots so that the free one with the lower index is the
  // one taken second.
  CHECK_FALSE(Deliver(assembler, 0, 1, {&a}));
  CHECK(Deliver(assembler, 1, 1, {&a}));
  std::optional<Batch> first = assembler.TakeReady();
  CHECK_FALSE(Deliver(assembler, 0, 2, {&b}));
  CHECK(Deliver(assembler, 1, 2, {&b}));
  std::optional<Batch> second = assembler.TakeReady();
  REQUIRE((first.has_value() && second.has_value()));
  AnswerAndRelease(assembler, *first);
  AnswerAndRelease(assembler, *second);
  // Worker 0 runs a round ahead: two batches of group 10 open.
  CHECK_FALSE(Deliver(assembler, 0, 3, {&g}));
  CHECK_FALSE(Deliver(assembler, 0, 4, {&g_next}));
  // Worker 1's round 3 completes the older one (worker 0's round 3).
  CHECK(Deliver(assembler, 1, 3, {&g}));
  std::optional<Batch> batch = assembler.TakeReady();
  REQUIRE(batch.has_value());
  CHECK(batch->tensors[0].region.data == g.memory.data());
}

TEST_CASE("assembler: a request with more parts than a request may have is refused",
          "[assembler]") {
  LostPeers lost(1);
  BatchAssembler assembler(1, lost, false);
  std::vector<std::unique_ptr<Region>> regions;
  const uint16_t parts = kMaxPushesPerRequest + 1;
  BatchAssembler::Arrival arrival;
  int reports = 0;
  for (uint16_t i = 0; i < parts; ++i) {
    regions.push_back(std::make_unique<Region>(100 + i, 1, 16));
    arrival = assembler.AddPart(0, Push(0, 1, 100 + i, i, parts), regions.back()->Reserve(0),
                                absl::OkStatus());
    reports += !arrival.report.ok();
  }
  CHECK(reports == 1);
  CHECK(arrival.complete == nullptr);
  for (const auto& r : regions) CHECK_FALSE(r->busy(0));
}

TEST_CASE("assembler: a worker with too many requests half-received is refused", "[assembler]") {
  LostPeers lost(1);
  BatchAssembler assembler(1, lost, false);
  std::vector<std::unique_ptr<Region>> regions;
  for (int i = 0; i <= kAssembliesPerWorker; ++i) {
    regions.push_back(std::make_unique<Region>(100 + i, 1, 16));
    BatchAssembler::Arrival arrival = assembler.AddPart(
        0, Push(0, i, 100 + i, 0, 2), regions.back()->Reserve(0), absl::OkStatus());
    if (i < kAssembliesPerWorker) {
      CHECK(arrival.report.ok());
    } else {
      CHECK(arrival.report.code() == absl::StatusCode::kResourceExhausted);
      CHECK_FALSE(regions.back()->busy(0));
    }
  }
  // A restart drops them all (none is in a batch: nothing stays held).
  CHECK(assembler.ForgetWorker(0).empty());
  Region fresh(1, 1, 16);
  CHECK(Deliver(assembler, 0, 1000, {&fresh}));
}

TEST_CASE("assembler: every batch slot taken refuses a new group and frees its slots",
          "[assembler]") {
  LostPeers lost(2);
  BatchAssembler assembler(2, lost, false);
  std::vector<std::unique_ptr<Region>> regions;
  for (int i = 0; i < kBatchSlots; ++i) {
    regions.push_back(std::make_unique<Region>(100 + i, 2, 16));
    Deliver(assembler, 0, i, {regions.back().get()});  // each opens a batch, waiting for worker 1
  }
  Region extra(999, 2, 16);
  BatchAssembler::Arrival arrival =
      assembler.AddPart(0, Push(0, 999, 999, 0, 1), extra.Reserve(0), absl::OkStatus());
  REQUIRE(arrival.complete != nullptr);
  bool ready = true;
  CHECK(assembler.Commit(0, *arrival.complete, &ready).code() ==
        absl::StatusCode::kResourceExhausted);
  CHECK_FALSE(ready);
  CHECK_FALSE(extra.busy(0));
}

TEST_CASE("assembler: by deadline the oldest partial batch is handed out", "[assembler]") {
  LostPeers lost(3);
  BatchAssembler assembler(3, lost, false);
  Region a(10, 3, 16), b(20, 3, 16);
  Deliver(assembler, 1, 1, {&a});
  Deliver(assembler, 0, 1, {&b});
  Deliver(assembler, 2, 1, {&b});
  CHECK_FALSE(assembler.TakeReady().has_value());
  std::optional<Batch> partial = assembler.TakeOldestPartial();
  REQUIRE(partial.has_value());
  CHECK(partial->group == 10);  // opened first
  REQUIRE(partial->workers.size() == 1);
  CHECK(partial->workers[0] == 1);
  CHECK(partial->tensors[0].valid_bytes[0] == 0);  // absent workers have no bytes
  std::optional<Batch> next = assembler.TakeOldestPartial();
  REQUIRE(next.has_value());
  CHECK(next->group == 20);
  CHECK(next->workers.size() == 2);
  CHECK_FALSE(assembler.TakeOldestPartial().has_value());
}

TEST_CASE("assembler: a lost worker's pushes leave unanswered batches, which stop waiting",
          "[assembler]") {
  LostPeers lost(3);
  BatchAssembler assembler(3, lost, false);
  Region a(10, 3, 16), b(20, 3, 16);
  Deliver(assembler, 0, 1, {&a});
  Deliver(assembler, 1, 1, {&a});  // batch 10: workers 0 and 1, waiting for 2
  Deliver(assembler, 2, 1, {&b});  // batch 20: worker 2 only

  REQUIRE(lost.MarkLost(2));
  assembler.DropWorker(2);
  CHECK_FALSE(b.busy(2));  // batch 20 had only worker 2: gone, slot freed
  std::optional<Batch> batch = assembler.TakeReady();
  REQUIRE(batch.has_value());  // batch 10 waited only for worker 2
  CHECK(batch->group == 10);
  CHECK(batch->workers.size() == 2);
  CHECK_FALSE(assembler.TakeOldestPartial().has_value());

  // A handed-out batch keeps a lost worker's data until it is answered.
  REQUIRE(lost.MarkLost(1));
  assembler.DropWorker(1);
  CHECK(a.busy(1));
  AnswerAndRelease(assembler, *batch);
  CHECK_FALSE(a.busy(1));
}

TEST_CASE("assembler: a collecting batch drops a lost worker's bytes", "[assembler]") {
  LostPeers lost(3);
  BatchAssembler assembler(3, lost, false);
  Region a(10, 3, 16);
  Deliver(assembler, 0, 1, {&a});
  Deliver(assembler, 1, 1, {&a});
  REQUIRE(lost.MarkLost(1));
  assembler.DropWorker(1);
  CHECK_FALSE(a.busy(1));
  CHECK_FALSE(assembler.HasReady());  // still waits for worker 2
  Deliver(assembler, 2, 1, {&a});
  std::optional<Batch> batch = assembler.TakeReady();
  REQUIRE(batch.has_value());
  REQUIRE(batch->workers.size() == 2);
  CHECK(batch->workers[0] == 0);
  CHECK(batch->workers[1] == 2);
  CHECK(batch->tensors[0].valid_bytes[1] == 0);
}

TEST_CASE("assembler: a restarted worker's slots held by batches stay held", "[assembler]") {
  LostPeers lost(2);
  BatchAssembler assembler(2, lost, false);
  Region a(10, 2, 16), b(20, 2, 16);
  Deliver(assembler, 0, 1, {&a});  // in a collecting batch
  BatchAssembler::Arrival half =
      assembler.AddPart(0, Push(0, 2, 20, 0, 2), b.Reserve(0), absl::OkStatus());
  CHECK(half.complete == nullptr);  // half-received
  std::vector<const RecvRegistration*> held = assembler.ForgetWorker(0);
  REQUIRE(held.size() == 1);
  CHECK(held[0] == &a.reg);
}

TEST_CASE("assembler: a failed answer leaves the batch handed out", "[assembler]") {
  LostPeers lost(1);
  BatchAssembler assembler(1, lost, false);
  Region a(10, 1, 16);
  Deliver(assembler, 0, 1, {&a});
  std::optional<Batch> batch = assembler.TakeReady();
  REQUIRE(batch.has_value());
  CHECK(assembler
            .Respond(batch->handle,
                     [](BatchSlot&, uint32_t) { return absl::ResourceExhaustedError("full"); })
            .code() == absl::StatusCode::kResourceExhausted);
  CHECK(assembler.Respond(BatchHandle(), [](BatchSlot&, uint32_t) { return absl::OkStatus(); })
            .code() == absl::StatusCode::kInvalidArgument);
  ReplyRegistration source;
  AnswerAndRelease(assembler, *batch);  // the retry goes through
  CHECK_FALSE(assembler.ReplySourceInUse(&source));
}

TEST_CASE("assembler: a reply source is in use while its batch is being answered", "[assembler]") {
  LostPeers lost(1);
  BatchAssembler assembler(1, lost, false);
  Region a(10, 1, 16);
  Deliver(assembler, 0, 1, {&a}, /*pull=*/3);
  std::optional<Batch> batch = assembler.TakeReady();
  REQUIRE(batch.has_value());
  ReplyRegistration source;
  uint32_t index = 0;
  REQUIRE(assembler
              .Respond(batch->handle,
                       [&](BatchSlot& slot, uint32_t i) {
                         slot.entries[0].reply = &source;
                         index = i;
                         return absl::OkStatus();
                       })
              .ok());
  CHECK(assembler.ReplySourceInUse(&source));
  assembler.Release(index);
  CHECK_FALSE(assembler.ReplySourceInUse(&source));
}

TEST_CASE("assembler: shutdown clears the ready batches", "[assembler]") {
  LostPeers lost(1);
  BatchAssembler assembler(1, lost, false);
  Region a(10, 1, 16);
  Deliver(assembler, 0, 1, {&a});
  REQUIRE(assembler.HasReady());
  assembler.ClearReady();
  CHECK_FALSE(assembler.HasReady());
  CHECK_FALSE(assembler.TakeReady().has_value());
}

}  // namespace
}  // namespace stepmesh::core
