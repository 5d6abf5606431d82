#include "examples/afd_model/autoscale_launch.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "stepmesh/status.h"

namespace afd::example {
namespace {

// Pipes whose launcher ends are O_CLOEXEC (no other child inherits them)
// and non-blocking for reading.
absl::StatusOr<std::unique_ptr<ChildPipes>> MakeChildPipes(bool reports) {
  auto p = std::make_unique<ChildPipes>();
  int c[2];
  if (::pipe2(c, O_CLOEXEC) != 0) return absl::UnavailableError("pipe2 failed");
  p->child_control = c[0];
  p->control = c[1];
  if (reports) {
    int r[2];
    if (::pipe2(r, O_CLOEXEC | O_NONBLOCK) != 0) return absl::UnavailableError("pipe2 failed");
    p->reports = std::make_unique<LineReader>(r[0]);
    p->child_report = r[1];
    // The child's end blocks (one short line at a time).
    ::fcntl(r[1], F_SETFL, 0);
  }
  return p;
}

}  // namespace

AutoscaleLoop::AutoscaleLoop(stepmesh::planner::AutoscalePlan plan, const RunShape& run)
    : plan_(plan), controller_(std::move(plan), run.attention, run.ffn) {
  checkpoint_ = NextCheckpoint(run, 1);
}

void AutoscaleLoop::AddAttention(std::unique_ptr<ChildPipes> pipes) {
  ::close(std::exchange(pipes->child_control, -1));
  ::close(std::exchange(pipes->child_report, -1));
  attention_pipes_.push_back(std::move(pipes));
}

void AutoscaleLoop::AddFfn(std::unique_ptr<ChildPipes> pipes) {
  ::close(std::exchange(pipes->child_control, -1));
  ffn_pipes_.push_back(std::move(pipes));
}

absl::StatusOr<std::unique_ptr<ChildPipes>> AutoscaleLoop::PipesFor(
    bool reports, std::vector<std::string>* argv) {
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<ChildPipes> p, MakeChildPipes(reports));
  argv->push_back("--control-fd");
  argv->push_back(absl::StrCat(kChildControlFd));
  if (reports) {
    argv->push_back("--report-fd");
    argv->push_back(absl::StrCat(kChildReportFd));
  }
  return p;
}

absl::Status AutoscaleLoop::Tell(const Decision& d, const ResizeSchedule& schedule) {
  const std::string line = FormatDecision(d);
  for (int side = 0; side < 2; ++side) {
    const auto& pipes = side == 0 ? attention_pipes_ : ffn_pipes_;
    const int ranks = side == 0 ? schedule.Capacity().attention : schedule.Capacity().ffn;
    for (int r = 0; r < ranks; ++r) {
      const MemberSpan span = side == 0 ? schedule.AttentionSpan(r) : schedule.FfnSpan(r);
      if (!span.Contains(d.checkpoint)) continue;
      const std::string who = absl::StrCat(side == 0 ? "attention " : "ffn ", r);
      if (r >= static_cast<int>(pipes.size()) || pipes[r] == nullptr) {
        return absl::InternalError(
            absl::StrCat(who, " is a member at checkpoint ", d.checkpoint, " but not started"));
      }
      ssize_t n;
      do {
        n = ::write(pipes[r]->control, line.data(), line.size());
      } while (n < 0 && errno == EINTR);
      if (n != static_cast<ssize_t>(line.size())) {
        return absl::UnavailableError(
            absl::StrCat("cannot tell ", who, " the decision of checkpoint ", d.checkpoint, ": ",
                         n < 0 ? std::strerror(errno) : "short write"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> AutoscaleLoop::Step(absl::Time now, RunShape* run, std::string* log) {
  for (size_t a = 0; a < attention_pipes_.size(); ++a) {
    if (attention_pipes_[a] == nullptr || attention_pipes_[a]->reports == nullptr) continue;
    std::vector<std::string> lines;
    const std::string who = absl::StrCat("attention ", a);
    if (absl::Status s = attention_pipes_[a]->reports->ReadAvailable(&lines); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(who, "'s reports: ", s.message()));
    }
    for (const std::string& line : lines) {
      absl::StatusOr<WorkloadReport> r = ParseWorkloadReport(line);
      if (!r.ok()) return absl::InvalidArgumentError(absl::StrCat(who, ": ", r.status().message()));
      if (r->checkpoint != checkpoint_ || reports_.count(int(a)) > 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            who, " reported checkpoint ", r->checkpoint, " while ", checkpoint_, " is decided"));
      }
      reports_[int(a)] = *r;
      if (!first_report_) first_report_ = now;
    }
  }
  const int c = checkpoint_;
  if (c >= run->steps()) return false;
  const ResizeSchedule schedule = run->Schedule();
  // The reporters: the attention members at c - 1 that stay at c.
  std::vector<int> missing;
  int64_t requests = 0, context = 0, micro_batches = 0;
  for (int a = 0; a < schedule.Capacity().attention; ++a) {
    const MemberSpan span = schedule.AttentionSpan(a);
    if (!span.Contains(c - 1) || !span.Contains(c)) continue;
    auto it = reports_.find(a);
    if (it == reports_.end()) {
      missing.push_back(a);
      continue;
    }
    requests += it->second.requests;
    context += it->second.context_tokens;
    micro_batches += it->second.micro_batches;
  }
  if (!missing.empty()) {
    if (first_report_ && now - *first_report_ > run->timeout) {
      return absl::DeadlineExceededError(
          absl::StrCat("checkpoint ", c, ": no workload report from attention ",
                       absl::StrJoin(missing, ", "), " within the mesh timeout (",
                       absl::FormatDuration(run->timeout), ") of the first report"));
    }
    return false;
  }
  const MeshShape now_shape = schedule.At(run->steps() - 1);  // with every decided change
  const stepmesh::planner::ObservedWorkload observed{double(context) / double(requests),
                                                     double(requests) / double(micro_batches), 0};
  Decision d{c};
  std::string verdict = "no change";
  if (pending_change_ >= c) {
    // The reports describe the shape before a decided change: no evidence
    // about the new one yet.
    verdict = absl::StrCat("no change (the resize at step ", pending_change_, " is under way)");
  } else {
    absl::StatusOr<stepmesh::planner::Recommendation> rec = controller_.Observe(observed);
    if (!rec.ok()) {
      return absl::Status(rec.status().code(),
                          absl::StrCat("checkpoint ", c, ": ", rec.status().message()));
    }
    verdict = absl::StrFormat(
        "model %s %.6g tokens/s per instance, best %s %.6g (%+.1f %%), streak %d/%d",
        stepmesh::planner::ShapeName(rec->current.attention, rec->current.ffn),
        rec->current.throughput_per_instance,
        stepmesh::planner::ShapeName(rec->best.attention, rec->best.ffn),
        rec->best.throughput_per_instance, rec->gain * 100, rec->streak, plan_.confirmations);
    if (rec->changed) {
      const MeshShape to{rec->best.attention, now_shape.ffn};
      if (rec->best.ffn != now_shape.ffn || to.attention < now_shape.attention) {
        // The launcher grows the attention side only (docs/elastic.md).
        controller_.SetCurrent(now_shape.attention, now_shape.ffn);
        absl::StrAppend(&verdict, "; ", stepmesh::planner::FormatChange(*rec),
                        ": not applied (--autoscale grows the attention side only)");
      } else {
        d.resize = true;
        d.step = c + kDecisionLead;
        d.to = to;
        absl::StrAppend(&verdict, "\nautoscale: ", stepmesh::planner::FormatChange(*rec),
                        " -> resize at step ", d.step, ": ", to.Name());
      }
    }
  }
  // Every member hears the decision before the schedule changes here: the
  // members at c are the old schedule's.
  STEPMESH_RETURN_IF_ERROR(Tell(d, schedule));
  if (d.resize) {
    run->resize.push_back(absl::StrCat(d.step, ":", d.to.Name()));
    pending_change_ = d.step;
    ++decisions_;
  }
  *log = absl::StrFormat("autoscale: checkpoint %d: context %.0f batch %.0f at %s | %s\n", c,
                         observed.mean_context, observed.batch, schedule.At(c).Name().c_str(),
                         verdict.c_str());
  reports_.clear();
  first_report_.reset();
  checkpoint_ = NextCheckpoint(*run, c + 1);
  return d.resize;
}

}  // namespace afd::example
