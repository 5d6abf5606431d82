// Every injected fault ends in a clear status on exactly the affected request,
// never a hang past the deadline, never an abort, never bytes in the wrong tensor.

#include <algorithm>
#include <catch2/catch.hpp>
#include <initializer_list>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "tests/reliability/fault_transport.h"
#include "tests/reliability/harness.h"
#include "tests/support/status.h"
#include "tests/support/transport_table.h"

namespace stepmesh::testing {
namespace {

using core::FrameType;

constexpr core::NodeId kWorker0 = core::WorkerId(0);
constexpr core::NodeId kWorker1 = core::WorkerId(1);
constexpr core::NodeId kServer0 = core::ServerId(0);
constexpr core::NodeId kServer1 = core::ServerId(1);

// The table's rows; with `wire`, those whose wire the fault proxy reaches.
std::vector<TransportCase> Rows(bool wire) {
  std::vector<TransportCase> rows;
  for (TransportCase& row : TransportTable()) {
    if (!wire || row.wire_faults) rows.push_back(std::move(row));
  }
  return rows;
}

// `row`'s transport with the plan's faults (the byte-level ones where they reach the wire).
core::TransportFactory FaultyFor(const TransportCase& row, std::shared_ptr<FaultPlan> plan) {
  return Faulty(row.make().factory, std::move(plan), row.wire_faults);
}

using Plan = std::shared_ptr<FaultPlan>;

// body(mesh, plan, row) for each row of Rows(wire), in a section named after
// the row: `mesh` has `workers` x `servers` over the row's transport with the
// faults of `plan`, which holds `rules`, and has started.
template <typename Body>
void ForEachRow(bool wire, std::initializer_list<FaultRule> rules, Body body, int workers = 1,
                int servers = 2) {
  for (const TransportCase& row : Rows(wire)) {
    DYNAMIC_SECTION(row.name) {
      auto plan = std::make_shared<FaultPlan>();
      for (const FaultRule& rule : rules) plan->Add(rule);
      Harness mesh(MeshConfig(row.transport, workers, servers), FaultyFor(row, plan));
      REQUIRE_OK(mesh.status());
      body(mesh, plan, row);
    }
  }
}

TEST_CASE("fault: a clean run through the decorator is byte-exact", "[fault]") {
  ForEachRow(/*wire=*/false, {},
             [&](Harness& mesh, const Plan& plan, const TransportCase& row) {
               for (int i = 0; i < 20; ++i) {
                 // Both workers must push before a batch forms: start both, then finish both.
                 const uint8_t f0 = static_cast<uint8_t>(i * 3),
                               f1 = static_cast<uint8_t>(i * 3 + 1);
                 auto h0 = mesh.Start(0, i % 2, f0);
                 auto h1 = mesh.Start(1, i % 2, f1);
                 REQUIRE(h0.ok());
                 REQUIRE(h1.ok());
                 REQUIRE_OK(mesh.Finish(0, i % 2, *h0, f0, absl::Seconds(5)));
                 REQUIRE_OK(mesh.Finish(1, i % 2, *h1, f1, absl::Seconds(5)));
               }
               CHECK(mesh.server_errors().empty());
             },
             2, 2);
}

TEST_CASE("fault: a dropped push fails only its request, at its deadline", "[fault]") {
  ForEachRow(/*wire=*/false,
             {{.action = FaultAction::kDrop, .type = FrameType::kPush, .to = kServer1}},
             [&](Harness& mesh, const Plan& plan, const TransportCase& row) {
               std::fill(mesh.pull(0, 0, 1).begin(), mesh.pull(0, 0, 1).end(), 0xEE);
               auto h = mesh.Start(0, 0, 1);
               REQUIRE(h.ok());
               const absl::Time start = absl::Now();
               const absl::Status s = mesh.Finish(0, 0, *h, 1, absl::Milliseconds(500));
               CHECK(absl::IsDeadlineExceeded(s));
               CHECK(absl::Now() - start < absl::Seconds(2));
               CHECK(plan->fired(FaultAction::kDrop) == 1);
               // Server 1 never saw it, so its pull tensor was never written.
               CHECK(std::all_of(mesh.pull(0, 0, 1).begin(), mesh.pull(0, 0, 1).end(),
                                 [](uint8_t b) { return b == 0xEE; }));
               // Other keys and the same servers keep working.
               REQUIRE_OK(mesh.RoundTrip(0, 1, 9));
             });
}

TEST_CASE("fault: a delayed frame only delays", "[fault]") {
  const FaultRule slow_reply{.action = FaultAction::kDelay,
                             .type = FrameType::kReply,
                             .from = kServer0,
                             .delay = absl::Milliseconds(300)};
  ForEachRow(/*wire=*/false, {slow_reply},
             [&](Harness& mesh, const Plan& plan, const TransportCase& row) {
               const absl::Time start = absl::Now();
               REQUIRE_OK(mesh.RoundTrip(0, 0, 3));
               CHECK(absl::Now() - start >= absl::Milliseconds(290));
               REQUIRE_OK(mesh.RoundTrip(0, 0, 4));
             });
}

TEST_CASE("fault: a duplicated reply is dropped, the request's data is exact", "[fault]") {
  ForEachRow(/*wire=*/false,
             {{.action = FaultAction::kDuplicate,
               .type = FrameType::kReply,
               .from = kServer1,
               .count = 3}},
             [&](Harness& mesh, const Plan& plan, const TransportCase& row) {
               for (int i = 0; i < 6; ++i)
                 REQUIRE_OK(mesh.RoundTrip(0, i % 2, static_cast<uint8_t>(i)));
               CHECK(plan->fired(FaultAction::kDuplicate) == 3);
             });
}

TEST_CASE("fault: a duplicated push fails at most its own request", "[fault]") {
  ForEachRow(/*wire=*/false,
             {{.action = FaultAction::kDuplicate, .type = FrameType::kPush, .to = kServer0}},
             [&](Harness& mesh, const Plan& plan, const TransportCase& row) {
               // The copy carries the original's request id: the server drops it,
               // whenever it arrives, and the original's reply answers the request.
               REQUIRE_OK(mesh.RoundTrip(0, 0, 5));
               // The premise: the copy really went out (else this tests nothing).
               REQUIRE(plan->fired(FaultAction::kDuplicate) == 1);
               // No pause: neither the copy nor a batch of it holds the key's slot.
               for (int i = 0; i < 4; ++i)
                 REQUIRE_OK(mesh.RoundTrip(0, i % 2, static_cast<uint8_t>(20 + i)));
             });
}

// The copy of a push reaches the server while it still serves the original.
// It must not end the request early: the worker would free the key's tensors
// while the server still holds its slot (its next push under the key was
// refused) and, over RDMA, the original's reply would still land in the pull
// tensor afterwards. The copy is dropped; the original's reply answers.
TEST_CASE("fault: a push copied while its original is served leaves the request to it", "[fault]") {
  ForEachRow(
      /*wire=*/false,
      {{.action = FaultAction::kDuplicate, .type = FrameType::kPush, .to = kServer0}},
      [&](Harness& mesh, const Plan& plan, const TransportCase& row) {
        mesh.HoldReplies(true);
        auto h = mesh.Start(0, 0, 5, {0});
        REQUIRE(h.ok());
        // Server 0 took the original and has both frames in hand.
        const absl::Time until = absl::Now() + absl::Seconds(10);
        while ((mesh.held_batches() < 1 || plan->delivered(kServer0) < 2) && absl::Now() < until) {
          absl::SleepFor(absl::Milliseconds(1));
        }
        REQUIRE(mesh.held_batches() == 1);
        REQUIRE(plan->delivered(kServer0) == 2);
        CHECK(plan->fired(FaultAction::kDuplicate) == 1);
        // Unanswered, so still pending (an error frame for the copy would end it here).
        const absl::Status early = mesh.worker(0).Wait(*h, absl::Milliseconds(300));
        INFO(early.ToString());
        CHECK(absl::IsDeadlineExceeded(early));
        mesh.HoldReplies(false);
        if (absl::IsDeadlineExceeded(early))
          REQUIRE_OK(mesh.Finish(0, 0, *h, 5, absl::Seconds(5), {0}));
        // The key is free at once on both sides: no wait before the next request.
        for (int i = 0; i < 4; ++i)
          REQUIRE_OK(mesh.RoundTrip(0, i % 2, static_cast<uint8_t>(20 + i)));
        CHECK(mesh.held_batches() == 1);
        CHECK(mesh.server_errors().empty());
      });
}

// Worker 0's request to both servers fails UNAVAILABLE (its link to one of
// them is gone); a round trip with the other, server `other` alone, works.
void LosesOneServer(Harness& mesh, int other) {
  auto h = mesh.Start(0, 0, 1);
  REQUIRE(h.ok());
  const absl::Status s = mesh.Finish(0, 0, *h, 1, absl::Seconds(5));
  INFO(s.ToString());
  CHECK(absl::IsUnavailable(s));
  REQUIRE_OK(mesh.RoundTrip(0, 1, 2, absl::Seconds(5), {other}));
}

TEST_CASE("fault: a corrupted header is caught by the frame CRC", "[fault]") {
  SECTION("reply from a server") {
    ForEachRow(
        /*wire=*/true,
        {{.action = FaultAction::kCorruptHeader, .type = FrameType::kReply, .from = kServer1}},
        [&](Harness& mesh, const Plan& plan, const TransportCase& row) {
          std::fill(mesh.pull(0, 0, 1).begin(), mesh.pull(0, 0, 1).end(), 0xEE);
          auto h = mesh.Start(0, 0, 1);
          REQUIRE(h.ok());
          const absl::Status s = mesh.Finish(0, 0, *h, 1, absl::Seconds(5));
          INFO(s.ToString());
          CHECK(absl::IsUnavailable(s));
          CHECK(std::string(s.message()).find("checksum") != std::string::npos);
          CHECK(std::all_of(mesh.pull(0, 0, 1).begin(), mesh.pull(0, 0, 1).end(),
                            [](uint8_t b) { return b == 0xEE; }));
          // The pair's connection is gone for good; the other server still serves.
          CHECK(absl::IsUnavailable(mesh.Start(0, 1, 2).status()));
          REQUIRE_OK(mesh.RoundTrip(0, 1, 2, absl::Seconds(5), {0}));
        });
  }
  SECTION("push from a worker") {
    ForEachRow(
        /*wire=*/true,
        {{.action = FaultAction::kCorruptHeader, .type = FrameType::kPush, .to = kServer0}},
        [&](Harness& mesh, const Plan& plan, const TransportCase& row) {
          LosesOneServer(mesh, 1);
        });
  }
}

TEST_CASE("fault: a truncated frame (sender dies mid-frame) loses the peer", "[fault]") {
  ForEachRow(
      /*wire=*/true,
      {{.action = FaultAction::kTruncate, .type = FrameType::kReply, .from = kServer1}},
      [&](Harness& mesh, const Plan& plan, const TransportCase& row) { LosesOneServer(mesh, 0); });
}

TEST_CASE("fault: payload corruption is caught only with payload_checksum", "[fault]") {
  for (const TransportCase& row : Rows(/*wire=*/true)) {
    DYNAMIC_SECTION(row.name) {
      for (const FrameType type : {FrameType::kReply, FrameType::kPush}) {
        for (const bool checksum : {false, true}) {
          INFO((type == FrameType::kReply ? "a reply" : "a push")
               << " corrupted on the wire, payload_checksum " << checksum);
          auto plan = std::make_shared<FaultPlan>();
          plan->Add({.action = FaultAction::kCorruptPayload, .type = type});
          HarnessConfig config = MeshConfig(row.transport);
          config.options.payload_checksum = checksum;
          Harness mesh(config, FaultyFor(row, plan));
          REQUIRE_OK(mesh.status());
          const absl::Status s = mesh.RoundTrip(0, 0, 1);
          INFO(s.ToString());
          CHECK(absl::IsDataLoss(s));
          // Off: frames carry a header CRC only, the request "succeeds" and only the
          // harness's own byte check sees the damage. On: the receiver fails it.
          CHECK((s.message().find("payload checksum mismatch") != absl::string_view::npos) ==
                checksum);
          for (int i = 0; i < 5; ++i)
            REQUIRE_OK(mesh.RoundTrip(0, i % 2, static_cast<uint8_t>(2 + i)));
        }
      }
    }
  }
}

TEST_CASE("fault: a reply under another key never lands in that key's tensor", "[fault]") {
  ForEachRow(/*wire=*/false,
             {{.action = FaultAction::kRewriteKey,
               .type = FrameType::kReply,
               .from = kServer0,
               .new_key = RelPullKey(1)}},
             [&](Harness& mesh, const Plan& plan, const TransportCase& row) {
               std::fill(mesh.pull(0, 1, 0).begin(), mesh.pull(0, 1, 0).end(), 0xEE);
               std::fill(mesh.pull(0, 1, 1).begin(), mesh.pull(0, 1, 1).end(), 0xEE);
               const absl::Status s = mesh.RoundTrip(0, 0, 1);
               INFO(s.ToString());
               if (!row.payload_lands_first) {
                 CHECK(absl::IsInvalidArgument(s));
                 CHECK(std::all_of(mesh.pull(0, 1, 0).begin(), mesh.pull(0, 1, 0).end(),
                                   [](uint8_t b) { return b == 0xEE; }));
               } else {
                 // KNOWN LIMITATION of RDMA: the payload is written into the region the
                 // header names before the receiver sees the header, so the bytes DO land
                 // in key 201's pull tensor for server 0 -- a region this worker
                 // registered for server 0's writes, so still "only where that peer may
                 // write", but not the addressed tensor. The request reports the mismatch.
                 CHECK_FALSE(s.ok());
               }
               // Server 1's tensor of that key is untouched either way.
               CHECK(std::all_of(mesh.pull(0, 1, 1).begin(), mesh.pull(0, 1, 1).end(),
                                 [](uint8_t b) { return b == 0 || b == 0xEE; }));
               REQUIRE_OK(mesh.RoundTrip(0, 1, 2));
               REQUIRE_OK(mesh.RoundTrip(0, 0, 3));
             });
}

TEST_CASE("fault: a worker cannot write into another worker's slot (forged sender)",
          "[fault][security]") {
  ForEachRow(
      /*wire=*/false,
      {{.action = FaultAction::kForgeSource,
        .type = FrameType::kPush,
        .from = kWorker0,
        .to = kServer0,
        .new_src = kWorker1}},
      [&](Harness& mesh, const Plan& plan, const TransportCase& row) {
        std::vector<uint8_t>& recv = mesh.recv(0, 0);
        std::fill(recv.begin(), recv.end(), 0xEE);
        auto h0 = mesh.Start(0, 0, 0x33);  // forged: claims to be worker 1
        REQUIRE(h0.ok());
        const absl::Status s = mesh.Finish(0, 0, *h0, 0x33, absl::Seconds(5));
        INFO(s.ToString());
        CHECK(absl::IsUnavailable(s));  // the server dropped the lying connection
        // Worker 1's slot holds nothing of worker 0's forged data.
        const size_t half = recv.size() / 2;
        CHECK(std::all_of(recv.begin() + half, recv.end(), [](uint8_t b) { return b == 0xEE; }));
        // Worker 1 keeps working alone.
        REQUIRE_OK(mesh.RoundTrip(1, 1, 0x44));
      },
      2, 1);
}

TEST_CASE("fault: a stalled server costs deadlines, then traffic resumes", "[fault]") {
  ForEachRow(/*wire=*/false, {}, [&](Harness& mesh, const Plan& plan, const TransportCase& row) {
    REQUIRE_OK(mesh.RoundTrip(0, 0, 1));
    plan->Stall(kServer1, absl::Milliseconds(1500));
    absl::SleepFor(absl::Milliseconds(150));  // its receive thread leaves the poll it is in
    auto h = mesh.Start(0, 0, 2);
    REQUIRE(h.ok());
    const absl::Status early = mesh.worker(0).Wait(*h, absl::Milliseconds(300));
    INFO(early.ToString());
    REQUIRE(absl::IsDeadlineExceeded(early));
    // Still pending (not failed): it completes once the stall ends.
    REQUIRE_OK(mesh.Finish(0, 0, *h, 2, absl::Seconds(5)));
    REQUIRE_OK(mesh.RoundTrip(0, 1, 3));
  });
}

TEST_CASE("fault: a server whose link dies fails only requests that address it", "[fault]") {
  ForEachRow(/*wire=*/false,
             {{.action = FaultAction::kKill, .type = FrameType::kReply, .from = kServer1}},
             [&](Harness& mesh, const Plan& plan, const TransportCase& row) {
               const absl::Time start = absl::Now();
               const absl::Status s = mesh.RoundTrip(0, 0, 1);
               INFO(s.ToString());
               CHECK(absl::IsUnavailable(s));
               CHECK(absl::Now() - start < absl::Seconds(3));
               REQUIRE_OK(mesh.RoundTrip(0, 1, 2, absl::Seconds(5), {0}));
               CHECK(absl::IsUnavailable(mesh.Start(0, 1, 3, {1}).status()));
             });
}

TEST_CASE("fault: a refused connection fails creation cleanly, within the timeout", "[fault]") {
  for (const TransportCase& row : Rows(/*wire=*/false)) {
    DYNAMIC_SECTION(row.name) {
      auto plan = std::make_shared<FaultPlan>();
      plan->RefuseConnect(kWorker0);
      HarnessConfig c = MeshConfig(row.transport, 1, 1);
      c.options.timeout = absl::Seconds(2);
      const absl::Time start = absl::Now();
      Harness mesh(c, FaultyFor(row, plan));
      INFO(mesh.status().ToString());
      CHECK_FALSE(mesh.status().ok());
      CHECK((absl::IsUnavailable(mesh.status()) || absl::IsDeadlineExceeded(mesh.status())));
      CHECK(absl::Now() - start < absl::Seconds(8));
    }
  }
}

}  // namespace
}  // namespace stepmesh::testing
