// afd_launch --autoscale without the mesh (docs/elastic.md, "Autoscale"):
// the channel's lines, a process's bounded wait for its decision, the
// schedule amendment, and the launcher's decision loop over real pipes
// (AutoscaleLoop with the shipped emulated Step-3 autoscale file).

#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/autoscale_channel.h"
#include "examples/afd_model/autoscale_launch.h"  // and the planner's autoscale file
#include "examples/afd_model/resize_plan.h"

namespace afd::example {
namespace {

// Reads what is in the pipe now (the fd is made non-blocking).
std::vector<std::string> Drain(int fd) {
  ::fcntl(fd, F_SETFL, O_NONBLOCK);
  LineReader r(fd);
  std::vector<std::string> lines;
  REQUIRE(r.ReadAvailable(&lines).ok());
  return lines;
}

void Write(int fd, const std::string& s) {
  REQUIRE(::write(fd, s.data(), s.size()) == static_cast<ssize_t>(s.size()));
}

TEST_CASE("autoscale channel: reports and decisions parse back and bad lines are refused",
          "[afd][autoscale]") {
  const WorkloadReport r{12, 3072, 3145728, 3};
  CHECK(FormatWorkloadReport(r) == "checkpoint 12 requests 3072 context 3145728 micro_batches 3\n");
  absl::StatusOr<WorkloadReport> back = ParseWorkloadReport(FormatWorkloadReport(r));
  REQUIRE(back.ok());
  CHECK(back->checkpoint == 12);
  CHECK(back->requests == 3072);
  CHECK(back->context_tokens == 3145728);
  CHECK(back->micro_batches == 3);
  CHECK_FALSE(ParseWorkloadReport("checkpoint 12 requests 0 context 1 micro_batches 3").ok());
  CHECK_FALSE(ParseWorkloadReport("checkpoint 12 requests 3").ok());

  const Decision none{8};
  CHECK(FormatDecision(none) == "checkpoint 8: no change\n");
  Decision grow{30, true, 32, {3, 2}};
  CHECK(FormatDecision(grow) == "checkpoint 30: resize at 32: 3A2F\n");
  absl::StatusOr<Decision> d = ParseDecision(FormatDecision(grow));
  REQUIRE(d.ok());
  CHECK(d->resize);
  CHECK(d->step == 32);
  CHECK(d->to == MeshShape{3, 2});
  REQUIRE(ParseDecision(FormatDecision(none)).ok());
  CHECK_FALSE(ParseDecision(FormatDecision(none))->resize);
  // A change must lie after its checkpoint; garbage names the line.
  CHECK_FALSE(ParseDecision("checkpoint 30: resize at 30: 3A2F").ok());
  const absl::Status bad = ParseDecision("checkpoint 30: grow").status();
  CHECK(absl::StrContains(bad.message(), "\"checkpoint 30: grow\" is not a decision"));
}

TEST_CASE("autoscale channel: a process without its decision by the deadline fails naming itself",
          "[afd][autoscale]") {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  {
    ControlChannel c("attention 1", p[0], -1);
    // Nothing written: the bounded wait ends, naming the process and checkpoint.
    absl::StatusOr<Decision> d = c.Await(4, absl::Milliseconds(50));
    REQUIRE(absl::IsDeadlineExceeded(d.status()));
    CHECK(absl::StrContains(d.status().message(),
                            "attention 1: checkpoint 4: no decision from the launcher"));
    // Another checkpoint's line is refused.
    Write(p[1], "checkpoint 6: no change\n");
    d = c.Await(4, absl::Seconds(5));
    REQUIRE(absl::IsFailedPrecondition(d.status()));
    CHECK(absl::StrContains(d.status().message(), "got the decision of checkpoint 6"));
    // The launcher gone (its end closed): UNAVAILABLE, not a hang.
    Write(p[1], "checkpoint 8: resize at 10: 3A2F\n");
    ::close(p[1]);
    d = c.Await(8, absl::Seconds(5));
    REQUIRE(d.ok());
    CHECK(d->to == MeshShape{3, 2});
    d = c.Await(10, absl::Seconds(5));
    CHECK(absl::IsUnavailable(d.status()));
  }
}

TEST_CASE("autoscale schedule: Append amends like Parse and changes nothing on error",
          "[afd][autoscale]") {
  ResizeSchedule s({2, 2}, 57);
  REQUIRE(s.Append(32, {3, 2}).ok());
  REQUIRE(s.Append(48, {4, 2}).ok());
  CHECK(s.At(47) == MeshShape{3, 2});
  CHECK(s.At(48) == MeshShape{4, 2});
  CHECK(s.AttentionSpan(3).begin == 48);
  CHECK(s.Specs() == std::vector<std::string>{"32:3A2F", "48:4A2F"});
  const absl::Status early = s.Append(40, {5, 2});
  CHECK(absl::StrContains(early.message(), "--resize 40:5A2F: step 40 must be after 48"));
  CHECK(s.Specs() == std::vector<std::string>{"32:3A2F", "48:4A2F"});
  CHECK_FALSE(s.Append(57, {5, 2}).ok());  // past the run

  RunShape run;
  run.decode_steps = 56;
  run.decision_every = 4;
  run.max_attention = 8;
  CHECK(IsCheckpoint(run, 4));
  CHECK_FALSE(IsCheckpoint(run, 0));
  CHECK_FALSE(IsCheckpoint(run, 6));
  CHECK(IsCheckpoint(run, 52));
  CHECK_FALSE(IsCheckpoint(run, 56));  // its change would fall after the run
}

TEST_CASE("autoscale loop: decides once every member reported and tells every member or times out",
          "[afd][autoscale]") {
  absl::StatusOr<stepmesh::planner::AutoscalePlan> plan = stepmesh::planner::ReadAutoscalePlan(
      std::string(AFD_PLANNER_CONFIG_DIR) + "/autoscale_step3_emulated.json");
  REQUIRE(plan.ok());
  RunShape run;
  run.attention = 2;
  run.ffn = 2;
  run.decode_steps = 20;
  run.decision_every = 2;
  run.max_attention = 8;
  run.emulate_compute = "x";
  run.context_growth = "1024:8192";
  run.emulated_batch = "global";
  run.timeout = absl::Seconds(1);
  AutoscaleLoop loop(*plan, run);
  // Two attention and two FFN "children": the test keeps the child ends.
  std::vector<int> control, report;
  for (int i = 0; i < 4; ++i) {
    std::vector<std::string> argv;
    absl::StatusOr<std::unique_ptr<ChildPipes>> pipes = AutoscaleLoop::PipesFor(i < 2, &argv);
    REQUIRE(pipes.ok());
    CHECK(argv[0] == "--control-fd");
    control.push_back(::dup((*pipes)->child_control));
    if (i < 2) {
      report.push_back(::dup((*pipes)->child_report));
      loop.AddAttention(*std::move(pipes));
    } else {
      loop.AddFfn(*std::move(pipes));
    }
  }
  const absl::Time t0 = absl::Now();
  std::string log;
  // One report of checkpoint 2: no decision yet.
  Write(report[0], FormatWorkloadReport({2, 3072, 3072 * 1100, 3}));
  absl::StatusOr<bool> changed = loop.Step(t0, &run, &log);
  REQUIRE(changed.ok());
  CHECK_FALSE(*changed);
  CHECK(log.empty());
  for (int fd : control) CHECK(Drain(fd).empty());
  // The second: every member hears "no change" (2A2F is best at 1.1K).
  Write(report[1], FormatWorkloadReport({2, 3072, 3072 * 1100, 3}));
  changed = loop.Step(t0, &run, &log);
  REQUIRE(changed.ok());
  CHECK_FALSE(*changed);
  CHECK(absl::StrContains(log, "autoscale: checkpoint 2: context 1100 batch 1024 at 2A2F"));
  for (int fd : control) CHECK(Drain(fd) == std::vector<std::string>{"checkpoint 2: no change\n"});
  // Three checkpoints at 8K: the third decides 2A2F -> 4A2F two steps on.
  for (int c : {4, 6, 8}) {
    for (int a = 0; a < 2; ++a) Write(report[a], FormatWorkloadReport({c, 3072, 3072 * 8000, 3}));
    changed = loop.Step(t0, &run, &log);
    REQUIRE(changed.ok());
    CHECK(*changed == (c == 8));
  }
  CHECK(run.resize == std::vector<std::string>{"10:4A2F"});
  for (int fd : control) {
    CHECK(Drain(fd) == std::vector<std::string>{"checkpoint 4: no change\n",
                                                "checkpoint 6: no change\n",
                                                "checkpoint 8: resize at 10: 4A2F\n"});
  }
  CHECK(loop.decisions() == 1);
  // A member that never reports: after the mesh timeout from the first
  // report, the loop fails naming it.
  Write(report[0], FormatWorkloadReport({10, 3072, 3072 * 8000, 3}));
  REQUIRE(loop.Step(t0, &run, &log).ok());
  const absl::StatusOr<bool> late = loop.Step(t0 + absl::Seconds(2), &run, &log);
  REQUIRE(absl::IsDeadlineExceeded(late.status()));
  CHECK(absl::StrContains(late.status().message(),
                          "checkpoint 10: no workload report from attention 1"));
  // An out-of-turn report is refused naming its sender.
  Write(report[0], FormatWorkloadReport({12, 3072, 3072 * 8000, 3}));
  const absl::StatusOr<bool> twice = loop.Step(t0, &run, &log);
  CHECK(absl::StrContains(twice.status().message(), "attention 0 reported checkpoint 12"));
  for (int fd : control) ::close(fd);
  for (int fd : report) ::close(fd);
}

}  // namespace
}  // namespace afd::example
