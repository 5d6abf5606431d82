// stepmesh_perf's flags: parsing and checking them, completing the mesh from
// the environment (STEPMESH_* / DMLC_*), and the MeshOptions they make.

#include "benchmarks/perf_flags.h"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "stepmesh/stepmesh.h"

namespace stepmesh::bench {
namespace {

constexpr size_t kDefaultSweep[] = {8, 4096, 917504, 1835008, 3670016};

bool ParseInts(absl::string_view text, std::vector<int>* out) {
  out->clear();
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v)) return false;
    out->push_back(v);
  }
  return true;
}

// Where a flag's value goes; the kind of the target says how the value is read
// (a comma list for the vectors).
using FlagTarget =
    std::variant<std::string*, int*, size_t*, std::vector<int>*, std::vector<std::string>*>;

bool ReadFlagValue(absl::string_view value, const FlagTarget& target) {
  struct Reader {
    absl::string_view value;
    bool operator()(std::string* out) const {
      *out = std::string(value);
      return true;
    }
    bool operator()(int* out) const { return absl::SimpleAtoi(value, out); }
    bool operator()(size_t* out) const { return absl::SimpleAtoi(value, out); }
    bool operator()(std::vector<int>* out) const { return ParseInts(value, out); }
    bool operator()(std::vector<std::string>* out) const {
      *out = absl::StrSplit(value, ',', absl::SkipEmpty());
      return true;
    }
  };
  return std::visit(Reader{value}, target);
}

// "2A2F" -> (2, 2); "xAyF" keeps --workers/--servers.
bool ParsePattern(const std::string& p, int* workers, int* servers) {
  if (p == "xAyF") return true;
  const size_t a = p.find('A');
  if (a == std::string::npos || p.empty() || p.back() != 'F') return false;
  return absl::SimpleAtoi(p.substr(0, a), workers) &&
         absl::SimpleAtoi(p.substr(a + 1, p.size() - a - 2), servers) && *workers > 0 &&
         *servers > 0;
}

// The mesh flags over `o` (its other fields stay). ParseFlags has checked
// --poll-mode before this is called.
void SetMeshFlags(const Flags& f, MeshOptions& o) {
  o.rank = f.rank;
  o.num_workers = f.workers;
  o.num_servers = f.servers;
  o.scheduler = f.scheduler;
  o.bind_host = f.host;
  o.transport = f.transport;
  o.backend = f.backend;
  o.device = f.device;
  o.timeout = absl::Milliseconds(f.timeout_ms);
  o.threads.poll_mode = *ParsePollMode(f.poll_mode);
  o.threads.send_cores = f.send_cores;
  o.threads.recv_cores = f.recv_cores;
}

// The mesh a flag leaves unset comes from the environment (STEPMESH_* /
// DMLC_*, docs/configuration.md), as in every stepmesh program: a launcher's
// DMLC_ROLE, DMLC_NUM_WORKER, DMLC_PS_ROOT_URI, ... are not overridden by flag
// defaults. A flag that is given wins over the environment.
absl::Status TakeMeshFromEnvironment(Flags& f, const std::set<std::string>& given) {
  auto unset = [&given](const char* flag) { return given.count(flag) == 0; };
  STEPMESH_ASSIGN_OR_RETURN(std::optional<Role> role, RoleFromEnv());
  if (unset("--role") && role.has_value()) f.role = std::string(RoleName(*role));
  // The flag defaults as the base: a variable that is not set leaves them.
  MeshOptions base;
  SetMeshFlags(f, base);
  STEPMESH_ASSIGN_OR_RETURN(const MeshOptions env, MeshOptions::FromEnv(base));
  if (unset("--rank")) f.rank = env.rank;
  const bool shape_from_flags = !unset("--pattern") && f.pattern != "xAyF";
  if (!shape_from_flags) {
    if (unset("--workers")) f.workers = env.num_workers;
    if (unset("--servers")) f.servers = env.num_servers;
    f.pattern = absl::StrCat(f.workers, "A", f.servers, "F");
  }
  if (unset("--scheduler")) f.scheduler = env.scheduler;
  if (unset("--host")) f.host = env.bind_host;
  if (unset("--transport")) f.transport = env.transport;
  if (unset("--backend")) f.backend = env.backend;
  if (unset("--device")) f.device = env.device;
  if (unset("--timeout-ms")) f.timeout_ms = static_cast<int>(env.timeout / absl::Milliseconds(1));
  if (unset("--poll-mode")) f.poll_mode = std::string(PollModeName(env.threads.poll_mode));
  if (unset("--send-cores")) f.send_cores = env.threads.send_cores;
  if (unset("--recv-cores")) f.recv_cores = env.threads.recv_cores;
  return absl::OkStatus();
}

}  // namespace

int Usage(const char* why) {
  if (why != nullptr) std::fprintf(stderr, "stepmesh_perf: %s\n\n", why);
  std::fprintf(
      stderr,
      "usage: stepmesh_perf [--role launch|worker|server|scheduler] [--scheduler H:P] [--rank R]\n"
      "  [--transport tcp|rdma|libfabric] [--backend cpu_mock|cuda] [--device N]\n"
      "  [--pattern 1A1F|1A2F|2A1F|2A2F|xAyF] [--workers X --servers Y (with xAyF)]\n"
      "  [--push-bytes B] [--pull-bytes B] | [--sizes P:Q,P:Q,...]   (default sweep 8 B..3.5 MiB)\n"
      "  [--micro-batches M] [--warmup N] [--iters N] [--reps R]\n"
      "  [--poll-mode spin|adaptive|blocking] [--send-cores C,..] [--recv-cores C,..]\n"
      "  [--baseline raw-tcp,raw-naive,zmq,memcpy] [--json FILE]\n"
      "  [--host IP] [--server-hosts IP,..] [--baseline-port P] [--threads]\n"
      "  [--deadline-s S] [--timeout-ms T] [--sockbuf BYTES]\n"
      "  [--metrics-port P] [--metrics-file PATH]   (docs/metrics.md)\n"
      "  [--chrome-trace PATH]   each participant's trace as PATH.<role><rank>.json; merge\n"
      "                          them with stepmesh_trace_merge (docs/tracing.md)\n"
      "Unset mesh flags (role, rank, pattern, scheduler, host, transport, backend, device,\n"
      "poll mode, cores, timeout) come from STEPMESH_* / DMLC_* (docs/configuration.md).\n");
  return 2;
}

absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  Flags f;
  std::set<std::string> given;
  f.command_line = absl::StrJoin(argv, argv + argc, " ");
  size_t push = 0, pull = 0;
  std::string sizes_text;
  // Every flag that takes a value, and where the value goes (--threads takes none).
  const std::pair<absl::string_view, FlagTarget> targets[] = {{"--role", &f.role},
                                                              {"--scheduler", &f.scheduler},
                                                              {"--rank", &f.rank},
                                                              {"--transport", &f.transport},
                                                              {"--backend", &f.backend},
                                                              {"--device", &f.device},
                                                              {"--pattern", &f.pattern},
                                                              {"--workers", &f.workers},
                                                              {"--servers", &f.servers},
                                                              {"--push-bytes", &push},
                                                              {"--pull-bytes", &pull},
                                                              {"--sizes", &sizes_text},
                                                              {"--micro-batches", &f.micro_batches},
                                                              {"--warmup", &f.warmup},
                                                              {"--iters", &f.iters},
                                                              {"--reps", &f.reps},
                                                              {"--poll-mode", &f.poll_mode},
                                                              {"--send-cores", &f.send_cores},
                                                              {"--recv-cores", &f.recv_cores},
                                                              {"--baseline", &f.baselines},
                                                              {"--json", &f.json},
                                                              {"--host", &f.host},
                                                              {"--server-hosts", &f.server_hosts},
                                                              {"--baseline-port", &f.baseline_port},
                                                              {"--deadline-s", &f.deadline_s},
                                                              {"--timeout-ms", &f.timeout_ms},
                                                              {"--sockbuf", &f.sockbuf},
                                                              {"--metrics-port", &f.metrics_port},
                                                              {"--metrics-file", &f.metrics_file},
                                                              {"--chrome-trace", &f.chrome_trace},
                                                              {"--parent-pid", &f.parent_pid}};
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::string value;
    if (const size_t eq = flag.find('='); eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag.resize(eq);
    } else if (flag == "--threads") {
      f.threads = true;
      continue;
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("missing value for ", flag));
    }
    const auto target = std::find_if(std::begin(targets), std::end(targets),
                                     [&](const auto& t) { return t.first == flag; });
    if (target == std::end(targets)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", flag));
    }
    if (!ReadFlagValue(value, target->second)) {
      return absl::InvalidArgumentError(absl::StrCat("bad value for ", flag, ": ", value));
    }
    given.insert(flag);
  }
  if (!ParsePattern(f.pattern, &f.workers, &f.servers) || f.workers < 1 || f.servers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("bad pattern ", f.pattern));
  }
  if (!ParsePollMode(f.poll_mode).ok()) return absl::InvalidArgumentError("bad --poll-mode");
  STEPMESH_RETURN_IF_ERROR(TakeMeshFromEnvironment(f, given));
  if (f.workers + f.servers - 1 > kMaxChildren) {
    return absl::InvalidArgumentError(absl::StrCat("--workers ", f.workers, " + --servers ",
                                                   f.servers, " - 1 = ", f.workers + f.servers - 1,
                                                   " child processes, more than ", kMaxChildren));
  }
  if (!sizes_text.empty()) {
    for (absl::string_view pair : absl::StrSplit(sizes_text, ',', absl::SkipEmpty())) {
      std::pair<std::string, std::string> pq = absl::StrSplit(pair, absl::MaxSplits(':', 1));
      size_t p = 0, q = 0;
      if (!absl::SimpleAtoi(pq.first, &p)) return absl::InvalidArgumentError("bad --sizes");
      if (pq.second.empty())
        q = p;
      else if (!absl::SimpleAtoi(pq.second, &q))
        return absl::InvalidArgumentError("bad --sizes");
      f.sizes.push_back({p, q});
    }
  } else if (push > 0 || pull > 0) {
    f.sizes.push_back({push > 0 ? push : pull, pull > 0 ? pull : push});
  } else {
    for (size_t s : kDefaultSweep) f.sizes.push_back({s, s});
  }
  for (const auto& [p, q] : f.sizes) {
    if (p == 0 || q == 0) return absl::InvalidArgumentError("sizes must be at least 1 byte");
  }
  for (const std::string& b : f.baselines) {
    if (b != "raw-tcp" && b != "raw-naive" && b != "zmq" && b != "memcpy") {
      return absl::InvalidArgumentError(absl::StrCat("unknown baseline ", b));
    }
  }
  if (f.micro_batches < 1 || f.micro_batches > 32 || f.iters < 1 || f.warmup < 0 || f.reps < 1 ||
      f.reps > f.iters) {
    return absl::InvalidArgumentError("bad --micro-batches/--iters/--warmup/--reps");
  }
  if (!ParsePollMode(f.poll_mode).ok()) return absl::InvalidArgumentError("bad --poll-mode");
  return f;
}

bool Wants(const Flags& f, absl::string_view baseline) {
  return std::find(f.baselines.begin(), f.baselines.end(), baseline) != f.baselines.end();
}

MeshOptions MakeOptions(const Flags& f, Role role) {
  // STEPMESH_* variables (spin budget, RDMA knobs, ...) apply; the flags below win.
  absl::StatusOr<MeshOptions> from_env = MeshOptions::FromEnv();
  if (!from_env.ok()) {
    std::fprintf(stderr, "stepmesh_perf: ignoring the environment: %s\n",
                 from_env.status().ToString().c_str());
  }
  MeshOptions o = from_env.ok() ? *from_env : MeshOptions();
  // The flags, completed from the environment where unset (TakeMeshFromEnvironment).
  o.role = role;
  SetMeshFlags(f, o);
  o.max_inflight_requests = std::max(64, 2 * f.micro_batches);
  // --chrome-trace without STEPMESH_TRACE_EVENTS: the newest 64 Ki requests.
  if (!f.chrome_trace.empty() && o.trace.events == 0) o.trace.events = 1 << 16;
  return o;
}

}  // namespace stepmesh::bench
