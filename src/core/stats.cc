// MeshStats' live counters (src/core/stats_recorder.h) and their Prometheus
// text exposition.

#include "stepmesh/stats.h"

#include <cstdio>
#include <iterator>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "src/base/enum_names.h"
#include "src/core/stats_recorder.h"

namespace stepmesh {

namespace {

constexpr absl::string_view kStageNames[] = {"submit",  "network", "dispatch",
                                             "respond", "wake",    "total"};
static_assert(std::size(kStageNames) == kNumStages);

}  // namespace

absl::string_view StageName(Stage stage) { return base::NameOf(kStageNames, stage, "invalid"); }

namespace {

void Family(std::string& out, absl::string_view name, absl::string_view type,
            absl::string_view help) {
  absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

// Seconds for a bucket bound or a sum: exact enough to tell 2^i ns apart.
std::string Seconds(uint64_t ns) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.9g", static_cast<double>(ns) * 1e-9);
  return text;
}

}  // namespace

std::string PrometheusText(const MeshStats& stats) {
  std::string out;
  const std::string node =
      absl::StrCat("role=\"", RoleName(stats.role), "\",rank=\"", stats.rank, "\"");
  const auto peer_labels = [&](const PeerStats& p) {
    return absl::StrCat(node, ",peer_role=\"", RoleName(p.role), "\",peer=\"", p.rank, "\"");
  };
  struct PeerCounter {
    const char* name;
    const char* help;
    uint64_t PeerStats::*field;
  };
  static constexpr PeerCounter kPeerCounters[] = {
      {"stepmesh_peer_sent_bytes_total", "Payload bytes sent to the peer.", &PeerStats::bytes_sent},
      {"stepmesh_peer_sent_frames_total", "Data frames sent to the peer.", &PeerStats::frames_sent},
      {"stepmesh_peer_received_bytes_total", "Payload bytes received from the peer.",
       &PeerStats::bytes_received},
      {"stepmesh_peer_received_frames_total", "Data frames received from the peer.",
       &PeerStats::frames_received},
      {"stepmesh_peer_losses_total", "Times the peer was counted out (lost or left).",
       &PeerStats::losses},
      {"stepmesh_peer_rejoins_total", "Times the peer's restarted process reconnected.",
       &PeerStats::rejoins},
  };
  for (const PeerCounter& c : kPeerCounters) {
    Family(out, c.name, "counter", c.help);
    for (const PeerStats& p : stats.peers) {
      absl::StrAppend(&out, c.name, "{", peer_labels(p), "} ", p.*c.field, "\n");
    }
  }
  // Every code that occurred, and OK always (a family never empty).
  const auto by_code = [&](absl::string_view name, const std::string& labels,
                           const std::array<uint64_t, kNumStatusCodes>& counts) {
    for (int c = 0; c < kNumStatusCodes; ++c) {
      if (c != 0 && counts[c] == 0) continue;
      absl::StrAppend(&out, name, "{", labels, ",code=\"",
                      absl::StatusCodeToString(static_cast<absl::StatusCode>(c)), "\"} ", counts[c],
                      "\n");
    }
  };
  Family(out, "stepmesh_peer_outcomes_total", "counter",
         stats.role == Role::kWorker
             ? "The peer's part of each request (its reply or failure), by status code."
             : "Error frames sent to the peer, by status code (OK: never counted).");
  for (const PeerStats& p : stats.peers) {
    by_code("stepmesh_peer_outcomes_total", peer_labels(p), p.outcomes);
  }
  Family(out, "stepmesh_requests_total", "counter",
         stats.role == Role::kWorker ? "Requests collected by Wait(), by result."
                                     : "Batches answered by Respond().");
  by_code("stepmesh_requests_total", node, stats.requests);
  Family(out, "stepmesh_send_queue_depth", "gauge", "Items on the send queue.");
  absl::StrAppend(&out, "stepmesh_send_queue_depth{", node, "} ", stats.sends_queued, "\n");
  Family(out, "stepmesh_in_flight", "gauge",
         stats.role == Role::kWorker ? "Requests not yet collected by Wait()."
                                     : "Batches ready and not yet taken by GetBatch().");
  absl::StrAppend(&out, "stepmesh_in_flight{", node, "} ", stats.in_flight, "\n");
  Family(out, "stepmesh_membership_epoch", "gauge",
         "The membership epoch this participant last heard of (docs/elastic.md).");
  absl::StrAppend(&out, "stepmesh_membership_epoch{", node, "} ", stats.membership_epoch, "\n");
  Family(out, "stepmesh_members", "gauge", "Members of the mesh at that epoch, by role.");
  absl::StrAppend(&out, "stepmesh_members{", node, ",members=\"worker\"} ", stats.member_workers,
                  "\n");
  absl::StrAppend(&out, "stepmesh_members{", node, ",members=\"server\"} ", stats.member_servers,
                  "\n");
  Family(out, "stepmesh_stage_seconds", "histogram",
         "Time a request spends in each stage (docs/metrics.md).");
  for (int s = 0; s < kNumStages; ++s) {
    const LatencyHistogram& h = stats.stages[s];
    const std::string labels =
        absl::StrCat(node, ",stage=\"", StageName(static_cast<Stage>(s)), "\"");
    uint64_t cumulative = 0;
    for (int b = 0; b < LatencyHistogram::kBuckets; ++b) {
      cumulative += h.buckets[b];
      // The last bucket also holds larger samples: its bound is +Inf only.
      if (b == LatencyHistogram::kBuckets - 1) break;
      absl::StrAppend(&out, "stepmesh_stage_seconds_bucket{", labels, ",le=\"",
                      Seconds(LatencyHistogram::UpperBoundNs(b)), "\"} ", cumulative, "\n");
    }
    absl::StrAppend(&out, "stepmesh_stage_seconds_bucket{", labels, ",le=\"+Inf\"} ", h.count,
                    "\n");
    absl::StrAppend(&out, "stepmesh_stage_seconds_sum{", labels, "} ", Seconds(h.sum_ns), "\n");
    absl::StrAppend(&out, "stepmesh_stage_seconds_count{", labels, "} ", h.count, "\n");
  }
  return out;
}

namespace core {

void LiveHistogram::CopyTo(LatencyHistogram* out) const {
  for (int b = 0; b < LatencyHistogram::kBuckets; ++b) {
    out->buckets[b] = buckets_[b].load(std::memory_order_relaxed);
  }
  out->sum_ns = sum_ns_.load(std::memory_order_relaxed);
  out->count = count_.load(std::memory_order_relaxed);
}

StatsRecorder::StatsRecorder(Role role, Role peer_role, int num_peers)
    : role_(role), peer_role_(peer_role), num_peers_(num_peers), peers_(new Peer[num_peers]) {}

MeshStats StatsRecorder::Snapshot() const {
  MeshStats s;
  s.role = role_;
  s.peers.resize(num_peers_);
  for (int i = 0; i < num_peers_; ++i) {
    const Peer& p = peers_[i];
    PeerStats& o = s.peers[i];
    o.role = peer_role_;
    o.rank = i;
    o.bytes_sent = p.bytes_sent.load(std::memory_order_relaxed);
    o.frames_sent = p.frames_sent.load(std::memory_order_relaxed);
    o.bytes_received = p.bytes_received.load(std::memory_order_relaxed);
    o.frames_received = p.frames_received.load(std::memory_order_relaxed);
    for (int c = 0; c < kNumStatusCodes; ++c) {
      o.outcomes[c] = p.outcomes[c].load(std::memory_order_relaxed);
    }
    o.losses = p.losses.load(std::memory_order_relaxed);
    o.rejoins = p.rejoins.load(std::memory_order_relaxed);
  }
  for (int c = 0; c < kNumStatusCodes; ++c) {
    s.requests[c] = requests_[c].load(std::memory_order_relaxed);
  }
  for (int i = 0; i < kNumStages; ++i) stages_[i].CopyTo(&s.stages[i]);
  return s;
}

}  // namespace core
}  // namespace stepmesh
