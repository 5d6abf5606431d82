// afd_launch's run: after the children exited, the failure checks, or the
// report, the merged trace and Gate A (launcher.h).

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "examples/afd_model/afd_report.h"
#include "examples/afd_model/autoscale_report.h"
#include "examples/afd_model/emulated_compute.h"
#include "examples/afd_model/launcher.h"

namespace afd::example {

absl::Status Launcher::WriteMergedTrace(const std::vector<AttentionResults>& results) const {
  // Each process wrote its stepmesh trace, already on the scheduler's clock;
  // the application's events (attention and FFN compute) go onto that clock
  // with the offset each export states.
  std::vector<std::string> traces;
  std::vector<int64_t> worker_offset(f_.shape.attention), server_offset(f_.shape.ffn);
  for (stepmesh::Role role : {stepmesh::Role::kWorker, stepmesh::Role::kServer}) {
    const int n = role == stepmesh::Role::kWorker ? f_.shape.attention : f_.shape.ffn;
    for (int rank = 0; rank < n; ++rank) {
      const std::string path = TracePath(role, rank);
      std::ifstream in(path, std::ios::binary);
      if (!in) return absl::NotFoundError(absl::StrCat("no trace from ", path));
      std::ostringstream text;
      text << in.rdbuf();
      traces.push_back(text.str());
      int64_t& offset = (role == stepmesh::Role::kWorker ? worker_offset : server_offset)[rank];
      constexpr absl::string_view kKey = "\"clock_offset_ns\":";
      const absl::string_view text_view = traces.back();
      const size_t at = text_view.find(kKey);
      const size_t end = at == absl::string_view::npos ? at : text_view.find(',', at);
      if (end == absl::string_view::npos ||
          !absl::SimpleAtoi(text_view.substr(at + kKey.size(), end - at - kKey.size()), &offset)) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": no clock_offset_ns"));
      }
    }
  }
  traces.push_back(ApplicationTraceJson(f_.shape, results, worker_offset, server_offset));
  STEPMESH_ASSIGN_OR_RETURN(const std::string merged, stepmesh::MergeChromeTraces(traces));
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(f_.chrome_trace.c_str(), "w"),
                                                    &std::fclose);
  if (!f || std::fwrite(merged.data(), 1, merged.size(), f.get()) != merged.size()) {
    return absl::UnavailableError(absl::StrCat("cannot write ", f_.chrome_trace));
  }
  return absl::OkStatus();
}
namespace {

// A child that had to fail: prints its exit and the last `lines` of its
// error. False (with a problem) when it succeeded or hung; else its error.
bool ExpectFailed(const Child& c, int lines, std::vector<std::string>* problems, std::string* err) {
  *err = c.Stderr();
  std::printf("%s exited %d; its error:\n%s", c.name().c_str(), c.exit_code(),
              Tail(*err, lines).c_str());
  if (c.exit_code() == 0) {
    problems->push_back(absl::StrCat(c.name(), " succeeded"));
    return false;
  }
  if (c.killed_by_launcher()) {
    problems->push_back(absl::StrCat(c.name(), " hung (killed)"));
    return false;
  }
  return true;
}

// "failure check: FAIL (...)" and 1 when there are problems, else
// "failure check: PASS (pass)" and 0.
int FailureCheck(const std::vector<std::string>& problems, const std::string& pass) {
  if (!problems.empty()) {
    std::printf("failure check: FAIL (%s)\n", absl::StrJoin(problems, "; ").c_str());
    return 1;
  }
  std::printf("failure check: PASS (%s)\n", pass.c_str());
  return 0;
}

}  // namespace

int Launcher::CheckExpectedFailure() {
  // Every attention instance must have failed on its own, naming the lost
  // server, within the mesh timeout of the kill.
  const std::string needle = absl::StrCat("server ", f_.kill_ffn);
  std::vector<std::string> problems;
  absl::Duration took;
  for (auto& c : attention_) {
    took = std::max(took, c->exited_at() - ffn_killed_at_);
    std::string err;
    if (ExpectFailed(*c, 3, &problems, &err) && !absl::StrContains(err, needle)) {
      problems.push_back(absl::StrCat(c->name(), "'s error does not name ", needle));
    }
  }
  if (ffn_killed_at_ == absl::Time()) {
    problems.push_back("the run ended before the kill");
  } else if (took > f_.shape.timeout) {
    problems.push_back(absl::StrCat("the attention instances took ", absl::FormatDuration(took),
                                    " to fail, over the mesh timeout"));
  }
  return FailureCheck(problems,
                      absl::StrFormat("every attention instance exited with an error naming %s "
                                      "within %.1f s of the kill; mesh timeout %.1f s",
                                      needle, absl::ToDoubleSeconds(took),
                                      absl::ToDoubleSeconds(f_.shape.timeout)));
}

int Launcher::CheckWrongLayerRefused() {
  const std::vector<std::string> at = absl::StrSplit(f_.inject_wrong_layer, ':');
  // Any of attention 0's micro-batches may be the first an FFN refuses.
  const std::string sent = absl::StrCat("attention 0 sent step ", at[0], " layer ",
                                        std::stoi(at[1]) + 1, " micro-batch ");
  const std::string expects = absl::StrCat("this FFN expects step ", at[0], " layer ", at[1]);
  const std::string needle = absl::StrCat(sent, "M, ", expects);
  std::vector<std::string> problems;
  std::vector<std::string> refused;
  for (auto* group : {&ffn_, &attention_}) {
    for (auto& c : *group) {
      std::string err;
      if (ExpectFailed(*c, 2, &problems, &err) && group == &ffn_ && absl::StrContains(err, sent) &&
          absl::StrContains(err, expects)) {
        refused.push_back(c->name());
      }
    }
  }
  // The frame goes to every FFN, but once one refuses it the run unravels:
  // the others may fail first on the lost peers, before they see it.
  if (refused.empty()) {
    problems.push_back(absl::StrCat("no FFN's error says \"", needle, "\""));
  }
  return FailureCheck(problems, absl::StrCat(absl::StrJoin(refused, ", "), " refused the frame: \"",
                                             needle, "\"; every process exited with an error"));
}

int Launcher::Run() {
  if (absl::Status s = StartScheduler(); !s.ok())
    return ReferenceCheckFail(absl::StrCat("scheduler: ", s.ToString()));
  started_ = absl::Now();
  if (absl::Status s = StartChildren(); !s.ok()) return ReferenceCheckFail(s.ToString());
  std::printf("afd_launch: %dA%dF %s on %s, scheduler %s, logs in %s\n", f_.shape.attention,
              f_.shape.ffn, f_.shape.config.c_str(), f_.shape.transport.c_str(),
              scheduler_address_.c_str(), f_.work_dir.c_str());
  std::fflush(stdout);

  std::string why;
  const bool ok = WaitChildren(started_ + absl::Seconds(f_.deadline_s), &why);
  if (scheduler_) scheduler_->Stop();
  if (scheduler_process_) scheduler_process_->Kill();
  const double wall = absl::ToDoubleSeconds(absl::Now() - started_);

  if (f_.expect_failure) {
    return f_.inject_wrong_layer.empty() ? CheckExpectedFailure() : CheckWrongLayerRefused();
  }
  if (!ok) {
    for (auto* group : {&attention_, &ffn_}) {
      for (auto& c : *group) {
        if (c->exit_code() == 0 && !IsLostAttention(*c)) continue;
        std::printf("--- %s stderr (tail):\n%s", c->name().c_str(), Tail(c->Stderr(), 8).c_str());
      }
    }
    return ReferenceCheckFail(
        absl::StrCat("run failed after ", absl::StrFormat("%.1f", wall), " s: ", why));
  }
  for (auto* group : {&attention_, &ffn_}) {
    for (auto& c : *group) std::printf("%s", c->Stdout().c_str());
  }

  if (f_.lost_attention >= 0) {
    const Child& lost = *attention_[f_.lost_attention];
    std::printf("%s was lost as expected (exit %d, %.1f s into the run); its error:\n%s",
                lost.name().c_str(), lost.exit_code(),
                absl::ToDoubleSeconds(lost.exited_at() - started_), Tail(lost.Stderr(), 2).c_str());
  }
  std::vector<AttentionResults> results;
  for (int a = 0; a < static_cast<int>(attention_.size()); ++a) {
    if (a == f_.lost_attention) continue;  // the survivors are checked
    // With --resize each instance ran its own span of steps.
    const RunShape shape = f_.shape.ForAttention(a);
    absl::StatusOr<AttentionResults> r =
        ReadResults(absl::StrCat(f_.work_dir, "/attention-", a, ".results"),
                    ExpectedResults{a, &shape, config_.num_layers, config_.hidden_size,
                                    config_.vocab_size, f_.reference && f_.layer_check});
    if (!r.ok()) return ReferenceCheckFail(r.status().ToString());
    results.push_back(std::move(*r));
  }
  // The report describes whole runs (--lost-attention: the survivors are
  // only checked).
  if (f_.lost_attention < 0) std::printf("\n%s", FormatReport(f_.shape, model_, results).c_str());
  if (f_.shape.elastic()) {
    std::vector<std::string> logs;
    for (size_t a = 0; a < attention_.size(); ++a) logs.push_back(ResizeLogPath(int(a)));
    absl::StatusOr<std::string> lines =
        FormatResizeLines(f_.shape.Schedule(), EpochLogPath(), logs);
    if (!lines.ok()) return ReferenceCheckFail(lines.status().ToString());
    std::printf("%s", lines->c_str());
  }
  std::printf("(all processes done in %.2f s wall, including weight generation)\n", wall);
  if (!f_.chrome_trace.empty()) {
    if (absl::Status s = WriteMergedTrace(results); !s.ok()) {
      return ReferenceCheckFail(s.ToString());
    }
    std::printf("chrome trace: %s\n", f_.chrome_trace.c_str());
  }
  if (emulation_ && f_.shape.elastic()) {
    // Per span of steps between changes: measured against the planner.
    stepmesh::planner::AutoscalePlan plan;
    if (f_.autoscale_plan) plan = *f_.autoscale_plan;
    plan.plan = *emulation_;
    plan.batch_policy = f_.shape.emulated_batch == "global"
                            ? stepmesh::planner::BatchPolicy::kGlobal
                            : stepmesh::planner::BatchPolicy::kPerInstance;
    const ResizeSchedule schedule = f_.shape.Schedule();
    absl::StatusOr<std::vector<SegmentComparison>> rows =
        CompareWithPlanner(f_.shape, schedule, plan, results.front());
    if (!rows.ok()) return ReferenceCheckFail(rows.status().ToString());
    std::printf("%s", FormatComparison(*rows).c_str());
    const std::string csv = f_.work_dir + "/throughput.csv";
    std::ofstream out(csv);
    out << ThroughputCsv(f_.shape, schedule, plan, results.front());
    if (out) std::printf("per-step throughput: %s\n", csv.c_str());
    if (f_.autoscale_plan) {
      std::printf("autoscale: %d change(s) decided while decoding: %s -> %s\n",
                  autoscale_->decisions(), schedule.start().Name().c_str(),
                  schedule.At(f_.shape.steps() - 1).Name().c_str());
    }
  }
  if (emulation_) {
    if (!f_.shape.elastic()) {
      std::printf("%s", FormatEmulationSummary(f_.shape, *emulation_, results).c_str());
    }
    std::printf(
        "reference check: PASS (skipped: --emulate-compute replaces the kernels; all "
        "processes succeeded)\n");
    return 0;
  }
  if (!f_.reference) {
    std::printf("reference check: PASS (skipped: --no-reference; all processes succeeded)\n");
    return 0;
  }
  std::fflush(stdout);
  // The reference recomputes the whole run in this process: as long as the
  // run for big shapes, so it reports progress too.
  const absl::Time reference_start = absl::Now();
  absl::Time next = reference_start + absl::Seconds(f_.progress_s);
  auto progress = [&](int step) {
    const absl::Time now = absl::Now();
    if (f_.progress_s <= 0 || now < next) return;
    next = now + absl::Seconds(f_.progress_s);
    std::printf("afd_launch: reference check %.0f s: step %d/%d\n",
                absl::ToDoubleSeconds(now - reference_start), step + 1, f_.shape.steps());
    std::fflush(stdout);
  };
  const ReferenceCheck check = CheckAgainstReference(
      f_.shape, model_, results, f_.layer_check, progress,
      f_.shape.ResolvedEngine() == "cuda" ? GateMode::kBounded : GateMode::kBitwise);
  std::printf("reference check: %s (%s)\n", check.pass ? "PASS" : "FAIL", check.summary.c_str());
  return check.pass ? 0 : 1;
}
}  // namespace afd::example
