// The batch assembler's membership rules (src/core/batch_assembler.h) on
// their own: a joiner is awaited from its first request on, a joiner's
// request whose batch already went is handed out alone, a fenced worker is
// awaited by none. Hand-made frame headers, no transport, no threads.

#include <catch2/catch.hpp>
#include <cstddef>
#include <initializer_list>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "src/core/batch_assembler.h"

namespace stepmesh::core {
namespace {

struct Region {
  Region(Key key, int num_workers, size_t slot_bytes) : key(key), memory(num_workers * slot_bytes) {
    reg.view = BytesView(memory.data(), memory.size());
    reg.wire.wire = memory.data();
    reg.slot_bytes = slot_bytes;
    reg.busy.reset(new std::atomic<bool>[num_workers]);
    for (int w = 0; w < num_workers; ++w) reg.busy[w] = false;
  }
  Key key;
  std::vector<std::byte> memory;
  RecvRegistration reg;
};

// Worker `w`'s one-part request `request` under `region`'s key, committed.
bool Deliver(BatchAssembler& assembler, int w, uint64_t request, Region& region) {
  FrameHeader h;
  h.type = FrameType::kPush;
  h.src = WorkerId(w);
  h.request_id = request;
  h.key = region.key;
  h.part_count = 1;
  h.payload_bytes = 8;
  REQUIRE_FALSE(region.reg.busy[w].exchange(true));
  BatchAssembler::Arrival arrival = assembler.AddPart(w, h, &region.reg, absl::OkStatus());
  REQUIRE(arrival.complete != nullptr);
  bool ready = false;
  REQUIRE(assembler.Commit(w, *arrival.complete, &ready).ok());
  return ready;
}

std::vector<int> Workers(const Batch& batch) {
  return std::vector<int>(batch.workers.begin(), batch.workers.end());
}

void Answer(BatchAssembler& assembler, const Batch& batch) {
  uint32_t index = ~0u;
  REQUIRE(assembler
              .Respond(batch.handle,
                       [&](BatchSlot&, uint32_t i) {
                         index = i;
                         return absl::OkStatus();
                       })
              .ok());
  for (int w : batch.workers) assembler.responding(index).ReleaseReceiveSlots(w);
  assembler.Release(index);
}

// An assembler for `kWorkers` workers, with regions for keys 10 and 11.
template <int kWorkers>
struct Assembly {
  LostPeers lost{kWorkers};
  BatchAssembler assembler{kWorkers, lost, /*trace=*/false};
  Region a{10, kWorkers, 64};
  Region b{11, kWorkers, 64};

  struct Step {
    int worker;
    uint64_t request;
    Region* region;
    bool completes;  // the batch this part joins is then ready
  };
  // Delivers each step's one-part request in order, checking each outcome.
  void DeliverInOrder(std::initializer_list<Step> steps) {
    for (const Step& s : steps) {
      INFO("worker " << s.worker << ", request " << s.request << ", key " << s.region->key);
      CHECK(Deliver(assembler, s.worker, s.request, *s.region) == s.completes);
    }
  }
};

TEST_CASE_METHOD(Assembly<2>,
                 "membership: a joiner is awaited only by batches opened after its first request",
                 "[membership][assembler]") {
  assembler.AwaitAfterFirstRequest(1);  // worker 1 joined the running mesh
  // Worker 0 alone: worker 1 has sent nothing yet, so nobody waits for it.
  CHECK(Deliver(assembler, 0, 1, a));
  std::optional<Batch> first = assembler.TakeReady();
  REQUIRE(first.has_value());
  CHECK(Workers(*first) == std::vector<int>{0});
  Answer(assembler, *first);
  // Its request for the batch that went without it: handed out alone at once.
  CHECK(Deliver(assembler, 1, 1, a));
  std::optional<Batch> alone = assembler.TakeReady();
  REQUIRE(alone.has_value());
  CHECK(Workers(*alone) == std::vector<int>{1});
  Answer(assembler, *alone);
  // From now on both are awaited.
  CHECK_FALSE(Deliver(assembler, 0, 2, a));
  CHECK(Deliver(assembler, 1, 2, a));
  std::optional<Batch> both = assembler.TakeReady();
  REQUIRE(both.has_value());
  CHECK(Workers(*both) == std::vector<int>{0, 1});
  CHECK(assembler.Idle() == false);
  Answer(assembler, *both);
  CHECK(assembler.Idle());
}

TEST_CASE_METHOD(Assembly<3>,
                 "membership: a joiner's first request before the others' joins their batch",
                 "[membership][assembler]") {
  assembler.AwaitAfterFirstRequest(2);
  // The joiner is first: its batch waits for the two members.
  DeliverInOrder({{2, 1, &a, false}, {0, 1, &a, false}, {1, 1, &a, true}});
  std::optional<Batch> batch = assembler.TakeReady();
  REQUIRE(batch.has_value());
  CHECK(Workers(*batch) == std::vector<int>{0, 1, 2});
  // The next stage's batch, opened after, waits for the joiner too.
  DeliverInOrder({{0, 2, &b, false}, {1, 2, &b, false}, {2, 2, &b, true}});
}

TEST_CASE_METHOD(Assembly<2>,
                 "membership: a batch opened before the joiner's first request forms without it",
                 "[membership][assembler]") {
  assembler.AwaitAfterFirstRequest(1);
  // Worker 0 is a stage ahead: both its batches form before the joiner sent.
  DeliverInOrder({{0, 1, &a, true}, {0, 2, &b, true}});
  // The joiner's stage a and then stage b: each batch already went, so alone.
  DeliverInOrder({{1, 1, &a, true}, {1, 2, &b, true}});
  for (Key group : {Key{10}, Key{11}}) {
    std::optional<Batch> ahead = assembler.TakeReady();
    REQUIRE(ahead.has_value());
    CHECK(Workers(*ahead) == std::vector<int>{0});
    CHECK(ahead->group == group);
  }
  for (Key group : {Key{10}, Key{11}}) {
    std::optional<Batch> late = assembler.TakeReady();
    REQUIRE(late.has_value());
    CHECK(Workers(*late) == std::vector<int>{1});
    CHECK(late->group == group);
  }
}

TEST_CASE_METHOD(Assembly<3>, "membership: a fenced worker is awaited by no batch",
                 "[membership][assembler]") {
  CHECK_FALSE(Deliver(assembler, 0, 1, a));
  CHECK_FALSE(assembler.NothingToHandOut());
  // Worker 1's fence: the collecting batch stops waiting for it.
  CHECK_FALSE(assembler.StopAwaiting(1));  // worker 2 is still awaited
  CHECK(assembler.StopAwaiting(2));
  std::optional<Batch> batch = assembler.TakeReady();
  REQUIRE(batch.has_value());
  CHECK(Workers(*batch) == std::vector<int>{0});
  CHECK(assembler.NothingToHandOut());
  CHECK_FALSE(assembler.Idle());  // handed out, not answered
  Answer(assembler, *batch);
  CHECK(assembler.Idle());
}

}  // namespace
}  // namespace stepmesh::core
