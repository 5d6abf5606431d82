// afd_launch: runs a disaggregated decode of the example model (Step-3 or
// Step-5-Preview, --model) on this host and checks it.
//
//   afd_launch --attention X --ffn Y [--requests R] [--prompt-len 32]
//              [--decode-steps 16] [--micro-batches 3] [--model tiny]
//              [--transport tcp|rdma|libfabric] [--backend cpu_mock|cuda]
//              [--poll-mode adaptive|spin|blocking] [--timeout-ms 30000]
//              [--deadline-s 300] [--chrome-trace FILE] [--work-dir DIR]
//              [--scheduler-binary PATH] [--no-reference] [--no-layer-check]
//              [--kill-ffn-after-ms N [--kill-ffn P] --expect-failure]
//              [--emulate-compute PLAN.json]
//              [--metrics-port P] [--metrics-file PREFIX]
//              [--hosts NS,... --host-addrs A,...] [--lost-attention A]
//              [--resize STEP:xAyF ...]
//              [--autoscale AS.json [--autoscale-every K] --context-growth FROM:TO]
//
// Starts the stepmesh scheduler (in this process on a free 127.0.0.1 port,
// or the stepmesh_scheduler program), X afd_attention and Y afd_ffn
// processes from this program's directory, waits for them under a deadline,
// prints the report and runs Gate A against the monolithic AFD-emulation
// reference. The last line is "reference check: PASS (...)" or
// "reference check: FAIL (...)" and the exit status follows it; any process
// failing fails the run. Children are killed by PID on every failure path and
// get PR_SET_PDEATHSIG, so none outlives the launcher.
//
// --kill-ffn-after-ms N kills FFN P (default the last) N ms after the start;
// with --expect-failure the run passes when every attention instance exits
// with an error naming that server within the mesh timeout ("failure check:
// PASS (...)").
//
// --emulate-compute PLAN.json selects the emulated engine (afd_engine.h):
// sleeps from the planner's latency model (emulated_compute.h) instead of the
// model's kernels; the bytes still move. The reference check is skipped; an
// "emulated compute:" line gives the decode throughput in the plan's virtual
// tokens.
//
// --hosts places every instance on its own emulated host (a network
// namespace; placement.h, scripts/cluster.sh).
//
// --resize STEP:xAyF (repeatable) changes the shape while decoding
// (resize_plan.h, elastic_sync.h, docs/elastic.md): the launcher starts the
// joiners of a change as the run approaches it, and the report gets one
// "resize at step S: xAyF -> x'Ay'F (epoch E, T ms)" line per change.
//
// --autoscale AS.json (with --emulate-compute) decides those changes while
// the run decodes, from the workload the attention processes report at its
// checkpoints, and tells every process over an inherited pipe
// (autoscale_channel.h); the report compares each shape's measured
// throughput per instance with the planner's (autoscale_report.h).

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/afd_engine.h"
#include "examples/afd_model/afd_report.h"
#include "examples/afd_model/autoscale_channel.h"
#include "examples/afd_model/autoscale_launch.h"
#include "examples/afd_model/autoscale_report.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/emulated_compute.h"
#include "examples/afd_model/example_model.h"
#include "examples/afd_model/placement.h"
#include "examples/afd_model/resize_launch.h"
#include "stepmesh/stepmesh.h"

extern char** environ;

namespace afd::example {
namespace {

volatile sig_atomic_t g_interrupted = 0;
void OnSignal(int) { g_interrupted = 1; }
// A child process: stdout/stderr go to files; killed and reaped by PID when
// dropped while still running.
class Child {
 public:
  // `env`: the child's whole environment ("NAME=value" entries). `netns_fd`
  // (>= 0): the network namespace the child runs in (--hosts).
  static absl::StatusOr<std::unique_ptr<Child>> Start(
      std::string name, const std::vector<std::string>& argv, const std::vector<std::string>& env,
      const std::string& out_path, const std::string& err_path, int netns_fd = -1,
      int control_fd = -1, int report_fd = -1) {
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    std::vector<char*> envp;
    for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0 || err < 0) {
      if (out >= 0) ::close(out);
      if (err >= 0) ::close(err);
      return absl::UnavailableError(absl::StrCat("cannot create log files for ", name));
    }
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      ::close(out);
      ::close(err);
      return absl::UnavailableError(absl::StrCat("fork: ", std::strerror(errno)));
    }
    if (pid == 0) {
      // Only async-signal-safe calls until exec (the parent has threads).
      // The kernel kills the child if the launcher dies, even by SIGKILL
      // (a ctest timeout), so nothing is left behind.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      if (netns_fd >= 0 && ::setns(netns_fd, CLONE_NEWNET) != 0) ::_exit(126);
      ::dup2(out, STDOUT_FILENO);
      ::dup2(err, STDERR_FILENO);
      // --autoscale: the pipe ends become fds 3 and 4 (dup2 clears
      // FD_CLOEXEC; via fds >= 100 so neither overwrites the other).
      if (control_fd >= 0) {
        const int c = ::fcntl(control_fd, F_DUPFD, 100);
        const int r = report_fd >= 0 ? ::fcntl(report_fd, F_DUPFD, 100) : -1;
        if (c < 0 || ::dup2(c, kChildControlFd) < 0) ::_exit(125);
        if (report_fd >= 0 && (r < 0 || ::dup2(r, kChildReportFd) < 0)) ::_exit(125);
      }
      ::execve(args[0], args.data(), envp.data());
      ::_exit(127);
    }
    ::close(out);
    ::close(err);
    return std::unique_ptr<Child>(new Child(std::move(name), pid, out_path, err_path));
  }

  ~Child() { Kill(); }

  // Non-blocking; true once exited (exit_code() then valid).
  bool Poll() {
    if (pid_ <= 0) return true;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) != pid_) return false;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    exited_at_ = absl::Now();
    pid_ = -1;
    return true;
  }
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    if (exit_code_ < 0) exit_code_ = 128 + SIGKILL;
    exited_at_ = absl::Now();
    killed_ = true;
    pid_ = -1;
  }
  // SIGKILL without reaping (the kill test: the child's exit is observed by Poll).
  void Signal(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }

  const std::string& name() const { return name_; }
  int exit_code() const { return exit_code_; }
  absl::Time exited_at() const { return exited_at_; }
  bool killed_by_launcher() const { return killed_; }
  bool running() const { return pid_ > 0; }
  std::string Stdout() const { return ReadFile(out_path_); }
  std::string Stderr() const { return ReadFile(err_path_); }

 private:
  Child(std::string name, pid_t pid, std::string out_path, std::string err_path)
      : name_(std::move(name)),
        pid_(pid),
        out_path_(std::move(out_path)),
        err_path_(std::move(err_path)) {}
  static std::string ReadFile(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  std::string name_;
  pid_t pid_;
  std::string out_path_, err_path_;
  int exit_code_ = -1;
  absl::Time exited_at_;
  bool killed_ = false;
};

std::string SelfDir() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, n);
  return path.substr(0, path.rfind('/'));
}

// The last `lines` lines of `text`, indented.
std::string Tail(const std::string& text, int lines) {
  size_t pos = text.size();
  for (int i = 0; i <= lines && pos > 0; ++i) {
    const size_t nl = text.rfind('\n', pos - 1);
    if (nl == std::string::npos) {
      pos = 0;
      break;
    }
    if (i < lines)
      pos = nl;
    else
      pos = nl + 1;
  }
  std::string out;
  std::istringstream in(text.substr(pos));
  for (std::string line; std::getline(in, line);) absl::StrAppend(&out, "    ", line, "\n");
  return out;
}

// Removes the launcher's own temporary directory (flat: logs and results).
void RemoveWorkDir(const std::string& dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") ::unlink((dir + "/" + name).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(dir.c_str());
}

struct LaunchFlags {
  RunShape shape;
  int64_t deadline_s = 300;
  int64_t progress_s = 10;
  std::string chrome_trace;
  std::string work_dir;
  std::string scheduler_binary;
  bool reference = true;
  bool layer_check = true;
  int64_t kill_ffn_after_ms = -1;
  int kill_ffn = -1;
  bool expect_failure = false;
  std::string inject_wrong_layer;  // "STEP:LAYER" for attention 0's header
  int64_t metrics_port = 0;        // attention a serves on it + a, FFN p on it + X + p
  std::string metrics_file;        // each process writes PREFIX.worker<a> / PREFIX.server<p>
  Placement placement;             // --hosts: one emulated host per instance
  int lost_attention = -1;         // --lost-attention: cut off by the caller's network fault
  // --autoscale AS.json: the launcher decides the resizes (docs/elastic.md).
  std::string autoscale;
  std::optional<stepmesh::planner::AutoscalePlan> autoscale_plan;
};

int Fail(absl::string_view line) {
  std::fflush(stderr);
  std::printf("reference check: FAIL (%s)\n", std::string(line).c_str());
  return 1;
}

class Launcher {
 public:
  Launcher(LaunchFlags flags, ExampleModel model, std::optional<stepmesh::planner::Plan> emulation)
      : f_(std::move(flags)),
        model_(std::move(model)),
        config_(model_.config),
        emulation_(std::move(emulation)),
        joins_(f_.shape.Schedule()) {
    if (f_.autoscale_plan)
      autoscale_ = std::make_unique<AutoscaleLoop>(*f_.autoscale_plan, f_.shape);
  }
  int Run();

 private:
  absl::Status StartScheduler();
  absl::Status StartChildren();
  absl::Status StartFfn(int p);
  absl::Status StartAttention(int a);
  // --resize: starts the joiners of the changes the run approaches.
  absl::Status StartJoiners();
  // --autoscale: one step of the decision loop; a change decided now
  // reaches the join plan.
  absl::Status StepAutoscale(absl::Time now);
  // --autoscale: a child's pipes (null without), its flags appended.
  absl::StatusOr<std::unique_ptr<ChildPipes>> PipesFor(bool reports,
                                                       std::vector<std::string>* argv) const {
    if (autoscale_ == nullptr) return std::unique_ptr<ChildPipes>();
    return AutoscaleLoop::PipesFor(reports, argv);
  }
  std::string ResizeLogPath(int a) const {
    return absl::StrCat(f_.work_dir, "/attention-", a, ".resize");
  }
  std::string EpochLogPath() const { return absl::StrCat(f_.work_dir, "/attention-0.epochs"); }
  // --metrics-port / --metrics-file for the child of `role` and `rank`.
  void AppendMetricsFlags(stepmesh::Role role, int rank, int port_offset,
                          std::vector<std::string>* argv) const;
  // Waits for every child: true when all exited 0. Applies the kill test.
  bool WaitChildren(absl::Time deadline, std::string* why);
  int CheckExpectedFailure();
  // --inject-wrong-layer: every FFN refuses the frame, naming the layer it
  // expected, and every attention instance fails on its own.
  int CheckWrongLayerRefused();
  // --lost-attention: the instance the caller's network fault cuts off.
  bool IsLostAttention(const Child& c) const {
    return f_.lost_attention >= 0 && &c == attention_[f_.lost_attention].get();
  }
  std::string ProgressPath(int a) const {
    return absl::StrCat(f_.work_dir, "/attention-", a, ".progress");
  }
  // "afd_launch: 20 s: attention 0 at step 3/17 layer 2/6 ..." every
  // --progress-s seconds, so a long run is visibly alive.
  void PrintProgress(absl::Time now);

  // This process's environment with the mesh's secret set, for every child.
  std::vector<std::string> ChildEnvironment() const;
  // --chrome-trace: each child's own trace file, and the merged run.
  std::string TracePath(stepmesh::Role role, int rank) const;
  void AppendTraceFlag(stepmesh::Role role, int rank, std::vector<std::string>* argv) const;
  absl::Status WriteMergedTrace(const std::vector<AttentionResults>& results) const;

  LaunchFlags f_;
  std::string auth_token_;
  const ExampleModel model_;   // the model the run uses (--model / --config)
  const ModelConfig& config_;  // model_.config
  // --emulate-compute: the plan, for the emulated throughput line.
  const std::optional<stepmesh::planner::Plan> emulation_;
  std::unique_ptr<stepmesh::Scheduler> scheduler_;
  std::unique_ptr<Child> scheduler_process_;
  std::string scheduler_address_;
  std::vector<std::unique_ptr<Child>> attention_;
  std::vector<std::unique_ptr<Child>> ffn_;
  absl::Time started_;
  absl::Time next_progress_ = absl::InfiniteFuture();
  absl::Time ffn_killed_at_;
  std::optional<absl::Time> decode_started_;  // every attention instance past the barrier
  JoinPlanner joins_;  // --resize: who starts when (the ranks of attention_, ffn_ in order)
  std::unique_ptr<AutoscaleLoop> autoscale_;  // --autoscale
};

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
    if (over || g_interrupted) {
      *why = g_interrupted ? "interrupted" : now > deadline ? "deadline exceeded" : "";
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

int Launcher::CheckExpectedFailure() {
  // Every attention instance must have failed on its own, naming the lost
  // server, within the mesh timeout of the kill.
  const std::string needle = absl::StrCat("server ", f_.kill_ffn);
  std::vector<std::string> problems;
  absl::Duration took;
  for (auto& c : attention_) {
    took = std::max(took, c->exited_at() - ffn_killed_at_);
    const std::string err = c->Stderr();
    std::printf("%s exited %d; its error:\n%s", c->name().c_str(), c->exit_code(),
                Tail(err, 3).c_str());
    if (c->exit_code() == 0)
      problems.push_back(absl::StrCat(c->name(), " succeeded"));
    else if (c->killed_by_launcher())
      problems.push_back(absl::StrCat(c->name(), " hung (killed)"));
    else if (!absl::StrContains(err, needle)) {
      problems.push_back(absl::StrCat(c->name(), "'s error does not name ", needle));
    }
  }
  if (ffn_killed_at_ == absl::Time()) {
    problems.push_back("the run ended before the kill");
  } else if (took > f_.shape.timeout) {
    problems.push_back(absl::StrCat("the attention instances took ", absl::FormatDuration(took),
                                    " to fail, over the mesh timeout"));
  }
  if (!problems.empty()) {
    std::printf("failure check: FAIL (%s)\n", absl::StrJoin(problems, "; ").c_str());
    return 1;
  }
  std::printf(
      "failure check: PASS (every attention instance exited with an error naming %s "
      "within %.1f s of the kill; mesh timeout %.1f s)\n",
      needle.c_str(), absl::ToDoubleSeconds(took), absl::ToDoubleSeconds(f_.shape.timeout));
  return 0;
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
      const std::string err = c->Stderr();
      std::printf("%s exited %d; its error:\n%s", c->name().c_str(), c->exit_code(),
                  Tail(err, 2).c_str());
      if (c->exit_code() == 0) {
        problems.push_back(absl::StrCat(c->name(), " succeeded"));
      } else if (c->killed_by_launcher()) {
        problems.push_back(absl::StrCat(c->name(), " hung (killed)"));
      } else if (group == &ffn_ && absl::StrContains(err, sent) &&
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
  if (!problems.empty()) {
    std::printf("failure check: FAIL (%s)\n", absl::StrJoin(problems, "; ").c_str());
    return 1;
  }
  std::printf(
      "failure check: PASS (%s refused the frame: \"%s\"; every process exited with an "
      "error)\n",
      absl::StrJoin(refused, ", ").c_str(), needle.c_str());
  return 0;
}

int Launcher::Run() {
  if (absl::Status s = StartScheduler(); !s.ok())
    return Fail(absl::StrCat("scheduler: ", s.ToString()));
  started_ = absl::Now();
  if (absl::Status s = StartChildren(); !s.ok()) return Fail(s.ToString());
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
    return Fail(absl::StrCat("run failed after ", absl::StrFormat("%.1f", wall), " s: ", why));
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
    if (!r.ok()) return Fail(r.status().ToString());
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
    if (!lines.ok()) return Fail(lines.status().ToString());
    std::printf("%s", lines->c_str());
  }
  std::printf("(all processes done in %.2f s wall, including weight generation)\n", wall);
  if (!f_.chrome_trace.empty()) {
    if (absl::Status s = WriteMergedTrace(results); !s.ok()) {
      return Fail(s.ToString());
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
    if (!rows.ok()) return Fail(rows.status().ToString());
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

constexpr char kUsageLine[] =
    "usage: afd_launch --attention X --ffn Y [--requests R] [--prompt-len N] "
    "[--decode-steps N] [--micro-batches M] [--model NAME|PATH] [flags...]\n"
    "       afd_launch --help";

constexpr char kHelp[] = R"help(
Runs a disaggregated decode of the example model (Step-3, or Step-5-Preview
with --model tiny-step5) on this host: X attention and Y FFN processes talking
through stepmesh. Prints the report and checks it against the model's
monolithic reference (Gate A). The last line is "reference check:
PASS|FAIL (...)" and the exit status follows it (0 / 1). Argument errors are
reported before any process starts and exit 2.

run shape (passed to every process):
  --attention X          attention instances (stepmesh workers), default 1
  --ffn Y                FFN instances = partitions (stepmesh servers), default 1;
                         at most the model's expert count
  --requests R           requests per attention instance, default 6
  --prompt-len N         prompt tokens per request, default 32
  --decode-steps N       greedy decode steps after the prefill, default 16
  --micro-batches M      pipeline stages per attention instance (<= R), default 3
  --model NAME|PATH      the model (--config is the same flag): Step-3 tiny
                         (default), full (step3-fullwidth-L4), wire (step3-wire:
                         full wire widths, CPU-sized FFN), step3; Step-5-Preview
                         tiny-step5, full-width-step5, step5; or a config file.
                         Step-5 models run on the cpu engine with an fp32 KV cache
  --transport tcp|rdma|libfabric
                         default tcp (rdma needs an RDMA device; libfabric's
                         provider: STEPMESH_FI_PROVIDER, docs/libfabric.md)
  --backend cpu_mock|cuda  default cpu_mock (cuda needs a GPU)
  --engine auto|cpu|cuda|cpu-device
                         compute engine: cpu = the CPU kernels; cuda = the CUDA
                         kernels, tensors in GPU memory; cpu-device = the cuda
                         engine's orchestration over CPU kernels (cpu_mock);
                         auto (default): cuda on --backend cuda, else cpu
  --kv-cache fp32|bf16|fp8  KV-cache format (fp8: E4M3, one scale per token),
                         default fp32; bf16/fp8 with the cpu engine
  --emulate-compute PLAN.json
                         the emulated engine: no model runs, every attention
                         stage and FFN batch sleeps for the plan's latency model
                         (docs/planning.md) while the pipeline and the bytes stay
                         real; no reference check, an "emulated compute:" line
                         gives the decode throughput. Not with --engine, nor
                         with a Step-5 --model
  --poll-mode adaptive|spin|blocking  default adaptive
  --timeout-ms N         mesh timeout (connect, barrier, every wait), default 30000
  --resize STEP:xAyF     (repeatable) from decode step STEP on, the run is xAyF:
                         new attention instances join the running mesh with
                         the requests that arrive then, new FFN instances join
                         and every FFN re-shards the experts; the highest
                         ranks leave (their requests end before STEP, then
                         they drain). The cpu engine (docs/elastic.md)
  --context-growth FROM:TO
                         with --emulate-compute: the mean context per request
                         grows linearly from FROM tokens (step 0) to TO (the
                         last step); each emulated attention stage takes the
                         planner's mean KV load at that context
  --emulated-batch per_instance|global
                         the emulated slots per attention instance: the plan's
                         batch, or (global) the start's global batch split
                         over the step's instances; default per_instance

launcher:
  --deadline-s N         kill everything after N s, default 300
  --autoscale AS.json    the launcher decides the resizes while the run decodes
                         (docs/elastic.md, "Autoscale"): every K steps each
                         attention instance reports its workload over a pipe,
                         the launcher applies the file's AutoscaleController
                         (stepmesh_plan --autoscale-out) and tells every
                         process "no change" or "resize at S: xAyF" (S two
                         steps on). Needs --emulate-compute and
                         --context-growth; grows the attention side only
  --autoscale-every K    the checkpoint interval in steps, default 2
  --progress-s N         a progress line every N s while running (0: none), default 10
  --chrome-trace FILE    write a Chrome trace of the run: every process's
                         stepmesh trace (docs/tracing.md) merged, plus
                         attention and FFN compute
  --metrics-port P       each process serves its stepmesh Stats() at
                         http://127.0.0.1:PORT/metrics: attention a on P + a,
                         FFN p on P + X + p (docs/metrics.md)
  --metrics-file PREFIX  each process writes its final Stats() to
                         PREFIX.worker<a> / PREFIX.server<p>
  --work-dir DIR         logs and results there (kept); default a fresh
                         /tmp/afd_launch.* removed on success
  --keep-work-dir        keep the default work directory
  --scheduler-binary P   run the scheduler as that program instead of in process
  --hosts NS0,NS1,...    one emulated host (network namespace) per instance:
                         attention a on host a, FFN p on host X + p, the
                         scheduler on host 0 (scripts/cluster.sh makes them)
  --host-addrs A0,...    each host's address (with --hosts)
  --lost-attention A     attention A will be cut off by a network fault the
                         caller injects (scripts/cluster.sh fault): it must
                         fail, everyone else must finish, and the survivors'
                         results pass the reference check
  --no-reference         skip Gate A
  --no-layer-check       Gate A without the per-layer residual dumps
  --kill-ffn-after-ms N [--kill-ffn P] --expect-failure
                         SIGKILL FFN P (default the last) N ms after every
                         attention instance started decoding; passes when
                         every attention instance fails naming that server
  --inject-wrong-layer STEP:LAYER --expect-failure
                         attention 0 labels that A2F frame layer LAYER+1; passes
                         when an FFN refuses it and every process fails
  --help                 this text
)help";

// An argument error: the message, the usage line, exit 2. Never a
// "reference check" line: nothing ran, so nothing was checked.
int UsageError(absl::string_view message) {
  std::fprintf(stderr, "afd_launch: %s\n%s\n", std::string(message).c_str(), kUsageLine);
  return 2;
}

// MemAvailable from /proc/meminfo in bytes, or -1.
int64_t AvailableHostMemory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return -1;
}

double GiB(int64_t bytes) { return static_cast<double>(bytes) / (int64_t{1} << 30); }

bool IsExecutable(const std::string& path) { return ::access(path.c_str(), X_OK) == 0; }

// Everything that can be checked before a process starts: the flags, the
// config, the run against the model, memory, the backend and transport.
absl::Status Preflight(const LaunchFlags& f, ExampleModel* model,
                       std::optional<stepmesh::planner::Plan>* emulation) {
  std::string error;
  std::optional<ExampleModel> loaded = LoadExampleModel(f.shape.config, BundledConfigDir(), &error);
  if (!loaded) return absl::InvalidArgumentError(absl::StrCat("--model: ", error));
  *model = *std::move(loaded);
  const ModelConfig* config = &model->config;
  STEPMESH_RETURN_IF_ERROR(ValidateRunForModel(f.shape, *model));
  if (!f.shape.emulate_compute.empty()) {
    STEPMESH_ASSIGN_OR_RETURN(*emulation, LoadEmulationPlan(f.shape.emulate_compute));
  }
  if (f.deadline_s <= 0) return absl::InvalidArgumentError("--deadline-s must be > 0");
  if (f.progress_s < 0) return absl::InvalidArgumentError("--progress-s must be >= 0");
  if (f.expect_failure && f.kill_ffn_after_ms < 0 && f.inject_wrong_layer.empty()) {
    return absl::InvalidArgumentError(
        "--expect-failure needs --kill-ffn-after-ms or --inject-wrong-layer");
  }
  if (!f.inject_wrong_layer.empty()) {
    const std::vector<std::string> parts = absl::StrSplit(f.inject_wrong_layer, ':');
    int step = -1, layer = -1;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &step) ||
        !absl::SimpleAtoi(parts[1], &layer) || step < 0 || step >= f.shape.steps() || layer < 0 ||
        layer >= config->num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--inject-wrong-layer ", f.inject_wrong_layer, ": want STEP:LAYER within the run (",
          f.shape.steps(), " steps, ", config->num_layers, " layers)"));
    }
    if (!f.expect_failure) {
      return absl::InvalidArgumentError("--inject-wrong-layer needs --expect-failure");
    }
  }
  if (f.shape.elastic()) {
    // What a resize run does not combine with (yet): the per-step report
    // tables, traces and emulated summaries assume every instance spans the
    // run; the fault tests and the placement assume a fixed shape.
    const std::pair<bool, const char*> refused[] = {
        {!f.chrome_trace.empty(), "--chrome-trace"},
        {f.kill_ffn_after_ms >= 0, "--kill-ffn-after-ms"},
        {f.lost_attention >= 0, "--lost-attention"},
        {f.placement.enabled(), "--hosts"},
        {!f.scheduler_binary.empty(), "--scheduler-binary"},
        {f.metrics_port > 0, "--metrics-port"},
    };
    for (const auto& [given, flag] : refused) {
      if (given) {
        return absl::InvalidArgumentError(
            absl::StrCat(f.shape.resize.empty() ? "--autoscale" : "--resize", " with ", flag,
                         ": not supported"));
      }
    }
  }
  if (f.kill_ffn_after_ms >= 0 && (f.kill_ffn < -1 || f.kill_ffn >= f.shape.ffn)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kill-ffn ", f.kill_ffn, " out of range [0, ", f.shape.ffn, ")"));
  }
  // The mesh's own limits (participant counts, in-flight slots, poll mode).
  for (stepmesh::Role role : {stepmesh::Role::kWorker, stepmesh::Role::kServer}) {
    absl::StatusOr<stepmesh::MeshOptions> o = MeshOptionsFor(f.shape, role, 0, "127.0.0.1:1");
    if (!o.ok()) return o.status();
  }
  const HostMemoryEstimate mem = EstimateHostMemory(f.shape, *config);
  const int64_t need = std::max(mem.children(f.shape), f.reference ? mem.reference : 0);
  const int64_t have = AvailableHostMemory();
  if (have > 0 && need > have) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s (%.1f billion parameters) needs about %.1f GiB of host memory for this run "
        "(%d attention x %.1f GiB + %d FFN x %.1f GiB%s); %.1f GiB available",
        config->name, static_cast<double>(model->ParameterCount()) * 1e-9, GiB(need),
        f.shape.attention, GiB(mem.attention_instance), f.shape.ffn, GiB(mem.ffn_instance),
        f.reference ? absl::StrFormat("; reference %.1f GiB", GiB(mem.reference)) : "", GiB(have)));
  }
  if (f.shape.backend != "cpu_mock") {
    // Creating the backend is the check (a CUDA build, a driver, a device);
    // it is released before any child starts.
    absl::StatusOr<std::unique_ptr<stepmesh::Backend>> b =
        stepmesh::CreateBackend(f.shape.backend, 0);
    if (!b.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--backend ", f.shape.backend, " is not available here: ", b.status().message()));
    }
  }
  if (mem.device_total > 0) {
    absl::StatusOr<int64_t> free_bytes = CudaDeviceFreeBytes();
    if (!free_bytes.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--engine cuda is not available here: ", free_bytes.status().message()));
    }
    if (mem.device_total > *free_bytes) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%s needs about %.1f GiB of GPU memory for this run (every process on GPU 0); "
          "%.1f GiB free",
          config->name, GiB(mem.device_total), GiB(*free_bytes)));
    }
  }
  if (f.shape.transport == "rdma") {
    DIR* d = ::opendir("/sys/class/infiniband");
    bool any = false;
    if (d != nullptr) {
      while (const dirent* e = ::readdir(d)) any = any || e->d_name[0] != '.';
      ::closedir(d);
    }
    if (!any) {
      return absl::FailedPreconditionError(
          "--transport rdma: no RDMA device here (/sys/class/infiniband is empty)");
    }
  }
  const std::string dir = SelfDir();
  for (const std::string& program : {dir + "/afd_attention", dir + "/afd_ffn"}) {
    if (!IsExecutable(program)) {
      return absl::FailedPreconditionError(absl::StrCat(program, " is missing (build it)"));
    }
  }
  if (!f.scheduler_binary.empty() && !IsExecutable(f.scheduler_binary)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--scheduler-binary ", f.scheduler_binary, " is not an executable"));
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  absl::StatusOr<Flags> flags = Flags::Parse(
      argc, argv, {"no-reference", "no-layer-check", "expect-failure", "keep-work-dir", "help"});
  if (!flags.ok()) return UsageError(flags.status().message());
  if (flags->Bool("help")) {
    std::printf("%s\n%s", kUsageLine, kHelp);
    return 0;
  }
  LaunchFlags f;
  absl::StatusOr<RunShape> shape = ParseRunFlags(*flags);
  if (!shape.ok()) return UsageError(shape.status().message());
  f.shape = *shape;
  absl::StatusOr<int64_t> deadline = flags->Int("deadline-s", f.deadline_s);
  absl::StatusOr<int64_t> progress = flags->Int("progress-s", f.progress_s);
  absl::StatusOr<int64_t> kill_after = flags->Int("kill-ffn-after-ms", -1);
  absl::StatusOr<int64_t> kill_ffn = flags->Int("kill-ffn", -1);
  absl::StatusOr<int64_t> metrics_port = flags->Int("metrics-port", 0);
  absl::StatusOr<int64_t> lost_attention = flags->Int("lost-attention", -1);
  for (const auto* s :
       {&deadline, &progress, &kill_after, &kill_ffn, &metrics_port, &lost_attention}) {
    if (!s->ok()) return UsageError(s->status().message());
  }
  f.deadline_s = *deadline;
  f.progress_s = *progress;
  f.kill_ffn_after_ms = *kill_after;
  f.kill_ffn = static_cast<int>(*kill_ffn);
  f.chrome_trace = flags->Str("chrome-trace", "");
  f.work_dir = flags->Str("work-dir", "");
  f.scheduler_binary = flags->Str("scheduler-binary", "");
  f.reference = !flags->Bool("no-reference");
  f.layer_check = !flags->Bool("no-layer-check");
  f.expect_failure = flags->Bool("expect-failure");
  f.inject_wrong_layer = flags->Str("inject-wrong-layer", "");
  f.metrics_port = *metrics_port;
  f.metrics_file = flags->Str("metrics-file", "");
  f.lost_attention = static_cast<int>(*lost_attention);
  f.autoscale = flags->Str("autoscale", "");
  absl::StatusOr<int64_t> every = flags->Int("autoscale-every", 2);
  if (!every.ok()) return UsageError(every.status().message());
  if (!f.autoscale.empty()) {
    if (f.shape.emulate_compute.empty() || f.shape.context_growth.empty() ||
        !f.shape.resize.empty()) {
      return UsageError(
          "--autoscale needs --emulate-compute and --context-growth, and decides the resizes "
          "itself (no --resize)");
    }
    absl::StatusOr<stepmesh::planner::AutoscalePlan> plan =
        stepmesh::planner::ReadAutoscalePlan(f.autoscale);
    if (!plan.ok()) return UsageError(absl::StrCat("--autoscale: ", plan.status().message()));
    if (*every < 1 || *every > f.shape.steps()) {
      return UsageError(absl::StrCat("--autoscale-every ", *every, ": want 1 .. the run's ",
                                     f.shape.steps(), " steps"));
    }
    f.shape.max_attention = std::max(plan->max_attention, f.shape.attention);
    f.shape.decision_every = static_cast<int>(*every);
    f.shape.emulated_batch = stepmesh::planner::BatchPolicyName(plan->batch_policy);
    if (absl::Status s = f.shape.Validate(); !s.ok()) return UsageError(s.message());
    f.autoscale_plan = *std::move(plan);
  }
  if (f.lost_attention < -1 || f.lost_attention >= f.shape.attention ||
      (f.lost_attention >= 0 && (f.shape.attention < 2 || f.expect_failure))) {
    return UsageError(absl::StrCat("--lost-attention ", f.lost_attention,
                                   ": want an attention instance in [0, ", f.shape.attention,
                                   "), with at least one other and without --expect-failure"));
  }
  if (f.metrics_port < 0 || f.metrics_port + f.shape.attention + f.shape.ffn > 65536) {
    return UsageError("--metrics-port: the ports P .. P + X + Y - 1 must be in [1, 65535]");
  }
  absl::StatusOr<Placement> placement = Placement::Open(
      flags->Str("hosts", ""), flags->Str("host-addrs", ""), f.shape.attention, f.shape.ffn);
  if (!placement.ok()) return UsageError(placement.status().message());
  f.placement = *std::move(placement);
  const bool keep = flags->Bool("keep-work-dir") || !f.work_dir.empty();
  if (absl::Status s = flags->CheckAllUsed(); !s.ok()) return UsageError(s.message());
  // The emulated engine runs no model: there is nothing to check against.
  if (!f.shape.emulate_compute.empty()) f.reference = false;
  ExampleModel model;
  std::optional<stepmesh::planner::Plan> emulation;
  if (absl::Status s = Preflight(f, &model, &emulation); !s.ok()) return UsageError(s.message());
  if (f.kill_ffn < 0) f.kill_ffn = f.shape.ffn - 1;

  if (f.work_dir.empty()) {
    char tmpl[] = "/tmp/afd_launch.XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return Fail("mkdtemp failed");
    f.work_dir = tmpl;
  } else if (::mkdir(f.work_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return UsageError(absl::StrCat("--work-dir ", f.work_dir, ": ", std::strerror(errno)));
  }
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  // --autoscale: a child that died closes its pipe; the write fails (EPIPE)
  // instead of killing the launcher.
  ::signal(SIGPIPE, SIG_IGN);

  // Before any thread starts: the threads the scheduler creates inherit it.
  if (absl::Status s = f.placement.EnterSchedulerHost(); !s.ok()) return Fail(s.message());
  const std::string work_dir = f.work_dir;
  const int rc = Launcher(std::move(f), std::move(model), std::move(emulation)).Run();
  if (!keep && rc == 0) RemoveWorkDir(work_dir);
  return rc;
}

}  // namespace
}  // namespace afd::example

int main(int argc, char** argv) { return afd::example::Main(argc, argv); }
