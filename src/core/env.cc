// The one place stepmesh reads the environment. Every name is in kEnvTable and
// in docs/configuration.md; unknown STEPMESH_* names produce a warning.

#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <string>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "src/base/logging.h"
#include "stepmesh/options.h"
#include "stepmesh/status.h"

extern char** environ;

namespace stepmesh {
namespace {

absl::StatusOr<int> ParseInt(absl::string_view name, absl::string_view value) {
  int out = 0;
  if (!absl::SimpleAtoi(value, &out)) {
    return absl::InvalidArgumentError(absl::StrCat(name, "='", value, "' is not an integer"));
  }
  return out;
}

absl::StatusOr<bool> ParseBool(absl::string_view name, absl::string_view value) {
  bool out = false;
  if (!absl::SimpleAtob(value, &out)) {
    return absl::InvalidArgumentError(absl::StrCat(name, "='", value, "' is not a boolean"));
  }
  return out;
}

// Durations accept absl syntax ("250ms", "30s") or a bare number of milliseconds.
absl::StatusOr<absl::Duration> ParseDuration(absl::string_view name, absl::string_view value) {
  absl::Duration d;
  if (absl::ParseDuration(value, &d)) return d;
  int64_t ms = 0;
  if (absl::SimpleAtoi(value, &ms)) return absl::Milliseconds(ms);
  return absl::InvalidArgumentError(absl::StrCat(name, "='", value, "' is not a duration"));
}

absl::StatusOr<std::vector<int>> ParseCores(absl::string_view name, absl::string_view value) {
  std::vector<int> cores;
  for (absl::string_view part : absl::StrSplit(value, ',', absl::SkipEmpty())) {
    STEPMESH_ASSIGN_OR_RETURN(int core, ParseInt(name, part));
    if (core < 0) return absl::InvalidArgumentError(absl::StrCat(name, ": negative core"));
    cores.push_back(core);
  }
  return cores;
}

absl::StatusOr<Role> ParseRole(absl::string_view name, absl::string_view value) {
  // DMLC_ROLE uses worker/server/scheduler, as do we.
  if (value == "worker") return Role::kWorker;
  if (value == "server") return Role::kServer;
  if (value == "scheduler") return Role::kScheduler;
  return absl::InvalidArgumentError(absl::StrCat(name, "='", value, "' is not a role"));
}

struct EnvEntry {
  const char* name;
  std::function<absl::Status(absl::string_view, MeshOptions&)> apply;
};

// RDMA entries name their variable in every error (ranges: RdmaOptions::Validate).
EnvEntry RdmaInt(const char* name, int RdmaOptions::*field) {
  return {name, [name, field](absl::string_view v, MeshOptions& o) -> absl::Status {
            STEPMESH_ASSIGN_OR_RETURN(o.rdma.*field, ParseInt(name, v));
            return absl::OkStatus();
          }};
}
EnvEntry RdmaString(const char* name, std::string RdmaOptions::*field) {
  return {name, [field](absl::string_view v, MeshOptions& o) -> absl::Status {
            o.rdma.*field = std::string(v);
            return absl::OkStatus();
          }};
}

#define STEPMESH_ENV_INT(field) \
  [](absl::string_view v, MeshOptions& o) -> absl::Status { \
    STEPMESH_ASSIGN_OR_RETURN(o.field, ParseInt(#field, v)); return absl::OkStatus(); }
#define STEPMESH_ENV_STR(field) \
  [](absl::string_view v, MeshOptions& o) -> absl::Status { o.field = std::string(v); return absl::OkStatus(); }
#define STEPMESH_ENV_DURATION(field) \
  [](absl::string_view v, MeshOptions& o) -> absl::Status { \
    STEPMESH_ASSIGN_OR_RETURN(o.field, ParseDuration(#field, v)); return absl::OkStatus(); }

// The documented table (docs/configuration.md mirrors it).
const std::vector<EnvEntry>& EnvTable() {
  static const std::vector<EnvEntry> table = {
      {"STEPMESH_ROLE",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(o.role, ParseRole("STEPMESH_ROLE", v));
         return absl::OkStatus();
       }},
      {"STEPMESH_RANK", STEPMESH_ENV_INT(rank)},
      {"STEPMESH_NUM_WORKERS", STEPMESH_ENV_INT(num_workers)},
      {"STEPMESH_NUM_SERVERS", STEPMESH_ENV_INT(num_servers)},
      {"STEPMESH_SCHEDULER", STEPMESH_ENV_STR(scheduler)},
      {"STEPMESH_BIND_HOST", STEPMESH_ENV_STR(bind_host)},
      {"STEPMESH_TRANSPORT",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         // An unknown value is refused here, naming the variable, not later.
         if (v != "tcp" && v != "rdma" && v != "auto") {
           return absl::InvalidArgumentError("unknown transport (want tcp, rdma or auto)");
         }
         o.transport = std::string(v);
         return absl::OkStatus();
       }},
      {"STEPMESH_BACKEND", STEPMESH_ENV_STR(backend)},
      {"STEPMESH_DEVICE", STEPMESH_ENV_INT(device)},
      // Read by CUDA itself; the cuda backend must know it too (one hardware queue).
      {"CUDA_DEVICE_MAX_CONNECTIONS", STEPMESH_ENV_INT(cuda_device_max_connections)},
      RdmaString("STEPMESH_RDMA_DEVICE", &RdmaOptions::device),
      RdmaInt("STEPMESH_RDMA_PORT", &RdmaOptions::port),
      RdmaInt("STEPMESH_RDMA_GID_INDEX", &RdmaOptions::gid_index),
      RdmaString("STEPMESH_RDMA_INTERFACE", &RdmaOptions::interface),
      RdmaInt("STEPMESH_RDMA_TRAFFIC_CLASS", &RdmaOptions::traffic_class),
      RdmaInt("STEPMESH_RDMA_SERVICE_LEVEL", &RdmaOptions::service_level),
      RdmaInt("STEPMESH_RDMA_PATH_MTU", &RdmaOptions::path_mtu),
      RdmaInt("STEPMESH_RDMA_ACK_TIMEOUT", &RdmaOptions::ack_timeout),
      RdmaInt("STEPMESH_RDMA_RETRY_COUNT", &RdmaOptions::retry_count),
      RdmaInt("STEPMESH_RDMA_RNR_RETRY", &RdmaOptions::rnr_retry),
      RdmaInt("STEPMESH_RDMA_MIN_RNR_TIMER", &RdmaOptions::min_rnr_timer),
      RdmaInt("STEPMESH_RDMA_RECV_DEPTH", &RdmaOptions::recv_depth),
      RdmaInt("STEPMESH_RDMA_QPS_PER_PEER", &RdmaOptions::qps_per_peer),
      {"STEPMESH_RDMA_STRIPE_MIN_BYTES", [](absl::string_view v, MeshOptions& o) -> absl::Status {
         if (!absl::SimpleAtoi(v, &o.rdma.stripe_min_bytes)) {
           return absl::InvalidArgumentError(
               absl::StrCat("STEPMESH_RDMA_STRIPE_MIN_BYTES='", v, "' is not an integer"));
         }
         return absl::OkStatus();
       }},
      {"STEPMESH_RDMA_GPUDIRECT", [](absl::string_view v, MeshOptions& o) -> absl::Status {
         absl::StatusOr<GpuDirect> mode = ParseGpuDirect(v);
         if (!mode.ok()) {
           return absl::InvalidArgumentError(
               absl::StrCat("STEPMESH_RDMA_GPUDIRECT: ", mode.status().message()));
         }
         o.rdma.gpudirect = *mode;
         return absl::OkStatus();
       }},
      {"STEPMESH_POLL_MODE",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(o.threads.poll_mode, ParsePollMode(v));
         return absl::OkStatus();
       }},
      {"STEPMESH_SPIN_BUDGET", STEPMESH_ENV_DURATION(threads.spin_budget)},
      {"STEPMESH_SEND_CORES",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         if (v == "auto") {
           o.threads.auto_pin = true;
           return absl::OkStatus();
         }
         STEPMESH_ASSIGN_OR_RETURN(o.threads.send_cores, ParseCores("STEPMESH_SEND_CORES", v));
         return absl::OkStatus();
       }},
      {"STEPMESH_RECV_CORES",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         if (v == "auto") {
           o.threads.auto_pin = true;
           return absl::OkStatus();
         }
         STEPMESH_ASSIGN_OR_RETURN(o.threads.recv_cores, ParseCores("STEPMESH_RECV_CORES", v));
         return absl::OkStatus();
       }},
      {"STEPMESH_TIMEOUT", STEPMESH_ENV_DURATION(timeout)},
      {"STEPMESH_HEARTBEAT_INTERVAL", STEPMESH_ENV_DURATION(heartbeat_interval)},
      {"STEPMESH_MAX_INFLIGHT", STEPMESH_ENV_INT(max_inflight_requests)},
      {"STEPMESH_MAX_REGISTRATIONS", STEPMESH_ENV_INT(max_registrations)},
      {"STEPMESH_AUTH_TOKEN", STEPMESH_ENV_STR(auth_token)},
      {"STEPMESH_AUTH",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(o.auth, ParseAuthMode(v));
         return absl::OkStatus();
       }},
      {"STEPMESH_MESH_ID", STEPMESH_ENV_STR(mesh_id)},
      {"STEPMESH_PAYLOAD_CHECKSUM",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(o.payload_checksum, ParseBool("STEPMESH_PAYLOAD_CHECKSUM", v));
         return absl::OkStatus();
       }},
      {"STEPMESH_TRACE",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(o.trace.enabled, ParseBool("STEPMESH_TRACE", v));
         return absl::OkStatus();
       }},
      {"STEPMESH_LOG_LEVEL",
       [](absl::string_view v, MeshOptions&) -> absl::Status {
         using base::LogLevel;
         if (v == "debug")
           base::SetLogThreshold(LogLevel::kDebug);
         else if (v == "info")
           base::SetLogThreshold(LogLevel::kInfo);
         else if (v == "warning")
           base::SetLogThreshold(LogLevel::kWarning);
         else if (v == "error")
           base::SetLogThreshold(LogLevel::kError);
         else
           return absl::InvalidArgumentError("want debug, info, warning or error");
         return absl::OkStatus();
       }},
      // StepMesh / ps-lite names, so existing launch scripts keep working.
      {"DMLC_ROLE",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(o.role, ParseRole("DMLC_ROLE", v));
         return absl::OkStatus();
       }},
      {"DMLC_ENABLE_RDMA",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         // ps-lite's switch: empty, 0 or false is TCP, anything else RDMA.
         o.transport = (v.empty() || v == "0" || v == "false") ? "tcp" : "rdma";
         return absl::OkStatus();
       }},
      {"DMLC_NUM_WORKER", STEPMESH_ENV_INT(num_workers)},
      {"DMLC_NUM_SERVER", STEPMESH_ENV_INT(num_servers)},
      {"DMLC_PS_ROOT_URI",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         const size_t colon = o.scheduler.rfind(':');
         const std::string port = colon == std::string::npos ? "9000" : o.scheduler.substr(colon + 1);
         o.scheduler = absl::StrCat(v, ":", port);
         return absl::OkStatus();
       }},
      {"DMLC_PS_ROOT_PORT",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(int port, ParseInt("DMLC_PS_ROOT_PORT", v));
         const size_t colon = o.scheduler.rfind(':');
         o.scheduler = absl::StrCat(o.scheduler.substr(0, colon), ":", port);
         return absl::OkStatus();
       }},
  };
  return table;
}

}  // namespace

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kScheduler: return "scheduler";
    case Role::kWorker: return "worker";
    case Role::kServer: return "server";
  }
  return "invalid";
}

absl::StatusOr<PollMode> ParsePollMode(absl::string_view name) {
  if (name == "spin") return PollMode::kSpin;
  if (name == "adaptive") return PollMode::kAdaptive;
  if (name == "blocking") return PollMode::kBlocking;
  return absl::InvalidArgumentError(
      absl::StrCat("poll mode '", name, "' (want spin, adaptive or blocking)"));
}

absl::string_view PollModeName(PollMode mode) {
  switch (mode) {
    case PollMode::kSpin: return "spin";
    case PollMode::kAdaptive: return "adaptive";
    case PollMode::kBlocking: return "blocking";
  }
  return "invalid";
}

absl::StatusOr<AuthMode> ParseAuthMode(absl::string_view name) {
  if (name == "auto") return AuthMode::kAuto;
  if (name == "on") return AuthMode::kOn;
  if (name == "off") return AuthMode::kOff;
  return absl::InvalidArgumentError(absl::StrCat("auth mode '", name, "' (want auto, on or off)"));
}

absl::string_view AuthModeName(AuthMode mode) {
  switch (mode) {
    case AuthMode::kAuto:
      return "auto";
    case AuthMode::kOn:
      return "on";
    case AuthMode::kOff:
      return "off";
  }
  return "invalid";
}

absl::StatusOr<GpuDirect> ParseGpuDirect(absl::string_view name) {
  if (name == "auto") return GpuDirect::kAuto;
  if (name == "off") return GpuDirect::kOff;
  if (name == "require") return GpuDirect::kRequire;
  return absl::InvalidArgumentError(
      absl::StrCat("GPUDirect mode '", name, "' (want auto, off or require)"));
}

absl::string_view GpuDirectName(GpuDirect mode) {
  switch (mode) {
    case GpuDirect::kAuto: return "auto";
    case GpuDirect::kOff: return "off";
    case GpuDirect::kRequire: return "require";
  }
  return "invalid";
}

absl::StatusOr<MeshOptions> MeshOptions::FromEnv(const MeshOptions& base) {
  MeshOptions options = base;
  // DMLC_* first so that STEPMESH_* (listed earlier) wins over them: apply in two passes.
  for (bool dmlc_pass : {true, false}) {
    for (const EnvEntry& entry : EnvTable()) {
      if (absl::StartsWith(entry.name, "DMLC_") != dmlc_pass) continue;
      const char* value = std::getenv(entry.name);
      if (value == nullptr) continue;
      // Every error names the variable and its value, whatever the parser said.
      if (absl::Status s = entry.apply(value, options); !s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(entry.name, "='", value, "': ", s.message()));
      }
    }
  }
  for (char** env = environ; env != nullptr && *env != nullptr; ++env) {
    absl::string_view var(*env);
    // ps-lite launch scripts set DMLC_* names this library does not read: say so.
    if (!absl::StartsWith(var, "STEPMESH_") && !absl::StartsWith(var, "DMLC_")) continue;
    absl::string_view name = var.substr(0, var.find('='));
    // Read by the Python fserver layer (python/stepmesh/fserver.py), not here.
    constexpr absl::string_view kReadByPython[] = {"DMLC_GROUP_SIZE", "DMLC_NODE_RANK",
                                                   "DMLC_RANK_OFFSET", "STEPMESH_GPU"};
    bool known = absl::c_linear_search(kReadByPython, name);
    for (const EnvEntry& entry : EnvTable()) known = known || name == entry.name;
    if (!known) STEPMESH_LOG(kWarning, "unknown environment variable ", name, " ignored");
  }
  STEPMESH_RETURN_IF_ERROR(options.Validate());
  return options;
}

absl::StatusOr<MeshOptions> MeshOptions::FromEnv() { return FromEnv(MeshOptions()); }

absl::Status MeshOptions::Validate() const {
  if (cuda_device_max_connections < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_device_max_connections=", cuda_device_max_connections, " (0: unset, or >= 1)"));
  }
  if (num_workers < 1 || num_workers > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("num_workers=", num_workers, " (1..4096)"));
  }
  if (num_servers < 1 || num_servers > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("num_servers=", num_servers, " (1..4096)"));
  }
  const int peers = role == Role::kWorker ? num_workers : num_servers;
  if (role != Role::kScheduler && (rank < -1 || rank >= peers)) {
    return absl::InvalidArgumentError(
        absl::StrCat(RoleName(role), " rank ", rank, " out of range [0, ", peers, ")"));
  }
  if (scheduler.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("scheduler '", scheduler, "' is not host:port"));
  }
  if (transport != "tcp" && transport != "rdma" && transport != "auto") {
    return absl::InvalidArgumentError(absl::StrCat("transport '", transport, "' (tcp|rdma|auto)"));
  }
  if (timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout must be > 0");
  if (max_inflight_requests < 1 || max_inflight_requests > (1 << 20)) {
    return absl::InvalidArgumentError("max_inflight_requests out of range");
  }
  if (max_registrations < 1) return absl::InvalidArgumentError("max_registrations must be >= 1");
  if (auth == AuthMode::kOn && auth_token.empty()) {
    return absl::InvalidArgumentError(
        "auth=on (STEPMESH_AUTH) needs an auth_token (STEPMESH_AUTH_TOKEN)");
  }
  if (mesh_id.size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat("mesh_id (STEPMESH_MESH_ID) of ", mesh_id.size(),
                                                   " characters (at most 256)"));
  }
  return rdma.Validate();
}

absl::Status RdmaOptions::Validate() const {
  // Each message names the field and the variable that sets it.
  auto range = [](const char* field, const char* variable, int64_t value, int64_t lo,
                  int64_t hi) -> absl::Status {
    if (value >= lo && value <= hi) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("rdma.", field, "=", value, " (", variable,
                                                   "): want ", lo, "..", hi));
  };
  STEPMESH_RETURN_IF_ERROR(range("port", "STEPMESH_RDMA_PORT", port, 0, 255));
  STEPMESH_RETURN_IF_ERROR(range("gid_index", "STEPMESH_RDMA_GID_INDEX", gid_index, -1, 65535));
  STEPMESH_RETURN_IF_ERROR(
      range("traffic_class", "STEPMESH_RDMA_TRAFFIC_CLASS", traffic_class, 0, 255));
  STEPMESH_RETURN_IF_ERROR(
      range("service_level", "STEPMESH_RDMA_SERVICE_LEVEL", service_level, 0, 15));
  if (path_mtu != 0 && path_mtu != 256 && path_mtu != 512 && path_mtu != 1024 &&
      path_mtu != 2048 && path_mtu != 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rdma.path_mtu=", path_mtu, " (STEPMESH_RDMA_PATH_MTU): want 0, 256, 512, 1024, 2048 or 4096"));
  }
  STEPMESH_RETURN_IF_ERROR(range("ack_timeout", "STEPMESH_RDMA_ACK_TIMEOUT", ack_timeout, 1, 31));
  STEPMESH_RETURN_IF_ERROR(range("retry_count", "STEPMESH_RDMA_RETRY_COUNT", retry_count, 0, 7));
  STEPMESH_RETURN_IF_ERROR(range("rnr_retry", "STEPMESH_RDMA_RNR_RETRY", rnr_retry, 0, 6));
  STEPMESH_RETURN_IF_ERROR(
      range("min_rnr_timer", "STEPMESH_RDMA_MIN_RNR_TIMER", min_rnr_timer, 1, 31));
  STEPMESH_RETURN_IF_ERROR(range("recv_depth", "STEPMESH_RDMA_RECV_DEPTH", recv_depth, 4, 8192));
  STEPMESH_RETURN_IF_ERROR(
      range("qps_per_peer", "STEPMESH_RDMA_QPS_PER_PEER", qps_per_peer, 1, 2));
  STEPMESH_RETURN_IF_ERROR(range("stripe_min_bytes", "STEPMESH_RDMA_STRIPE_MIN_BYTES",
                                 stripe_min_bytes, 8192, int64_t{1} << 40));
  return absl::OkStatus();
}

}  // namespace stepmesh
