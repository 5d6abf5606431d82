// The worker's request table on its own: slots and their generations, the
// free list, settling per server, completion and handle lookups.

#include "src/core/request_table.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/cord.h"

namespace stepmesh::core {
namespace {

// Commits the next free slot as a request addressing `servers`.
RequestHandle Start(RequestTable& table, std::vector<int> servers) {
  Request* r = table.NextFree();
  REQUIRE(r != nullptr);
  std::fill(r->addressed.begin(), r->addressed.end(), 0);
  for (int s : servers) r->addressed[s] = 1;
  return table.Commit(static_cast<int>(servers.size()), /*enqueue_ns=*/0);
}

// The owner's completion, minus the registrations.
void SettleAndMaybeComplete(RequestTable& table, Request& r, int server,
                            const absl::Status& status) {
  if (table.Settle(r, server, status)) table.MarkDone(r, 1);
}

TEST_CASE("request table: a request completes when every server and the sender settled",
          "[requests]") {
  RequestTable table(4, 3, 1);
  const RequestHandle h = Start(table, {0, 2});
  absl::StatusOr<Request*> r = table.Lookup(h);
  REQUIRE(r.ok());
  CHECK((*r)->state.load() == RequestState::kPending);
  CHECK_FALSE(table.Settle(**r, 0, absl::OkStatus()));
  CHECK_FALSE(table.Settle(**r, 0, absl::OkStatus()));  // a duplicate does nothing
  CHECK_FALSE(table.Settle(**r, 2, absl::OkStatus()));
  CHECK(table.Release(**r));  // the send thread's reference was the last
  table.MarkDone(**r, 1);
  absl::Status result = absl::UnknownError("unset");
  REQUIRE(table.Collect(**r, &result).ok());
  CHECK(result.ok());
  CHECK(table.Collect(**r, &result).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(table.Lookup(h).status().code() == absl::StatusCode::kFailedPrecondition);
  table.Free(h.index());
}

TEST_CASE("request table: the first error is the request's result", "[requests]") {
  RequestTable table(1, 2, 1);
  const RequestHandle h = Start(table, {0, 1});
  Request& r = **table.Lookup(h);
  CHECK_FALSE(table.Release(r));
  SettleAndMaybeComplete(table, r, 1, absl::UnavailableError("server 1 lost"));
  SettleAndMaybeComplete(table, r, 0, absl::DataLossError("later"));
  CHECK(r.state.load() == RequestState::kDone);
  absl::Status result;
  REQUIRE(table.Collect(r, &result).ok());
  CHECK(result.code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("request table: slots run out, come back, and reuse bumps the generation", "[requests]") {
  RequestTable table(2, 1, 7);
  const RequestHandle a = Start(table, {0});
  const RequestHandle b = Start(table, {0});
  CHECK(table.NextFree() == nullptr);
  CHECK(a.index() != b.index());
  CHECK(a.generation() == 8);

  Request& r = **table.Lookup(a);
  table.FailIfOk(r, absl::CancelledError("gone"));
  table.MarkDone(r, 1);
  absl::Status result;
  REQUIRE(table.Collect(r, &result).ok());
  CHECK(result.code() == absl::StatusCode::kCancelled);
  table.Free(a.index());
  REQUIRE(table.NextFree() == &r);
  const RequestHandle again = Start(table, {0});
  CHECK(again.index() == a.index());
  CHECK(again.generation() == a.generation() + 1);
  CHECK(table.Lookup(a).status().code() == absl::StatusCode::kFailedPrecondition);  // stale
  CHECK(table.Lookup(again).ok());
}

TEST_CASE("request table: generations never reach 0 (an invalid handle)", "[requests]") {
  RequestTable table(1, 1, UINT32_MAX);
  const RequestHandle h = Start(table, {0});
  CHECK(h.generation() == 1);
  CHECK(h.valid());
}

TEST_CASE("request table: lookups refuse handles it never issued", "[requests]") {
  RequestTable table(2, 1, 1);
  CHECK(table.Lookup(RequestHandle()).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(table.Lookup(RequestHandle(5, 2)).status().code() == absl::StatusCode::kInvalidArgument);
  // A free slot at its current generation was never handed out.
  CHECK(table.Lookup(RequestHandle(0, 1)).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("request table: a reply finds its request only while the request awaits it",
          "[requests]") {
  RequestTable table(2, 3, 1);
  const RequestHandle h = Start(table, {1, 2});
  const uint64_t id = RequestId(h.index(), h.generation());
  absl::StatusOr<Request*> r = table.PendingFor(id, 1);
  REQUIRE(r.ok());
  CHECK(table.IsCurrent(**r, id));
  CHECK(table.PendingFor(id, 0).status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(table.PendingFor(RequestId(h.index(), h.generation() + 1), 1).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(table.PendingFor(RequestId(9, h.generation()), 1).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK_FALSE(table.Settle(**r, 1, absl::OkStatus()));
  CHECK(table.PendingFor(id, 1).status().code() == absl::StatusCode::kFailedPrecondition);

  std::vector<RequestHandle> pending = table.PendingAddressing(2);
  REQUIRE(pending.size() == 1);
  CHECK(pending[0] == h);
  CHECK(table.PendingAddressing(0).empty());
  CHECK(table.PendingAddressing(1).empty());  // server 1 replied: nothing of it is pending

  // Completed and reused: a frame resolved for the old request must not settle the new one.
  CHECK_FALSE(table.Settle(**r, 2, absl::OkStatus()));
  CHECK(table.Release(**r));
  table.MarkDone(**r, 1);
  absl::Status result;
  REQUIRE(table.Collect(**r, &result).ok());
  table.Free(h.index());
  const RequestHandle next = Start(table, {1});
  REQUIRE(next.index() == h.index());  // the free list is last in, first out
  CHECK_FALSE(table.IsCurrent(**r, id));
  CHECK(table.IsCurrent(**r, RequestId(next.index(), next.generation())));
}

// The receive thread settles a request with an error it built and drops its
// own copy of that error after the application has collected the result,
// dropped it and reused the slot. Nothing orders that last drop after the
// application's reads but the status's reference count, which Debian's
// Abseil keeps in code TSan does not see: the result must share no storage
// with the receive thread's copy (under TSan, sharing it is a reported race
// between the application's copy and the receive thread's delete). The
// hand-back below is a relaxed flag, which orders nothing for TSan either,
// as on the real path, where the receive thread's return from OnFrame is
// unordered with the application.
TEST_CASE("request table: a result shares nothing with the settling thread's status",
          "[requests]") {
  RequestTable table(1, 1, 1);
  const RequestHandle h = Start(table, {0});
  Request& r = **table.Lookup(h);
  CHECK_FALSE(table.Release(r));  // the send thread's reference
  std::atomic<bool> reused{false};
  std::thread receive([&] {
    absl::Status why = absl::DataLossError("server 0: checksum mismatch on key 7");
    why.SetPayload("stepmesh/test", absl::Cord("payload kept"));
    if (table.Settle(r, 0, why)) table.MarkDone(r, 1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!reused.load(std::memory_order_relaxed) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    // `why` goes out of scope here, after the application is done with the result.
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (r.state.load(std::memory_order_acquire) != RequestState::kDone &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  REQUIRE(r.state.load() == RequestState::kDone);
  {
    absl::Status result;
    REQUIRE(table.Collect(r, &result).ok());
    CHECK(result.code() == absl::StatusCode::kDataLoss);
    CHECK(result.message() == "server 0: checksum mismatch on key 7");
    const absl::optional<absl::Cord> payload = result.GetPayload("stepmesh/test");
    REQUIRE(payload.has_value());
    CHECK(*payload == "payload kept");
  }
  table.Free(h.index());
  Start(table, {0});  // resets the slot's result
  reused.store(true, std::memory_order_relaxed);
  receive.join();
}

}  // namespace
}  // namespace stepmesh::core
