#include "src/tools/planner/watch.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "src/tools/planner/prometheus_text.h"
#include "stepmesh/status.h"

namespace stepmesh::planner {
namespace {

// Peers of one role seen by the other role's endpoints: present unless their
// losses outnumber their rejoins.
struct PeerCounts {
  std::map<std::string, double> losses, rejoins;
  std::set<std::string> seen;
  int Present() const {
    int n = 0;
    for (const std::string& p : seen) {
      const auto l = losses.find(p);
      const auto r = rejoins.find(p);
      if ((l == losses.end() ? 0 : l->second) <= (r == rejoins.end() ? 0 : r->second)) ++n;
    }
    return n;
  }
};

}  // namespace

absl::StatusOr<MeshSample> SummariseScrape(
    const std::vector<std::pair<std::string, std::string>>& scraped) {
  MeshSample out;
  int workers = 0, servers = 0;
  PeerCounts server_peers, worker_peers;  // seen by workers, by servers
  double context = 0, micro_batches = 0;
  for (const auto& [url, text] : scraped) {
    absl::StatusOr<std::vector<PromSample>> samples = ParsePrometheusText(text);
    if (!samples.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(url, ": ", samples.status().message()));
    }
    std::string role;
    bool workload = false;
    double requests = 0, tokens = 0, mbs = 0, decoded = 0;
    for (const PromSample& s : *samples) {
      const std::string* r = s.Label("role");
      if (r != nullptr && role.empty()) role = *r;
      if (r != nullptr && *r != role) {
        return absl::InvalidArgumentError(absl::StrCat(url, ": series of two roles (", role, ", ",
                                                       *r, "): one endpoint per node"));
      }
      const std::string* peer = s.Label("peer");
      const std::string* peer_role = s.Label("peer_role");
      if (peer != nullptr && peer_role != nullptr) {
        PeerCounts& pc = *peer_role == "server" ? server_peers : worker_peers;
        if (s.name == "stepmesh_peer_sent_bytes_total") pc.seen.insert(*peer);
        if (s.name == "stepmesh_peer_losses_total") pc.losses[*peer] = s.value;
        if (s.name == "stepmesh_peer_rejoins_total") pc.rejoins[*peer] = s.value;
      }
      if (s.name == "afd_workload_requests") {
        requests = s.value;
        workload = true;
      } else if (s.name == "afd_workload_context_tokens") {
        tokens = s.value;
      } else if (s.name == "afd_workload_micro_batches") {
        mbs = s.value;
      } else if (s.name == "afd_workload_decode_tokens_total") {
        decoded = s.value;
      }
    }
    if (role == "worker") {
      ++workers;
      if (!workload) {
        return absl::InvalidArgumentError(
            absl::StrCat(url,
                         ": an attention endpoint without afd_workload_* series (the AFD example's "
                         "afd_attention serves them on --metrics-port; docs/metrics.md)"));
      }
      if (!(mbs >= 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat(url, ": afd_workload_micro_batches = ", mbs, ": must be >= 1"));
      }
      out.requests += requests;
      context += tokens;
      micro_batches += mbs;
      out.decode_tokens += decoded;
    } else if (role == "server") {
      ++servers;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(url, ": no stepmesh series with a role label (not a stepmesh endpoint?)"));
    }
  }
  if (workers == 0) {
    return absl::InvalidArgumentError(
        "no attention (worker) endpoint among the URLs: the workload is read from them");
  }
  if (out.requests <= 0) {
    return absl::UnavailableError("the attention endpoints report no request in flight yet");
  }
  out.attention = std::max(workers, worker_peers.Present());
  out.ffn = std::max(servers, server_peers.Present());
  if (out.ffn == 0) {
    return absl::InvalidArgumentError(
        "no FFN instance is known: give an FFN endpoint or --current xAyF");
  }
  out.workload.mean_context = context / out.requests;
  out.workload.batch = out.requests / micro_batches;
  return out;
}

absl::StatusOr<WatchSummary> RunWatch(const AutoscalePlan& plan, const WatchOptions& o,
                                      std::FILE* out, std::FILE* err) {
  STEPMESH_RETURN_IF_ERROR(ValidateAutoscalePlan(plan));
  if (o.urls.empty()) return absl::InvalidArgumentError("--watch needs at least one URL");
  if (o.count <= 0 && o.duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--watch needs --watch-count or --watch-seconds (bounded)");
  }
  if (o.interval <= absl::ZeroDuration() || o.scrape_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--watch-interval-ms and the scrape timeout must be > 0");
  }
  WatchSummary summary;
  std::optional<AutoscaleController> ctl;
  std::pair<int, int> last_shape{0, 0};
  double last_tokens = 0;
  absl::Time last_time;
  const absl::Time start = absl::Now();
  for (int n = 1;; ++n) {
    const absl::Time now = absl::Now();
    if (o.count > 0 && n > o.count) break;
    if (o.duration > absl::ZeroDuration() && now - start >= o.duration) break;
    const absl::Time next = now + o.interval;
    absl::Status failed;
    std::vector<std::pair<std::string, std::string>> scraped;
    for (const HttpUrl& url : o.urls) {
      absl::StatusOr<std::string> body = HttpGet(url, o.scrape_timeout);
      if (!body.ok()) {
        failed = body.status();
        break;
      }
      scraped.emplace_back(url.text, *std::move(body));
    }
    absl::StatusOr<MeshSample> sample = failed.ok() ? SummariseScrape(scraped) : failed;
    const double t = absl::ToDoubleSeconds(absl::Now() - start);
    absl::StatusOr<Recommendation> rec;
    if (sample.ok()) {
      std::pair<int, int> shape = o.shape ? *o.shape : std::pair{sample->attention, sample->ffn};
      if (!ctl) {
        ctl.emplace(plan, shape.first, shape.second);
      } else if (shape != last_shape) {
        ctl->SetCurrent(shape.first, shape.second);  // the mesh was resized
      }
      rec = ctl->Observe(sample->workload);
      if (rec.ok()) {
        const std::string shape_name = ShapeName(shape.first, shape.second);
        std::string measured = "-";
        if (last_shape == shape && t > 0 && absl::Now() > last_time) {
          measured = absl::StrFormat("%.4g", (sample->decode_tokens - last_tokens) /
                                                 absl::ToDoubleSeconds(absl::Now() - last_time) /
                                                 (shape.first + shape.second));
        }
        std::fprintf(
            out,
            "watch %d t=%.2fs: mesh %s context %.1f batch %.2f | measured %s tokens/s "
            "per instance | model %s %.4g, best %s %.4g (%+.1f %%), streak %d/%d\n",
            n, t, shape_name.c_str(), sample->workload.mean_context, sample->workload.batch,
            measured.c_str(), ShapeName(rec->current.attention, rec->current.ffn).c_str(),
            rec->current.throughput_per_instance,
            ShapeName(rec->best.attention, rec->best.ffn).c_str(),
            rec->best.throughput_per_instance, rec->gain * 100, rec->streak, plan.confirmations);
        if (rec->changed) {
          std::fprintf(out, "watch %d: %s\n", n, FormatChange(*rec).c_str());
          ++summary.changes;
        }
        ++summary.observations;
        last_shape = shape;
        last_tokens = sample->decode_tokens;
        last_time = absl::Now();
      } else {
        sample = rec.status();
      }
    }
    if (!sample.ok()) {
      std::fprintf(err, "watch %d t=%.2fs: %s\n", n, t,
                   std::string(sample.status().message()).c_str());
      ++summary.failures;
      if (o.until_gone && summary.observations > 0) break;
    }
    std::fflush(out);
    std::fflush(err);
    if (o.count > 0 && n >= o.count) break;
    absl::Time wake = next;
    if (o.duration > absl::ZeroDuration()) wake = std::min(wake, start + o.duration);
    absl::SleepFor(wake - absl::Now());
  }
  if (summary.observations == 0) {
    return absl::UnavailableError(
        absl::StrCat("no observation succeeded in ", summary.failures, " scrape(s)"));
  }
  return summary;
}

}  // namespace stepmesh::planner
