// Stats(): the counters equal what the test sent (bytes, frames, requests, a
// request refused with OUT_OF_RANGE), on both ends; the histograms bucket as
// documented; PrometheusText parses back to the same values.

#include "stepmesh/stats.h"

#include <array>
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "src/compose/transports.h"
#include "src/core/scheduler_rendezvous.h"
#include "src/core/stats_recorder.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"
#include "tests/support/answering_servers.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

constexpr int kServers = 2;
constexpr int kRounds = 7;
constexpr size_t kPushBytes = 3000;   // per round, to each server
constexpr size_t kReplyBytes = 1000;  // per round, from each server
constexpr Key kPushKey = 1;
constexpr Key kReplyKey = 2;
constexpr Key kOversizeKey = 3;  // the worker's tensor is larger than server 0's slot
constexpr size_t kSlotBytes = 512;

const uint64_t& Outcome(const PeerStats& p, absl::StatusCode c) {
  return p.outcomes[static_cast<int>(c)];
}

// --- a Prometheus text parser: only what the exposition format allows ---
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};
struct Exposition {
  std::map<std::string, std::string> types;  // family -> TYPE
  std::map<std::string, std::string> helps;
  std::vector<Sample> samples;
  // The one sample named `name` whose labels include every pair of `want`.
  std::vector<const Sample*> Find(const std::string& name,
                                  const std::map<std::string, std::string>& want) const {
    std::vector<const Sample*> found;
    for (const Sample& s : samples) {
      if (s.name != name) continue;
      bool match = true;
      for (const auto& [k, v] : want) {
        auto it = s.labels.find(k);
        match = match && it != s.labels.end() && it->second == v;
      }
      if (match) found.push_back(&s);
    }
    return found;
  }
};

// Fails the test (with the offending line) on anything malformed.
Exposition Parse(const std::string& text) {
  Exposition e;
  REQUIRE(!text.empty());
  REQUIRE(text.back() == '\n');
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    INFO("line: " << line);
    if (line[0] == '#') {
      std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(' ', 3));
      REQUIRE(parts.size() == 4);
      if (parts[1] == "TYPE") {
        REQUIRE((parts[3] == "counter" || parts[3] == "gauge" || parts[3] == "histogram"));
        REQUIRE(e.types.count(parts[2]) == 0);
        e.types[parts[2]] = parts[3];
      } else {
        REQUIRE(parts[1] == "HELP");
        e.helps[parts[2]] = parts[3];
      }
      continue;
    }
    Sample s;
    const size_t brace = line.find('{');
    const size_t close = line.rfind('}');
    REQUIRE(brace != absl::string_view::npos);
    REQUIRE(close != absl::string_view::npos);
    s.name = std::string(line.substr(0, brace));
    absl::string_view labels = line.substr(brace + 1, close - brace - 1);
    while (!labels.empty()) {
      const size_t eq = labels.find("=\"");
      REQUIRE(eq != absl::string_view::npos);
      const size_t end = labels.find('"', eq + 2);
      REQUIRE(end != absl::string_view::npos);
      s.labels[std::string(labels.substr(0, eq))] =
          std::string(labels.substr(eq + 2, end - eq - 2));
      labels.remove_prefix(end + 1);
      if (!labels.empty()) {
        REQUIRE(labels[0] == ',');
        labels.remove_prefix(1);
      }
    }
    REQUIRE(line.substr(close + 1, 1) == " ");
    REQUIRE(absl::SimpleAtod(line.substr(close + 2), &s.value));
    // A sample belongs to a family declared before it (a histogram's by prefix).
    std::string family = s.name;
    for (absl::string_view suffix : {"_bucket", "_sum", "_count"}) {
      if (absl::EndsWith(family, suffix) &&
          e.types.count(family.substr(0, family.size() - suffix.size()))) {
        family = family.substr(0, family.size() - suffix.size());
      }
    }
    REQUIRE(e.types.count(family) == 1);
    REQUIRE(e.helps.count(family) == 1);
    e.samples.push_back(std::move(s));
  }
  return e;
}

double Value(const Exposition& e, const std::string& name,
             const std::map<std::string, std::string>& labels) {
  std::vector<const Sample*> found = e.Find(name, labels);
  INFO(name);
  REQUIRE(found.size() == 1);
  return found[0]->value;
}

// Checks one histogram of the exposition against the snapshot's.
void CheckHistogram(const Exposition& e, const std::map<std::string, std::string>& node,
                    Stage stage, const LatencyHistogram& h) {
  std::map<std::string, std::string> labels = node;
  labels["stage"] = std::string(StageName(stage));
  INFO("stage " << StageName(stage));
  std::vector<const Sample*> buckets = e.Find("stepmesh_stage_seconds_bucket", labels);
  REQUIRE(buckets.size() == LatencyHistogram::kBuckets);
  uint64_t cumulative = 0;
  for (int b = 0; b < LatencyHistogram::kBuckets; ++b) {
    cumulative += h.buckets[b];
    const Sample& s = *buckets[b];
    if (b == LatencyHistogram::kBuckets - 1) {
      CHECK(s.labels.at("le") == "+Inf");
    } else {
      double le = 0;
      REQUIRE(absl::SimpleAtod(s.labels.at("le"), &le));
      CHECK(le == Approx(LatencyHistogram::UpperBoundNs(b) * 1e-9).epsilon(1e-8));
    }
    CHECK(s.value == static_cast<double>(cumulative));
  }
  CHECK(Value(e, "stepmesh_stage_seconds_count", labels) == static_cast<double>(h.count));
  CHECK(Value(e, "stepmesh_stage_seconds_sum", labels) == Approx(h.sum_ns * 1e-9).epsilon(1e-8));
  CHECK(cumulative == h.count);
}

TEST_CASE("log2 histogram buckets: sample <= 2^i ns lands in bucket i", "[stats]") {
  core::LiveHistogram live;
  for (uint64_t ns : {0ull, 1ull, 2ull, 3ull, 4ull, 1024ull, 1025ull, 1ull << 40}) live.Record(ns);
  live.RecordSpan(0, 5);    // begin not stamped: ignored
  live.RecordSpan(10, 9);   // out of order: ignored
  live.RecordSpan(10, 18);  // 8 ns
  LatencyHistogram h;
  live.CopyTo(&h);
  CHECK(h.count == 9);
  CHECK(h.sum_ns == 0 + 1 + 2 + 3 + 4 + 1024 + 1025 + (1ull << 40) + 8);
  CHECK(h.buckets[0] == 2);                               // 0, 1
  CHECK(h.buckets[1] == 1);                               // 2
  CHECK(h.buckets[2] == 2);                               // 3, 4
  CHECK(h.buckets[3] == 1);                               // 8
  CHECK(h.buckets[10] == 1);                              // 1024
  CHECK(h.buckets[11] == 1);                              // 1025
  CHECK(h.buckets[LatencyHistogram::kBuckets - 1] == 1);  // 2^40: the overflow bucket
}

TEST_CASE("Stats() counts what was sent, on both ends, and PrometheusText parses back",
          "[stats][tcp]") {
  MeshOptions base;
  base.transport = "tcp";
  base.num_workers = 1;
  base.num_servers = kServers;
  base.timeout = absl::Seconds(60);
  auto mesh = testing::LoopbackMesh::Start(base, compose::CreateTransport);
  REQUIRE_OK(mesh);
  AFTensorWorker& worker = (*mesh)->worker(0);

  std::vector<std::vector<uint8_t>> recv(kServers, std::vector<uint8_t>(kPushBytes));
  std::vector<std::vector<uint8_t>> reply(kServers, std::vector<uint8_t>(kReplyBytes));
  std::vector<std::vector<uint8_t>> oversize_slot(kServers, std::vector<uint8_t>(kSlotBytes));
  std::vector<uint8_t> push(kPushBytes), oversize(2 * kSlotBytes);
  std::vector<std::vector<uint8_t>> pull(kServers, std::vector<uint8_t>(kReplyBytes));
  for (int s = 0; s < kServers; ++s) {
    AFTensorServer& server = (*mesh)->server(s);
    REQUIRE_OK(server.RegisterRecvTensor(kPushKey, BytesView(recv[s].data(), kPushBytes)));
    REQUIRE_OK(server.RegisterReplyTensor(kReplyKey, BytesView(reply[s].data(), kReplyBytes)));
    REQUIRE_OK(
        server.RegisterRecvTensor(kOversizeKey, BytesView(oversize_slot[s].data(), kSlotBytes)));
    REQUIRE_OK(worker.RegisterPullTensor(kReplyKey, s, BytesView(pull[s].data(), kReplyBytes)));
  }
  REQUIRE_OK(worker.RegisterPushTensor(kPushKey, BytesView(push.data(), kPushBytes)));
  REQUIRE_OK(worker.RegisterPushTensor(kOversizeKey, BytesView(oversize.data(), oversize.size())));

  testing::AnsweringServers servers(**mesh, {Reply{0}});
  const Push p{kPushKey};
  const Pull pulls[kServers] = {{kReplyKey, 0}, {kReplyKey, 1}};
  for (int i = 0; i < kRounds; ++i) {
    absl::StatusOr<RequestHandle> h = worker.PushPull({&p, 1}, pulls);
    REQUIRE_OK(h);
    REQUIRE_OK(worker.Wait(*h, absl::Seconds(60)));
  }
  // Refused by server 0's receive path: OUT_OF_RANGE, sent back as an error frame.
  const int only_server0[] = {0};
  const Push too_big{kOversizeKey, kWholeTensor, only_server0};
  absl::StatusOr<RequestHandle> bad = worker.PushPull({&too_big, 1}, {});
  REQUIRE_OK(bad);
  absl::Status refused = worker.Wait(*bad, absl::Seconds(60));
  CHECK_STATUS(refused, kOutOfRange);

  // The server counts a frame once its Send returned, which may be just after
  // the worker saw it: wait (bounded) for the counts to settle.
  const auto server_stats = [&](int s) { return (*mesh)->server(s).Stats(); };
  const absl::Time settle_deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < settle_deadline && (server_stats(0).peers[0].frames_sent < kRounds + 1 ||
                                           server_stats(1).peers[0].frames_sent < kRounds)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  servers.Stop();
  CHECK(servers.answered() == kServers * kRounds);

  const MeshStats ws = worker.Stats();
  CHECK(ws.role == Role::kWorker);
  CHECK(ws.rank == 0);
  REQUIRE(ws.peers.size() == kServers);
  CHECK(ws.requests[0] == kRounds);
  CHECK(ws.requests[static_cast<int>(absl::StatusCode::kOutOfRange)] == 1);
  CHECK(ws.in_flight == 0);
  std::array<MeshStats, kServers> ss = {server_stats(0), server_stats(1)};
  for (int s = 0; s < kServers; ++s) {
    INFO("server " << s);
    const PeerStats& w2s = ws.peers[s];        // the worker's view of server s
    const PeerStats& s2w = ss[s].peers.at(0);  // server s's view of the worker
    CHECK(w2s.role == Role::kServer);
    CHECK(w2s.rank == s);
    CHECK(s2w.role == Role::kWorker);
    const uint64_t extra_frames = s == 0 ? 1 : 0;
    CHECK(w2s.frames_sent == kRounds + extra_frames);
    CHECK(w2s.bytes_sent == kRounds * kPushBytes + extra_frames * oversize.size());
    CHECK(w2s.frames_received == kRounds + extra_frames);
    CHECK(Outcome(w2s, absl::StatusCode::kOk) == kRounds);
    CHECK(Outcome(w2s, absl::StatusCode::kOutOfRange) == extra_frames);
    // Each end's count of the same traffic agrees.
    CHECK(s2w.frames_received == w2s.frames_sent);
    CHECK(s2w.bytes_received == w2s.bytes_sent);
    CHECK(s2w.frames_sent == w2s.frames_received);
    CHECK(s2w.bytes_sent == w2s.bytes_received);
    CHECK(Outcome(s2w, absl::StatusCode::kOutOfRange) == extra_frames);
    if (s == 1) CHECK(w2s.bytes_received == kRounds * kReplyBytes);
    // Server 0's error frame carries its message's text.
    if (s == 0) CHECK(w2s.bytes_received > kRounds * kReplyBytes);
    CHECK(w2s.losses == 0);
    CHECK(w2s.rejoins == 0);
    CHECK(ss[s].requests[0] == kRounds);
    CHECK(ss[s].stage(Stage::kDispatch).count == kRounds);
    CHECK(ss[s].stage(Stage::kRespond).count == kRounds);
  }
  // Trace stamps are on by default: one sample per server reply, per request.
  CHECK(ws.stage(Stage::kSubmit).count == kServers * kRounds);
  CHECK(ws.stage(Stage::kNetwork).count == kServers * kRounds);
  CHECK(ws.stage(Stage::kTotal).count == kRounds + 1);
  CHECK(ws.stage(Stage::kWake).count == kRounds + 1);
  CHECK(ws.stage(Stage::kTotal).sum_ns > 0);

  // The exposition of the same snapshots.
  for (const MeshStats& stats : {ws, ss[0], ss[1]}) {
    const std::string text = PrometheusText(stats);
    const Exposition e = Parse(text);
    CHECK(e.types.at("stepmesh_peer_sent_bytes_total") == "counter");
    CHECK(e.types.at("stepmesh_stage_seconds") == "histogram");
    CHECK(e.types.at("stepmesh_send_queue_depth") == "gauge");
    const std::map<std::string, std::string> node = {{"role", std::string(RoleName(stats.role))},
                                                     {"rank", std::to_string(stats.rank)}};
    for (const PeerStats& p : stats.peers) {
      std::map<std::string, std::string> labels = node;
      labels["peer_role"] = std::string(RoleName(p.role));
      labels["peer"] = std::to_string(p.rank);
      CHECK(Value(e, "stepmesh_peer_sent_bytes_total", labels) == p.bytes_sent);
      CHECK(Value(e, "stepmesh_peer_sent_frames_total", labels) == p.frames_sent);
      CHECK(Value(e, "stepmesh_peer_received_bytes_total", labels) == p.bytes_received);
      CHECK(Value(e, "stepmesh_peer_received_frames_total", labels) == p.frames_received);
      labels["code"] = "OK";
      CHECK(Value(e, "stepmesh_peer_outcomes_total", labels) == Outcome(p, absl::StatusCode::kOk));
      labels["code"] = "OUT_OF_RANGE";
      const uint64_t out_of_range = Outcome(p, absl::StatusCode::kOutOfRange);
      CHECK(e.Find("stepmesh_peer_outcomes_total", labels).size() == (out_of_range ? 1u : 0u));
      if (out_of_range) CHECK(Value(e, "stepmesh_peer_outcomes_total", labels) == out_of_range);
    }
    std::map<std::string, std::string> ok = node;
    ok["code"] = "OK";
    CHECK(Value(e, "stepmesh_requests_total", ok) == stats.requests[0]);
    CHECK(Value(e, "stepmesh_in_flight", node) == stats.in_flight);
    for (int s = 0; s < kNumStages; ++s) {
      CheckHistogram(e, node, static_cast<Stage>(s), stats.stages[s]);
    }
  }
}

}  // namespace
}  // namespace stepmesh

namespace stepmesh {
namespace {

TEST_CASE("clock offset from one exchange: scheduler = local + offset", "[clock]") {
  // The scheduler's clock is 1 ms ahead; 50 ns each way.
  const ClockSync ahead = core::ClockFromExchange(100, 100 + 50 + 1000000, 200);
  CHECK(ahead.round_trip_ns == 100);
  CHECK(ahead.offset_ns == 1000000);
  // Behind by 5 us, asymmetric delays (10 ns out, 90 back): off by their half difference.
  const ClockSync behind = core::ClockFromExchange(10000, 10000 + 10 - 5000, 10100);
  CHECK(behind.round_trip_ns == 100);
  CHECK(behind.offset_ns == -5000 - 40);
}

TEST_CASE(
    "SchedulerClock() over a live mesh: one host, so the offset is within half the round trip",
    "[clock][tcp]") {
  MeshOptions base;
  base.transport = "tcp";
  base.num_workers = 2;
  base.num_servers = 2;
  base.timeout = absl::Seconds(30);
  auto mesh = testing::LoopbackMesh::Start(base, compose::CreateTransport);
  REQUIRE_OK(mesh);
  const auto check = [](absl::StatusOr<ClockSync> sync) {
    REQUIRE_OK(sync);
    INFO("offset " << sync->offset_ns << " ns, round trip " << sync->round_trip_ns << " ns");
    CHECK(sync->round_trip_ns > 0);
    CHECK(sync->round_trip_ns < 30'000'000'000ull);
    // One CLOCK_MONOTONIC: the true offset is 0 and the estimate's error is
    // at most half the round trip (rounded up).
    CHECK(std::abs(sync->offset_ns) <= static_cast<int64_t>((sync->round_trip_ns + 1) / 2));
  };
  for (int w = 0; w < 2; ++w) check((*mesh)->worker(w).SchedulerClock());
  for (int s = 0; s < 2; ++s) check((*mesh)->server(s).SchedulerClock());
}

}  // namespace
}  // namespace stepmesh
