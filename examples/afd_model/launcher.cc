// afd_launch's run: starting the scheduler and the children, and waiting
// for them (launcher.h).

#include "examples/afd_model/launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

extern char** environ;

namespace afd::example {

int ReferenceCheckFail(absl::string_view line) {
  std::fflush(stderr);
  std::printf("reference check: FAIL (%s)\n", std::string(line).c_str());
  return 1;
}

absl::Status Launcher::StepAutoscale(absl::Time now) {
  if (autoscale_ == nullptr) return absl::OkStatus();
  std::string log;
  STEPMESH_ASSIGN_OR_RETURN(const bool changed, autoscale_->Step(now, &f_.shape, &log));
  if (changed) joins_.Amend(f_.shape.Schedule());
  if (!log.empty()) {
    std::printf("%s", log.c_str());
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

std::vector<std::string> Launcher::ChildEnvironment() const {
  // The secret travels in the environment (readable only by this user), not
  // on a command line every user can list.
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    if (absl::StartsWith(*e, "STEPMESH_AUTH_TOKEN=")) continue;
    if (!f_.chrome_trace.empty() && absl::StartsWith(*e, "STEPMESH_TRACE_EVENTS=")) continue;
    env.push_back(*e);
  }
  env.push_back(absl::StrCat("STEPMESH_AUTH_TOKEN=", auth_token_));
  if (!f_.chrome_trace.empty()) {
    // Every request of the run: a server answers each attention instance's
    // request of every stage (48 bytes a record there).
    const int64_t requests = int64_t{f_.shape.attention} * f_.shape.steps() * config_.num_layers *
                             f_.shape.micro_batches;
    env.push_back(
        absl::StrCat("STEPMESH_TRACE_EVENTS=", std::min<int64_t>(requests, int64_t{1} << 20)));
  }
  return env;
}

absl::Status Launcher::StartScheduler() {
  // Every process of the run shares one secret: the one given in the
  // environment, or a fresh random one, so no other local process can join
  // (or feed data into) the mesh.
  STEPMESH_ASSIGN_OR_RETURN(stepmesh::MeshOptions from_env, stepmesh::MeshOptions::FromEnv());
  auth_token_ = from_env.auth_token;
  if (auth_token_.empty()) {
    STEPMESH_ASSIGN_OR_RETURN(auth_token_, stepmesh::GenerateAuthToken());
  }
  if (f_.scheduler_binary.empty()) {
    stepmesh::MeshOptions o = from_env;
    o.auth_token = auth_token_;
    o.role = stepmesh::Role::kScheduler;
    o.num_workers = f_.shape.attention;
    o.num_servers = f_.shape.ffn;
    if (f_.shape.elastic()) {
      o.max_workers = f_.shape.Capacity().attention;
      o.max_servers = f_.shape.Capacity().ffn;
    }
    // The kernel picks a free port (on host 0 with --hosts).
    o.scheduler = absl::StrCat(f_.placement.address(0), ":0");
    o.timeout = f_.shape.timeout;
    STEPMESH_ASSIGN_OR_RETURN(scheduler_, stepmesh::Scheduler::Start(o));
    scheduler_address_ = scheduler_->address();
    return absl::OkStatus();
  }
  // The external program needs a port up front: borrow a free one from the
  // kernel. (A small race with other binders; the in-process default has none.)
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  ::inet_pton(AF_INET, f_.placement.address(0).c_str(), &addr.sin_addr);
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return absl::UnavailableError("cannot find a free port");
  }
  ::close(fd);
  scheduler_address_ = absl::StrCat(f_.placement.address(0), ":", ntohs(addr.sin_port));
  STEPMESH_ASSIGN_OR_RETURN(
      scheduler_process_,
      Child::Start("scheduler",
                   {f_.scheduler_binary, "--address", scheduler_address_, "--workers",
                    absl::StrCat(f_.shape.attention), "--servers", absl::StrCat(f_.shape.ffn)},
                   ChildEnvironment(), f_.work_dir + "/scheduler.out",
                   f_.work_dir + "/scheduler.err", f_.placement.netns_fd(0)));
  absl::SleepFor(absl::Milliseconds(200));  // let it bind before clients dial
  return absl::OkStatus();
}

std::string Launcher::TracePath(stepmesh::Role role, int rank) const {
  return absl::StrCat(f_.work_dir, "/", stepmesh::RoleName(role), rank, ".trace.json");
}

void Launcher::AppendTraceFlag(stepmesh::Role role, int rank,
                               std::vector<std::string>* argv) const {
  if (f_.chrome_trace.empty()) return;
  argv->push_back("--chrome-trace");
  argv->push_back(TracePath(role, rank));
}

void Launcher::AppendMetricsFlags(stepmesh::Role role, int rank, int port_offset,
                                  std::vector<std::string>* argv) const {
  if (f_.metrics_port > 0) {
    argv->push_back("--metrics-port");
    argv->push_back(absl::StrCat(f_.metrics_port + port_offset));
  }
  if (!f_.metrics_file.empty()) {
    argv->push_back("--metrics-file");
    argv->push_back(absl::StrCat(f_.metrics_file, ".", stepmesh::RoleName(role), rank));
  }
}

absl::Status Launcher::StartFfn(int p) {
  std::vector<std::string> env = ChildEnvironment();
  // With --hosts each process binds its host's address.
  const int host = f_.placement.FfnHost(p);
  for (std::string& e : f_.placement.Environment(host)) env.push_back(std::move(e));
  std::vector<std::string> argv = {SelfDir() + "/afd_ffn", "--scheduler", scheduler_address_,
                                   "--rank", absl::StrCat(p)};
  AppendRunFlags(f_.shape, &argv);
  AppendMetricsFlags(stepmesh::Role::kServer, p, f_.shape.attention + p, &argv);
  AppendTraceFlag(stepmesh::Role::kServer, p, &argv);
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<ChildPipes> pipes, PipesFor(false, &argv));
  const std::string base = absl::StrCat(f_.work_dir, "/ffn-", p);
  STEPMESH_ASSIGN_OR_RETURN(
      auto child, Child::Start(absl::StrCat("ffn ", p), argv, env, base + ".out", base + ".err",
                               f_.placement.netns_fd(host), pipes ? pipes->child_control : -1));
  ffn_.push_back(std::move(child));
  if (pipes) autoscale_->AddFfn(std::move(pipes));
  return absl::OkStatus();
}

absl::Status Launcher::StartAttention(int a) {
  std::vector<std::string> env = ChildEnvironment();
  const int host = f_.placement.AttentionHost(a);
  for (std::string& e : f_.placement.Environment(host)) env.push_back(std::move(e));
  std::vector<std::string> argv = {SelfDir() + "/afd_attention",
                                   "--scheduler",
                                   scheduler_address_,
                                   "--rank",
                                   absl::StrCat(a),
                                   "--results",
                                   absl::StrCat(f_.work_dir, "/attention-", a, ".results")};
  if (f_.reference && f_.layer_check) argv.push_back("--dump-layers");
  if (a == 0 && !f_.inject_wrong_layer.empty()) {
    argv.push_back("--inject-wrong-layer");
    argv.push_back(f_.inject_wrong_layer);
  }
  // Progress feeds the progress lines and starts the kill test's clock.
  argv.push_back("--progress");
  argv.push_back(ProgressPath(a));
  if (f_.shape.elastic()) {
    // What each change cost it, and (attention 0, a member throughout) the
    // epochs: the resize lines of the report.
    argv.push_back("--resize-log");
    argv.push_back(ResizeLogPath(a));
    if (a == 0) {
      argv.push_back("--epoch-log");
      argv.push_back(EpochLogPath());
    }
  }
  AppendRunFlags(f_.shape, &argv);
  AppendMetricsFlags(stepmesh::Role::kWorker, a, a, &argv);
  AppendTraceFlag(stepmesh::Role::kWorker, a, &argv);
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<ChildPipes> pipes, PipesFor(true, &argv));
  const std::string base = absl::StrCat(f_.work_dir, "/attention-", a);
  STEPMESH_ASSIGN_OR_RETURN(
      auto child,
      Child::Start(absl::StrCat("attention ", a), argv, env, base + ".out", base + ".err",
                   f_.placement.netns_fd(host), pipes ? pipes->child_control : -1,
                   pipes ? pipes->child_report : -1));
  attention_.push_back(std::move(child));
  if (pipes) autoscale_->AddAttention(std::move(pipes));
  return absl::OkStatus();
}

absl::Status Launcher::StartChildren() {
  // With --resize only the start shape; the joiners come with their changes.
  for (int p = 0; p < joins_.start().ffn; ++p) STEPMESH_RETURN_IF_ERROR(StartFfn(p));
  for (int a = 0; a < joins_.start().attention; ++a) STEPMESH_RETURN_IF_ERROR(StartAttention(a));
  return absl::OkStatus();
}

absl::Status Launcher::StartJoiners() {
  if (!joins_.pending()) return absl::OkStatus();
  int furthest = -1;
  bool decoding = true;
  for (size_t a = 0; a < attention_.size(); ++a) {
    const int step = ReadProgress(ProgressPath(static_cast<int>(a))).step;
    furthest = std::max(furthest, step);
    if (static_cast<int>(a) < joins_.start().attention) decoding = decoding && step >= 0;
  }
  for (const JoinPlanner::Joiner& j : joins_.Due(furthest, decoding)) {
    // Ranks join in order, so attention_[a] and ffn_[p] stay rank-indexed.
    const size_t have = j.attention ? attention_.size() : ffn_.size();
    if (static_cast<int>(have) != j.rank) {
      return absl::InternalError(absl::StrCat("joiner rank ", j.rank, " out of order"));
    }
    STEPMESH_RETURN_IF_ERROR(j.attention ? StartAttention(j.rank) : StartFfn(j.rank));
    std::printf("afd_launch: started %s %d to join at step %d\n", j.attention ? "attention" : "ffn",
                j.rank, j.step);
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

void Launcher::PrintProgress(absl::Time now) {
  if (now < next_progress_) return;
  next_progress_ = now + absl::Seconds(f_.progress_s);
  int running = 0;
  for (auto* group : {&attention_, &ffn_}) {
    for (auto& c : *group) running += c->running() ? 1 : 0;
  }
  // The slowest attention instance sets the pace.
  Progress slowest{f_.shape.steps(), 0};
  int slowest_instance = 0;
  for (int a = 0; a < static_cast<int>(attention_.size()); ++a) {
    const Progress p = ReadProgress(ProgressPath(a));
    if (p.step < slowest.step || (p.step == slowest.step && p.layer < slowest.layer)) {
      slowest = p;
      slowest_instance = a;
    }
  }
  std::string where = "starting (weights, mesh)";
  if (slowest.step >= 0) {
    where = absl::StrFormat("attention %d at step %d/%d (%s) layer %d/%d", slowest_instance,
                            slowest.step + 1, f_.shape.steps(),
                            slowest.step == 0 ? "prefill" : "decode", slowest.layer + 1,
                            config_.num_layers);
  }
  std::printf("afd_launch: %.0f s: %s; %d of %d processes running\n",
              absl::ToDoubleSeconds(now - started_), where.c_str(), running,
              static_cast<int>(attention_.size() + ffn_.size()));
  std::fflush(stdout);
}

bool Launcher::WaitChildren(absl::Time deadline, std::string* why) {
  if (f_.progress_s > 0) next_progress_ = started_ + absl::Seconds(f_.progress_s);
  // After the first failure the others get the mesh timeout (plus slack) to
  // notice and exit on their own with their own diagnosis; then they are
  // killed.
  std::optional<absl::Time> grace_deadline;
  bool kill_done = f_.kill_ffn_after_ms < 0;
  for (;;) {
    bool all_done = true;
    bool any_failed = false;
    for (auto* group : {&attention_, &ffn_}) {
      for (auto& c : *group) {
        if (!c->Poll())
          all_done = false;
        else if (c->exit_code() != 0 && !IsLostAttention(*c))
          any_failed = true;
      }
    }
    if (all_done) break;
    const absl::Time now = absl::Now();
    absl::Status joined = StartJoiners();
    if (joined.ok()) joined = StepAutoscale(now);
    if (absl::Status s = joined; !s.ok()) {
      *why = s.ToString();
      for (auto* group : {&attention_, &ffn_}) {
        for (auto& c : *group) c->Kill();
      }
      break;
    }
    // The kill test's premise is a running decode: its clock starts when
    // every attention instance has passed the start barrier (weights
    // generated, mesh connected), however long a loaded machine takes.
    if (!kill_done && !decode_started_) {
      bool all_started = true;
      for (int a = 0; a < f_.shape.attention; ++a) {
        all_started = all_started && ReadProgress(ProgressPath(a)).step >= 0;
      }
      if (all_started) decode_started_ = now;
    }
    if (!kill_done && decode_started_ &&
        now - *decode_started_ >= absl::Milliseconds(f_.kill_ffn_after_ms)) {
      ffn_[f_.kill_ffn]->Signal(SIGKILL);
      ffn_killed_at_ = now;
      std::printf("afd_launch: killed ffn %d %lld ms into the run\n", f_.kill_ffn,
                  static_cast<long long>(f_.kill_ffn_after_ms));
      std::fflush(stdout);
      kill_done = true;
    }
    PrintProgress(now);
    if (any_failed && !grace_deadline) grace_deadline = now + f_.shape.timeout + absl::Seconds(5);
    const bool over = now > deadline || (grace_deadline && now > *grace_deadline);
    if (over || *interrupted_) {
      *why = *interrupted_ ? "interrupted" : now > deadline ? "deadline exceeded" : "";
      for (auto* group : {&attention_, &ffn_}) {
        for (auto& c : *group) {
          if (c->running()) c->Kill();
        }
      }
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  bool ok = why->empty();
  if (ok && joins_.pending()) {
    ok = false;
    *why = "the run ended before every --resize was reached";
  }
  if (f_.lost_attention >= 0) {
    const Child& lost = *attention_[f_.lost_attention];
    if (lost.exit_code() == 0 || lost.killed_by_launcher()) {
      ok = false;
      absl::StrAppend(why, why->empty() ? "" : "; ", lost.name(),
                      lost.exit_code() == 0 ? " finished although it was cut off (--lost-attention)"
                                            : " hung (killed)");
    }
  }
  for (auto* group : {&attention_, &ffn_}) {
    for (auto& c : *group) {
      if (c->exit_code() == 0 || IsLostAttention(*c)) continue;
      ok = false;
      if (!why->empty()) absl::StrAppend(why, "; ");
      absl::StrAppend(why, c->name(),
                      c->killed_by_launcher() ? " killed by the launcher"
                                              : absl::StrCat(" exited ", c->exit_code()));
    }
  }
  return ok;
}
}  // namespace afd::example
