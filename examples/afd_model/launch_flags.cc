// afd_launch's command line (launch_flags.h).

#include "examples/afd_model/launch_flags.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "examples/afd_model/afd_engine.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/emulated_compute.h"
#include "examples/afd_model/launch_child.h"

namespace afd::example {
namespace {

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
}  // namespace

void PrintHelp() { std::printf("%s\n%s", kUsageLine, kHelp); }

int UsageError(absl::string_view message) {
  std::fprintf(stderr, "afd_launch: %s\n%s\n", std::string(message).c_str(), kUsageLine);
  return 2;
}

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

absl::StatusOr<LaunchRequest> ParseLaunchFlags(int argc, char** argv) {
  LaunchRequest request;
  absl::StatusOr<Flags> flags = Flags::Parse(
      argc, argv, {"no-reference", "no-layer-check", "expect-failure", "keep-work-dir", "help"});
  if (!flags.ok()) return flags.status();
  if (flags->Bool("help")) {
    request.help = true;
    return request;
  }
  LaunchFlags& f = request.flags;
  absl::StatusOr<RunShape> shape = ParseRunFlags(*flags);
  if (!shape.ok()) return shape.status();
  f.shape = *shape;
  absl::StatusOr<int64_t> deadline = flags->Int("deadline-s", f.deadline_s);
  absl::StatusOr<int64_t> progress = flags->Int("progress-s", f.progress_s);
  absl::StatusOr<int64_t> kill_after = flags->Int("kill-ffn-after-ms", -1);
  absl::StatusOr<int64_t> kill_ffn = flags->Int("kill-ffn", -1);
  absl::StatusOr<int64_t> metrics_port = flags->Int("metrics-port", 0);
  absl::StatusOr<int64_t> lost_attention = flags->Int("lost-attention", -1);
  for (const auto* s :
       {&deadline, &progress, &kill_after, &kill_ffn, &metrics_port, &lost_attention}) {
    if (!s->ok()) return s->status();
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
  if (!every.ok()) return every.status();
  if (!f.autoscale.empty()) {
    if (f.shape.emulate_compute.empty() || f.shape.context_growth.empty() ||
        !f.shape.resize.empty()) {
      return absl::InvalidArgumentError(
          "--autoscale needs --emulate-compute and --context-growth, and decides the resizes "
          "itself (no --resize)");
    }
    absl::StatusOr<stepmesh::planner::AutoscalePlan> plan =
        stepmesh::planner::ReadAutoscalePlan(f.autoscale);
    if (!plan.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--autoscale: ", plan.status().message()));
    }
    if (*every < 1 || *every > f.shape.steps()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--autoscale-every ", *every, ": want 1 .. the run's ", f.shape.steps(), " steps"));
    }
    f.shape.max_attention = std::max(plan->max_attention, f.shape.attention);
    f.shape.decision_every = static_cast<int>(*every);
    f.shape.emulated_batch = stepmesh::planner::BatchPolicyName(plan->batch_policy);
    STEPMESH_RETURN_IF_ERROR(f.shape.Validate());
    f.autoscale_plan = *std::move(plan);
  }
  if (f.lost_attention < -1 || f.lost_attention >= f.shape.attention ||
      (f.lost_attention >= 0 && (f.shape.attention < 2 || f.expect_failure))) {
    return absl::InvalidArgumentError(
        absl::StrCat("--lost-attention ", f.lost_attention, ": want an attention instance in [0, ",
                     f.shape.attention, "), with at least one other and without --expect-failure"));
  }
  if (f.metrics_port < 0 || f.metrics_port + f.shape.attention + f.shape.ffn > 65536) {
    return absl::InvalidArgumentError(
        "--metrics-port: the ports P .. P + X + Y - 1 must be in [1, 65535]");
  }
  absl::StatusOr<Placement> placement = Placement::Open(
      flags->Str("hosts", ""), flags->Str("host-addrs", ""), f.shape.attention, f.shape.ffn);
  if (!placement.ok()) return placement.status();
  f.placement = *std::move(placement);
  request.keep_work_dir = flags->Bool("keep-work-dir") || !f.work_dir.empty();
  STEPMESH_RETURN_IF_ERROR(flags->CheckAllUsed());
  // The emulated engine runs no model: there is nothing to check against.
  if (!f.shape.emulate_compute.empty()) f.reference = false;
  return request;
}

}  // namespace afd::example
