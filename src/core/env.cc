// The one place stepmesh reads the environment. Every name is in EnvTable(),
// from which docs/configuration.md's tables are generated
// (scripts/gen-config-doc.sh); unknown STEPMESH_* / DMLC_* names are warned once.

#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/base/const_init.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "src/base/logging.h"
#include "src/core/env_table.h"
#include "stepmesh/options.h"
#include "stepmesh/status.h"

extern char** environ;

namespace stepmesh {
namespace {

// The parsers say what is wrong with a value; FromEnv prefixes NAME='value'.
absl::StatusOr<int> ParseInt(absl::string_view value) {
  int out = 0;
  if (!absl::SimpleAtoi(value, &out)) return absl::InvalidArgumentError("not an integer");
  return out;
}

absl::StatusOr<bool> ParseBool(absl::string_view value) {
  bool out = false;
  if (!absl::SimpleAtob(value, &out)) {
    return absl::InvalidArgumentError("not a boolean (want true, false, yes, no, 1 or 0)");
  }
  return out;
}

// Durations accept absl syntax ("250ms", "30s") or a bare number of milliseconds.
absl::StatusOr<absl::Duration> ParseDuration(absl::string_view value) {
  absl::Duration d;
  if (absl::ParseDuration(value, &d)) return d;
  int64_t ms = 0;
  if (absl::SimpleAtoi(value, &ms)) return absl::Milliseconds(ms);
  return absl::InvalidArgumentError("not a duration (want 250ms, 2s, ... or milliseconds)");
}

absl::StatusOr<std::vector<int>> ParseCores(absl::string_view value) {
  std::vector<int> cores;
  for (absl::string_view part : absl::StrSplit(value, ',', absl::SkipEmpty())) {
    int core = 0;
    if (!absl::SimpleAtoi(part, &core) || core < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", part, "' is not a core number (want 2,3 or auto)"));
    }
    cores.push_back(core);
  }
  return cores;
}

absl::StatusOr<Role> ParseRole(absl::string_view value) {
  // DMLC_ROLE uses worker/server/scheduler, as do we.
  if (value == "worker") return Role::kWorker;
  if (value == "server") return Role::kServer;
  if (value == "scheduler") return Role::kScheduler;
  return absl::InvalidArgumentError("not a role (want worker, server or scheduler)");
}

// One row of the environment table: the variable, what it sets, its default
// and meaning (docs/configuration.md is generated from these, see
// scripts/gen-config-doc.sh), and how a value is applied.
struct EnvEntry {
  const char* name;
  const char* field;          // the MeshOptions field, "" when none
  const char* default_value;  // as the docs show it
  std::string meaning;        // markdown, one line
  std::function<absl::Status(absl::string_view, MeshOptions&)> apply;
  bool stepmesh = false;  // one of StepMesh's own names: the StepMesh section of the docs
};

// A value of an enumeration: one of `accepted`, else an error listing them.
absl::Status CheckOneOf(absl::string_view value,
                        std::initializer_list<absl::string_view> accepted) {
  if (absl::c_linear_search(accepted, value)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("not one of ", absl::StrJoin(accepted, ", ")));
}

// RDMA entries name their variable in every error (ranges: RdmaOptions::Validate).
EnvEntry RdmaInt(const char* name, const char* field_name, const char* default_value,
                 const char* meaning, int RdmaOptions::*field) {
  return {name, field_name, default_value, meaning,
          [field](absl::string_view v, MeshOptions& o) -> absl::Status {
            STEPMESH_ASSIGN_OR_RETURN(o.rdma.*field, ParseInt(v));
            return absl::OkStatus();
          }};
}
EnvEntry RdmaString(const char* name, const char* field_name, const char* default_value,
                    const char* meaning, std::string RdmaOptions::*field) {
  return {name, field_name, default_value, meaning,
          [field](absl::string_view v, MeshOptions& o) -> absl::Status {
            o.rdma.*field = std::string(v);
            return absl::OkStatus();
          }};
}

#define STEPMESH_ENV_INT(field)                             \
  [](absl::string_view v, MeshOptions& o) -> absl::Status { \
    STEPMESH_ASSIGN_OR_RETURN(o.field, ParseInt(v));        \
    return absl::OkStatus();                                \
  }
#define STEPMESH_ENV_STR(field)                             \
  [](absl::string_view v, MeshOptions& o) -> absl::Status { \
    o.field = std::string(v);                               \
    return absl::OkStatus();                                \
  }
#define STEPMESH_ENV_DURATION(field)                        \
  [](absl::string_view v, MeshOptions& o) -> absl::Status { \
    STEPMESH_ASSIGN_OR_RETURN(o.field, ParseDuration(v));   \
    return absl::OkStatus();                                \
  }
#define STEPMESH_ENV_BOOL(field)                            \
  [](absl::string_view v, MeshOptions& o) -> absl::Status { \
    STEPMESH_ASSIGN_OR_RETURN(o.field, ParseBool(v));       \
    return absl::OkStatus();                                \
  }

absl::Status ApplyCores(absl::string_view v, std::vector<int>& cores, MeshOptions& o) {
  if (v == "auto") {
    o.threads.auto_pin = true;
    return absl::OkStatus();
  }
  STEPMESH_ASSIGN_OR_RETURN(cores, ParseCores(v));
  return absl::OkStatus();
}

// ps-lite / StepMesh van types (DMLC_ENABLE_RDMA, DMLC_PS_VAN_TYPE).
absl::Status ApplyVanType(absl::string_view v, MeshOptions& o) {
  if (v.empty() || v == "0" || v == "false" || v == "zmq") {
    o.transport = "tcp";
  } else if (v == "1" || v == "true" || v == "ibverbs") {
    o.transport = "rdma";
  } else if (v == "fabric") {
    o.transport = "libfabric";
  } else {
    return absl::InvalidArgumentError(
        "not a van this library has (want zmq, 0, ibverbs, 1 or fabric; ucx, tp and multivan "
        "have no counterpart)");
  }
  return absl::OkStatus();
}

// Says once per process that `name` is set and why it changes nothing.
void WarnIgnoredOnce(absl::string_view name, absl::string_view reason) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* warned = new std::set<std::string>();
  absl::MutexLock lock(&mu);
  if (!warned->insert(std::string(name)).second) return;
  STEPMESH_LOG(kWarning, "environment variable ", name, " ignored: ", reason);
}

// A StepMesh variable accepted (a launch script sets it) with no effect here.
// A variable of the Python layer: a row of the table (documented, known to
// the unknown-name check) that FromEnv leaves alone; the Python module reads
// it through EnvironmentValue and parses it itself.
EnvEntry ReadByPython(const char* name, const char* default_value, const char* meaning) {
  return {name, "", default_value, meaning,
          [](absl::string_view, MeshOptions&) -> absl::Status { return absl::OkStatus(); }};
}

EnvEntry Ignored(const char* name, const char* reason) {
  return {name,
          "",
          "—",
          absl::StrCat("ignored (named once in the log): ", reason).c_str(),
          [name, reason](absl::string_view, MeshOptions&) -> absl::Status {
            WarnIgnoredOnce(name, reason);
            return absl::OkStatus();
          },
          true};
}

// The one environment table. STEPMESH_RDMA_* rows form the RDMA section of
// docs/configuration.md, DMLC_* rows the StepMesh section, the rest the main one.
const std::vector<EnvEntry>& EnvTable() {
  static const std::vector<EnvEntry> table = {
      {"STEPMESH_ROLE", "role", "`worker`", "`worker`, `server` or `scheduler`",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(o.role, ParseRole(v));
         return absl::OkStatus();
       }},
      {"STEPMESH_RANK", "rank", "`-1`", "rank within the role; -1 lets the scheduler assign",
       STEPMESH_ENV_INT(rank)},
      {"STEPMESH_NUM_WORKERS", "num_workers", "1", "attention instances in the mesh",
       STEPMESH_ENV_INT(num_workers)},
      {"STEPMESH_NUM_SERVERS", "num_servers", "1", "FFN instances in the mesh",
       STEPMESH_ENV_INT(num_servers)},
      {"STEPMESH_MAX_WORKERS", "max_workers", "0 (`num_workers`)",
       "capacity: attention ranks [0, max_workers) may join the running mesh (`elastic.md`); "
       "the same on every process",
       STEPMESH_ENV_INT(max_workers)},
      {"STEPMESH_MAX_SERVERS", "max_servers", "0 (`num_servers`)",
       "capacity: FFN ranks [0, max_servers) may join the running mesh (`elastic.md`); "
       "the same on every process",
       STEPMESH_ENV_INT(max_servers)},
      {"STEPMESH_SCHEDULER", "scheduler", "`127.0.0.1:9000`", "rendezvous `host:port`",
       STEPMESH_ENV_STR(scheduler)},
      {"STEPMESH_RENDEZVOUS", "rendezvous", "empty (`scheduler://` + `scheduler`)",
       "`scheduler://HOST:PORT` or `etcd://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/PREFIX]` "
       "(docs/deployment.md)",
       STEPMESH_ENV_STR(rendezvous)},
      {"STEPMESH_BIND_HOST", "bind_host", "`127.0.0.1`",
       "address the data listener binds (`0.0.0.0`: every interface); an `interface` overrides it",
       STEPMESH_ENV_STR(bind_host)},
      {"STEPMESH_NODE_HOST", "node_host", "empty (`bind_host`)",
       "host other participants dial to reach this one (behind NAT, or when `bind_host` is "
       "`0.0.0.0`)",
       STEPMESH_ENV_STR(node_host)},
      {"STEPMESH_INTERFACE", "interface", "empty",
       "network interface (`eth2`, `bond0`): its address is bound and advertised (IPv4 first); "
       "for RDMA also `rdma.interface` when that is empty. An unknown name is an error listing "
       "the interfaces found",
       STEPMESH_ENV_STR(interface)},
      {"STEPMESH_TRANSPORT", "transport", "`auto`",
       "`tcp`, `rdma`, `libfabric` (an error naming it when this build has none), or `auto` "
       "(RDMA if a device exists)",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         // An unknown value is refused here, naming the variable, not later.
         STEPMESH_RETURN_IF_ERROR(CheckOneOf(v, {"tcp", "rdma", "libfabric", "auto"}));
         o.transport = std::string(v);
         return absl::OkStatus();
       }},
      // libfabric's own variable (it also filters libfabric's providers);
      // STEPMESH_FI_PROVIDER, listed after it, wins.
      {"FI_PROVIDER", "fi_provider", "—", "as `STEPMESH_FI_PROVIDER` (libfabric's own name)",
       STEPMESH_ENV_STR(fi_provider)},
      {"STEPMESH_FI_PROVIDER", "fi_provider", "empty (the first that fits)",
       "libfabric provider of `transport = libfabric`: `tcp`, `shm`, `efa`, `tcp;ofi_rxm`, ...; "
       "one without RMA or remote CQ data is refused, naming what it lacks",
       STEPMESH_ENV_STR(fi_provider)},
      {"STEPMESH_FI_NICS", "fi_nics", "1",
       "libfabric rails (a domain and endpoint each, 0..32): 0 = one per NIC the provider lists "
       "(EFA: every device); large payloads are striped across the rails both ends have",
       STEPMESH_ENV_INT(fi_nics)},
      {"STEPMESH_FI_STRIPE_MIN_BYTES", "fi_stripe_min_bytes", "65536",
       "with 2+ libfabric rails, payloads at least this large are split across them (≥ 4096)",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         if (!absl::SimpleAtoi(v, &o.fi_stripe_min_bytes)) {
           return absl::InvalidArgumentError("not an integer");
         }
         return absl::OkStatus();
       }},
      {"STEPMESH_BACKEND", "backend", "`cpu_mock`", "`cpu_mock` or `cuda`",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         // Whether this build has CUDA is decided when the backend is made;
         // a name no build knows ("rocm") is refused here.
         STEPMESH_RETURN_IF_ERROR(CheckOneOf(v, {"cpu_mock", "cuda"}));
         o.backend = std::string(v);
         return absl::OkStatus();
       }},
      {"STEPMESH_DEVICE", "device", "0", "accelerator index (any number of devices)",
       STEPMESH_ENV_INT(device)},
      // Read by CUDA itself; the cuda backend must know it too (one hardware queue).
      {"CUDA_DEVICE_MAX_CONNECTIONS", "cuda_device_max_connections", "unset (0)",
       "CUDA's own variable (hardware queues per device, CUDA's default 8), read so the cuda "
       "backend knows (`CreateCudaBackend` reads it too): once its streams outnumber the queues, "
       "and always with 1, it waits with kernels, not stream memory operations (docs/cuda.md, "
       "rule 7)",
       STEPMESH_ENV_INT(cuda_device_max_connections)},
      RdmaString("STEPMESH_RDMA_DEVICE", "rdma.device", "auto",
                 "verbs device name, e.g. `mlx5_0`, or a comma-separated list to choose from; "
                 "auto: the port nearest the GPU on the PCI tree (sysfs) among the best (iWARP "
                 "devices are refused: no immediate data)",
                 &RdmaOptions::device),
      RdmaInt("STEPMESH_RDMA_PORT", "rdma.port", "0 (any)", "port number on the device",
              &RdmaOptions::port),
      RdmaInt("STEPMESH_RDMA_GID_INDEX", "rdma.gid_index", "-1 (auto)",
              "GID index; auto prefers RoCE v2 IPv4-mapped and never picks a link-local "
              "(`fe80::`) RoCE v2 GID",
              &RdmaOptions::gid_index),
      RdmaString("STEPMESH_RDMA_INTERFACE", "rdma.interface", "empty (`interface`)",
                 "RoCE: only GIDs inside this interface's subnets, by name (`eth2`) or CIDR "
                 "(`10.0.0.0/24`, `2001:db8::/64`)",
                 &RdmaOptions::interface),
      RdmaInt("STEPMESH_RDMA_TRAFFIC_CLASS", "rdma.traffic_class", "0",
              "GRH traffic class, DSCP << 2 (0..255)", &RdmaOptions::traffic_class),
      {"STEPMESH_RDMA_DSCP", "rdma.traffic_class", "unset",
       "the same as a DSCP (0..63): sets the traffic class to DSCP << 2, e.g. 26 → 104; wins "
       "over `STEPMESH_RDMA_TRAFFIC_CLASS` when both are set",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         int dscp = 0;
         if (!absl::SimpleAtoi(v, &dscp) || dscp < 0 || dscp > 63) {
           return absl::InvalidArgumentError("not a DSCP (want 0..63)");
         }
         o.rdma.traffic_class = dscp << 2;
         return absl::OkStatus();
       }},
      RdmaInt("STEPMESH_RDMA_SERVICE_LEVEL", "rdma.service_level", "0", "SL / priority (0..15)",
              &RdmaOptions::service_level),
      {"STEPMESH_RDMA_PKEY", "rdma.pkey", "0 (table index 0)",
       "InfiniBand partition key, `0x8001` or decimal (as `NCCL_IB_PKEY`): the port's P_Key "
       "table entry of that partition (full membership preferred); a key the table lacks fails "
       "at start naming the table",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         uint32_t key = 0;
         const bool hex = absl::StartsWithIgnoreCase(v, "0x");
         if (!(hex ? absl::SimpleHexAtoi(v.substr(2), &key) : absl::SimpleAtoi(v, &key)) ||
             key > 0xFFFF) {
           return absl::InvalidArgumentError("not a 16-bit P_Key (want 0x8001 or 32769)");
         }
         o.rdma.pkey = static_cast<int>(key);
         return absl::OkStatus();
       }},
      RdmaInt("STEPMESH_RDMA_PATH_MTU", "rdma.path_mtu", "0 (auto)",
              "cap in bytes: 256, 512, 1024, 2048, 4096; auto is the smaller active MTU of both "
              "ends",
              &RdmaOptions::path_mtu),
      RdmaInt("STEPMESH_RDMA_ACK_TIMEOUT", "rdma.ack_timeout", "18",
              "local ACK timeout exponent, 4.096 µs × 2^n per try (1..31): 18 ≈ 1.07 s, × "
              "(retries + 1) before a QP fails",
              &RdmaOptions::ack_timeout),
      RdmaInt("STEPMESH_RDMA_RETRY_COUNT", "rdma.retry_count", "7",
              "transport retries after the first try (0..7)", &RdmaOptions::retry_count),
      RdmaInt("STEPMESH_RDMA_RNR_RETRY", "rdma.rnr_retry", "3",
              "RNR retries (0..6; credits make an RNR a bug, 7 = forever is refused)",
              &RdmaOptions::rnr_retry),
      RdmaInt("STEPMESH_RDMA_MIN_RNR_TIMER", "rdma.min_rnr_timer", "12",
              "responder RNR NAK delay code (1..31)", &RdmaOptions::min_rnr_timer),
      RdmaInt("STEPMESH_RDMA_RECV_DEPTH", "rdma.recv_depth", "256",
              "receives = credits = header-ring slots per QP (4..8192); same on every "
              "participant",
              &RdmaOptions::recv_depth),
      RdmaInt("STEPMESH_RDMA_QPS_PER_PEER", "rdma.qps_per_peer", "1",
              "2 stripes large payloads over two QPs (LAG ports); same on every participant",
              &RdmaOptions::qps_per_peer),
      {"STEPMESH_RDMA_STRIPE_MIN_BYTES", "rdma.stripe_min_bytes", "65536",
       "with 2 QPs, payloads at least this large are striped (≥ 8192)",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         if (!absl::SimpleAtoi(v, &o.rdma.stripe_min_bytes)) {
           return absl::InvalidArgumentError("not an integer");
         }
         return absl::OkStatus();
       }},
      {"STEPMESH_RDMA_GPUDIRECT", "rdma.gpudirect", "`auto`",
       "device tensors: `auto` (register in place by dma-buf or peer memory, stage if the NIC "
       "refuses), `off` (always stage through pinned host memory), `require` (registration "
       "fails rather than stage)",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(o.rdma.gpudirect, ParseGpuDirect(v));
         return absl::OkStatus();
       }},
      {"STEPMESH_RDMA_RELAXED_ORDERING", "rdma.relaxed_ordering", "`auto`",
       "`IBV_ACCESS_RELAXED_ORDERING`: `auto` on the tensors' MRs (dropped by the provider where "
       "unsupported), `on` on every MR, `off` never",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_RETURN_IF_ERROR(CheckOneOf(v, {"auto", "on", "off"}));
         o.rdma.relaxed_ordering = std::string(v);
         return absl::OkStatus();
       }},
      {"STEPMESH_RDMA_FORK_INIT", "rdma.fork_init", "`auto`",
       "`ibv_fork_init` before registering: `auto` unless the kernel copies pinned pages on fork "
       "(`IBV_FORK_UNNEEDED`), `on` always, `off` never (then no registered memory may be used "
       "in a forked child)",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_RETURN_IF_ERROR(CheckOneOf(v, {"auto", "on", "off"}));
         o.rdma.fork_init = std::string(v);
         return absl::OkStatus();
       }},
      {"STEPMESH_POLL_MODE", "threads.poll_mode", "`adaptive`", "`spin`, `adaptive`, `blocking`",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(o.threads.poll_mode, ParsePollMode(v));
         return absl::OkStatus();
       }},
      {"STEPMESH_SPIN_BUDGET", "threads.spin_budget", "`1ms`",
       "adaptive: spin (yielding) this long after activity before blocking; ≥ a layer's round "
       "trip avoids a spin→block switch mid-transfer. A wait site whose recent waits mostly "
       "outlasted it (4 of the last 8) skips the spin and blocks at once",
       STEPMESH_ENV_DURATION(threads.spin_budget)},
      {"STEPMESH_SEND_CORES", "threads.send_cores", "unpinned",
       "`2,3`, or `auto` (hwloc, near the device)",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         return ApplyCores(v, o.threads.send_cores, o);
       }},
      {"STEPMESH_RECV_CORES", "threads.recv_cores", "unpinned", "as above",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         return ApplyCores(v, o.threads.recv_cores, o);
       }},
      {"STEPMESH_TIMEOUT", "timeout", "`30s`",
       "connect, barrier, peer silence, send stall; the etcd lease TTL (at least 2 s)",
       STEPMESH_ENV_DURATION(timeout)},
      {"STEPMESH_HEARTBEAT_INTERVAL", "heartbeat_interval", "`1s`",
       "scheduler liveness pings; the framework store's heartbeat",
       STEPMESH_ENV_DURATION(heartbeat_interval)},
      {"STEPMESH_MAX_INFLIGHT", "max_inflight_requests", "64", "worker request slots",
       STEPMESH_ENV_INT(max_inflight_requests)},
      {"STEPMESH_MAX_REGISTRATIONS", "max_registrations", "1024", "tensors per participant",
       STEPMESH_ENV_INT(max_registrations)},
      {"STEPMESH_AUTH_TOKEN", "auth_token", "empty",
       "shared secret for challenge–response, the same on every process (`security.md`); "
       "launchers (`afd_launch`, `quickstart`) make one up for their children when unset",
       STEPMESH_ENV_STR(auth_token)},
      {"STEPMESH_AUTH", "auth", "`auto`",
       "`auto`: a listener on a non-loopback address refuses to start without a token "
       "(loopback: the scheduler warns); `on`: a token is required everywhere; `off`: never "
       "required, no warning",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(o.auth, ParseAuthMode(v));
         return absl::OkStatus();
       }},
      {"STEPMESH_MESH_ID", "mesh_id", "empty",
       "names the mesh; the scheduler refuses a participant whose id (or "
       "`num_workers`/`num_servers`, or capacity `max_workers`/`max_servers`) differs from its "
       "own, naming both",
       STEPMESH_ENV_STR(mesh_id)},
      {"STEPMESH_TRACE", "trace.enabled", "`true`", "per-request stamps",
       STEPMESH_ENV_BOOL(trace.enabled)},
      {"STEPMESH_TRACE_EVENTS", "trace.events", "0",
       "keep the stamps of the newest this many requests for `ChromeTraceJson()` / "
       "`WriteChromeTrace()` (`tracing.md`); 0: not recorded; needs `STEPMESH_TRACE`",
       STEPMESH_ENV_INT(trace.events)},
      {"STEPMESH_PAYLOAD_CHECKSUM", "payload_checksum", "`false`",
       "CRC32C of every host-memory payload, sealed by the sender and checked by the receiver "
       "(`DATA_LOSS` on mismatch); one pass over the bytes per side, about 0.2 ms per 1.75 MiB: "
       "for chasing corruption",
       STEPMESH_ENV_BOOL(payload_checksum)},
      {"STEPMESH_LOG_LEVEL", "", "`warning`",
       "`debug`, `info`, `warning`, `error`; every program reads it (a bad value stops it, "
       "naming the variable)",
       [](absl::string_view v, MeshOptions&) -> absl::Status {
         using base::LogLevel;
         STEPMESH_RETURN_IF_ERROR(CheckOneOf(v, {"debug", "info", "warning", "error"}));
         base::SetLogThreshold(v == "debug"     ? LogLevel::kDebug
                               : v == "info"    ? LogLevel::kInfo
                               : v == "warning" ? LogLevel::kWarning
                                                : LogLevel::kError);
         return absl::OkStatus();
       }},
      // StepMesh / ps-lite names, so existing launch scripts keep working.
      {"DMLC_ROLE", "role, fserver.role", "—",
       "`worker`, `server` or `scheduler`; `joint` (fserver only: server and scheduler in one "
       "process) leaves `role` alone",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         o.fserver.role = std::string(v);
         if (v == "joint") return absl::OkStatus();
         absl::StatusOr<Role> role = ParseRole(v);
         if (!role.ok())
           return absl::InvalidArgumentError(
               "not a role (want worker, server, "
               "scheduler or joint)");
         o.role = *role;
         return absl::OkStatus();
       }},
      // ps-lite's van type; DMLC_ENABLE_RDMA (later in the table) wins over it.
      {"DMLC_PS_VAN_TYPE", "transport", "—", "as `DMLC_ENABLE_RDMA`, which wins when both are set",
       ApplyVanType},
      {"DMLC_ENABLE_RDMA", "transport", "—",
       "StepMesh's van: `zmq`, `0`, `false` or empty is `tcp`; `ibverbs`, `1` or `true` is "
       "`rdma`; `fabric` is `libfabric` (an error naming it when this build has none)",
       ApplyVanType},
      {"DMLC_NUM_WORKER", "num_workers", "—", "as `STEPMESH_NUM_WORKERS`",
       STEPMESH_ENV_INT(num_workers)},
      {"DMLC_NUM_SERVER", "num_servers", "—", "as `STEPMESH_NUM_SERVERS`",
       STEPMESH_ENV_INT(num_servers)},
      {"DMLC_PS_ROOT_URI", "scheduler", "—", "host part of `scheduler`",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         const size_t colon = o.scheduler.rfind(':');
         const std::string port =
             colon == std::string::npos ? "9000" : o.scheduler.substr(colon + 1);
         o.scheduler = absl::StrCat(v, ":", port);
         return absl::OkStatus();
       }},
      {"DMLC_PS_ROOT_PORT", "scheduler", "—", "port part of `scheduler`",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(int port, ParseInt(v));
         const size_t colon = o.scheduler.rfind(':');
         o.scheduler = absl::StrCat(o.scheduler.substr(0, colon), ":", port);
         return absl::OkStatus();
       }},
      {"DMLC_NODE_HOST", "node_host, bind_host", "—",
       "the host other participants dial, and the address bound unless `STEPMESH_BIND_HOST` "
       "is set",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         // ps-lite binds every interface and advertises this host; binding
         // just this address is the closest match that never listens wider.
         o.node_host = std::string(v);
         o.bind_host = std::string(v);
         return absl::OkStatus();
       }},
      {"DMLC_INTERFACE", "interface", "—",
       "as `STEPMESH_INTERFACE`; `auto` picks one as StepMesh does (see "
       "[`DMLC_INTERFACE=auto`](#dmlc_interfaceauto))",
       STEPMESH_ENV_STR(interface)},
      {"DMLC_GROUP_SIZE", "fserver.group_size", "1",
       "fserver: instances (GPUs) per group; instance i of every group forms mesh i",
       STEPMESH_ENV_INT(fserver.group_size)},
      {"DMLC_NODE_RANK", "fserver.node_rank", "0", "fserver: this group's rank",
       STEPMESH_ENV_INT(fserver.node_rank)},
      {"DMLC_RANK_OFFSET", "fserver.rank_offset", "0",
       "fserver: added to `STEPMESH_GPU` for the instance index",
       STEPMESH_ENV_INT(fserver.rank_offset)},
      {"DMLC_INSTANCE_ID", "fserver.instance_id", "-1 (`STEPMESH_GPU` + `DMLC_RANK_OFFSET`)",
       "fserver: the instance index within the group (which mesh of the group it joins)",
       STEPMESH_ENV_INT(fserver.instance_id)},
      // StepMesh's own STEPMESH_* knobs: honoured where ours has the feature,
      // else accepted and named as ignored once per process.
      {"STEPMESH_GPU", "fserver.gpu, device", "0",
       "StepMesh's device index: the accelerator (`STEPMESH_DEVICE` wins) and, for fserver, "
       "the instance index",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(o.fserver.gpu, ParseInt(v));
         o.device = o.fserver.gpu;
         return absl::OkStatus();
       },
       true},
      {"STEPMESH_BAKCEND", "backend", "—",
       "StepMesh's backend name (sic): `GPU` is `cuda`, `CPU` is `cpu_mock`",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_RETURN_IF_ERROR(CheckOneOf(v, {"GPU", "CPU"}));
         o.backend = v == "GPU" ? "cuda" : "cpu_mock";
         return absl::OkStatus();
       },
       true},
      {"STEPMESH_SPLIT_QP_LAG", "rdma.qps_per_peer", "—",
       "`1`: two QPs per peer striping large payloads (`STEPMESH_RDMA_QPS_PER_PEER=2`); the LAG "
       "port is the driver's choice",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(bool on, ParseBool(v));
         o.rdma.qps_per_peer = on ? 2 : 1;
         return absl::OkStatus();
       },
       true},
      {"STEPMESH_BIND_CPU_CORE", "threads.auto_pin", "—",
       "`1`: pin the progress threads near the device (as `STEPMESH_SEND_CORES=auto`)",
       [](absl::string_view v, MeshOptions& o) -> absl::Status {
         STEPMESH_ASSIGN_OR_RETURN(o.threads.auto_pin, ParseBool(v));
         return absl::OkStatus();
       },
       true},
      Ignored("STEPMESH_CPU_CORES_PER_SOCKET",
              "StepMesh's core formula; the cores come from hwloc (`STEPMESH_BIND_CPU_CORE`) or "
              "`STEPMESH_SEND_CORES` / `STEPMESH_RECV_CORES`"),
      Ignored("STEPMESH_CPU_CORES_PER_GPU", "as `STEPMESH_CPU_CORES_PER_SOCKET`"),
      Ignored("STEPMESH_CPU_START_OFFSET", "as `STEPMESH_CPU_CORES_PER_SOCKET`"),
      Ignored("STEPMESH_MEM_SYNC", "the cuda backend picks its ready events itself (docs/cuda.md)"),
      Ignored("STEPAF_QP_NUM", "`STEPMESH_RDMA_QPS_PER_PEER` sets the QPs per peer"),
      Ignored("STEPAF_BUSY_POLL_ENABLE", "`STEPMESH_POLL_MODE` says how threads wait"),
      // stepmesh.afd.Connector's settings (python/stepmesh/afd.py reads them
      // through EnvironmentValue; a keyword argument or config key wins).
      ReadByPython("AFD_ROLE", "required", "stepmesh.afd: `attention` or `ffn`"),
      ReadByPython("AFD_RANK", "required", "stepmesh.afd: this instance's rank in its role"),
      ReadByPython("AFD_NUM_ATTENTION", "required", "stepmesh.afd: attention instances"),
      ReadByPython("AFD_NUM_FFN", "required", "stepmesh.afd: FFN instances"),
      ReadByPython("AFD_HIDDEN_SIZE", "required", "stepmesh.afd: the model's hidden size"),
      ReadByPython("AFD_MAX_TOKENS", "required",
                   "stepmesh.afd: tokens per attention rank and stage, at most"),
      ReadByPython("AFD_NUM_STAGES", "3", "stepmesh.afd: pipeline stages (micro-batches)"),
      ReadByPython("AFD_DTYPE", "`float32`", "stepmesh.afd: the hidden states' dtype"),
      ReadByPython("AFD_ROUTER_LOGITS_DIM", "0",
                   "stepmesh.afd: router logits per token sent with the hidden states (0: none)"),
      ReadByPython("AFD_COMBINE", "`sum`", "stepmesh.afd: how FFN outputs combine"),
      ReadByPython("AFD_ARRAY", "`numpy`", "stepmesh.afd: the array type handed back"),
  };
  return table;
}

// Names FromEnv leaves alone without a warning (none: the fserver layer's
// variables are rows of the table, FserverOptions).
constexpr absl::string_view kReadElsewhere[] = {""};

}  // namespace

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kScheduler:
      return "scheduler";
    case Role::kWorker:
      return "worker";
    case Role::kServer:
      return "server";
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
    case PollMode::kSpin:
      return "spin";
    case PollMode::kAdaptive:
      return "adaptive";
    case PollMode::kBlocking:
      return "blocking";
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
    case GpuDirect::kAuto:
      return "auto";
    case GpuDirect::kOff:
      return "off";
    case GpuDirect::kRequire:
      return "require";
  }
  return "invalid";
}

namespace {

bool Known(absl::string_view name) {
  if (absl::c_linear_search(kReadElsewhere, name)) return true;
  return absl::c_any_of(EnvTable(), [name](const EnvEntry& e) { return name == e.name; });
}

// Warns about each unknown STEPMESH_* / DMLC_* name once per process, however
// many times FromEnv runs (programs call it once per role they start).
void WarnUnknownNames() {
  static absl::Mutex mu(absl::kConstInit);
  static auto* warned = new std::set<std::string>();
  std::vector<std::string> unknown;
  for (char** env = environ; env != nullptr && *env != nullptr; ++env) {
    absl::string_view var(*env);
    // ps-lite launch scripts set DMLC_* names this library does not read: say so.
    if (!absl::StartsWith(var, "STEPMESH_") && !absl::StartsWith(var, "DMLC_")) continue;
    absl::string_view name = var.substr(0, var.find('='));
    if (!Known(name)) unknown.emplace_back(name);
  }
  if (unknown.empty()) return;
  absl::MutexLock lock(&mu);
  for (const std::string& name : unknown) {
    if (!warned->insert(name).second) continue;
    STEPMESH_LOG(kWarning, "unknown environment variable ", name,
                 " ignored (docs/configuration.md lists the names stepmesh reads)");
  }
}

}  // namespace

absl::StatusOr<MeshOptions> MeshOptions::FromEnv(const MeshOptions& base) {
  MeshOptions options = base;
  // DMLC_* first so that STEPMESH_* (listed earlier) wins over them: apply in two passes.
  for (bool dmlc_pass : {true, false}) {
    for (const EnvEntry& entry : EnvTable()) {
      // StepMesh's own names (DMLC_*, STEPAF_*, its STEPMESH_* knobs) are applied first.
      if ((absl::StartsWith(entry.name, "DMLC_") || entry.stepmesh) != dmlc_pass) continue;
      const char* value = std::getenv(entry.name);
      if (value == nullptr) continue;
      // Every error names the variable and its value, whatever the parser said.
      if (absl::Status s = entry.apply(value, options); !s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(entry.name, "='", value, "': ", s.message()));
      }
    }
  }
  WarnUnknownNames();
  STEPMESH_RETURN_IF_ERROR(options.Validate());
  return options;
}

absl::StatusOr<MeshOptions> MeshOptions::FromEnv() { return FromEnv(MeshOptions()); }

absl::StatusOr<int> CudaDeviceMaxConnectionsFromEnv() {
  for (const EnvEntry& entry : EnvTable()) {
    if (absl::string_view(entry.name) != "CUDA_DEVICE_MAX_CONNECTIONS") continue;
    const char* value = std::getenv(entry.name);
    if (value == nullptr) return 0;
    MeshOptions options;
    if (absl::Status s = entry.apply(value, options); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(entry.name, "='", value, "': ", s.message()));
    }
    if (options.cuda_device_max_connections < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(entry.name, "='", value, "': want a positive number of hardware queues"));
    }
    return options.cuda_device_max_connections;
  }
  return 0;
}

absl::StatusOr<std::optional<std::string>> EnvironmentValue(absl::string_view name) {
  for (const EnvEntry& entry : EnvTable()) {
    if (absl::string_view(entry.name) != name) continue;
    const char* value = std::getenv(entry.name);
    if (value == nullptr) return std::optional<std::string>();
    return std::optional<std::string>(value);
  }
  return absl::NotFoundError(absl::StrCat(
      "environment variable ", name, " is not in the environment table (docs/configuration.md)"));
}

absl::StatusOr<std::optional<Role>> RoleFromEnv() {
  // STEPMESH_ROLE wins over DMLC_ROLE, as in FromEnv.
  for (const char* name : {"STEPMESH_ROLE", "DMLC_ROLE"}) {
    const char* value = std::getenv(name);
    if (value == nullptr) continue;
    absl::StatusOr<Role> role = ParseRole(value);
    if (!role.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "='", value, "': ", role.status().message()));
    }
    return std::optional<Role>(*role);
  }
  return std::optional<Role>();
}

namespace core {

std::vector<EnvVariableDoc> DocumentedEnvironment() {
  std::vector<EnvVariableDoc> out;
  for (const EnvEntry& e : EnvTable()) {
    out.push_back({e.name, e.field, e.default_value, e.meaning, e.stepmesh});
  }
  return out;
}

std::vector<absl::string_view> EnvironmentReadElsewhere() {
  std::vector<absl::string_view> out;
  for (absl::string_view n : kReadElsewhere) {
    if (!n.empty()) out.push_back(n);
  }
  return out;
}

}  // namespace core

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
  if (max_workers != 0 && (max_workers < num_workers || max_workers > 4096)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_workers=", max_workers,
                     " (STEPMESH_MAX_WORKERS): want 0 or num_workers=", num_workers, "..4096"));
  }
  if (max_servers != 0 && (max_servers < num_servers || max_servers > 4096)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_servers=", max_servers,
                     " (STEPMESH_MAX_SERVERS): want 0 or num_servers=", num_servers, "..4096"));
  }
  const int peers = role == Role::kWorker ? WorkerCapacity() : ServerCapacity();
  if (role != Role::kScheduler && (rank < -1 || rank >= peers)) {
    return absl::InvalidArgumentError(
        absl::StrCat(RoleName(role), " rank ", rank, " out of range [0, ", peers, ")"));
  }
  if (scheduler.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("scheduler '", scheduler, "' is not host:port"));
  }
  if (!rendezvous.empty() && !absl::StartsWith(rendezvous, "scheduler://") &&
      !absl::StartsWith(rendezvous, "etcd://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous '", rendezvous.substr(0, rendezvous.find("://")),
                     "...' (STEPMESH_RENDEZVOUS): want scheduler://HOST:PORT or "
                     "etcd://HOST:PORT[,HOST:PORT...][/PREFIX]"));
  }
  if (transport != "tcp" && transport != "rdma" && transport != "auto" &&
      transport != "libfabric") {
    return absl::InvalidArgumentError(
        absl::StrCat("transport '", transport, "' (tcp|rdma|auto|libfabric)"));
  }
  if (fi_nics < 0 || fi_nics > 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("fi_nics=", fi_nics, " (STEPMESH_FI_NICS): want 0..32"));
  }
  if (fi_stripe_min_bytes < 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("fi_stripe_min_bytes=", fi_stripe_min_bytes,
                     " (STEPMESH_FI_STRIPE_MIN_BYTES): want >= 4096"));
  }
  if (fserver.group_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fserver.group_size (DMLC_GROUP_SIZE) = ", fserver.group_size, " (must be >= 1)"));
  }
  if (!fserver.role.empty() && fserver.role != "worker" && fserver.role != "server" &&
      fserver.role != "scheduler" && fserver.role != "joint") {
    return absl::InvalidArgumentError(absl::StrCat("fserver.role (DMLC_ROLE) = '", fserver.role,
                                                   "' (want worker, server, scheduler or joint)"));
  }
  if (timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout must be > 0");
  if (max_inflight_requests < 1 || max_inflight_requests > (1 << 20)) {
    return absl::InvalidArgumentError("max_inflight_requests out of range");
  }
  if (max_registrations < 1) return absl::InvalidArgumentError("max_registrations must be >= 1");
  if (trace.events < 0 || trace.events > (1 << 24)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "trace.events (STEPMESH_TRACE_EVENTS) = ", trace.events, " (0..", 1 << 24, ")"));
  }
  if (trace.events > 0 && !trace.enabled) {
    return absl::InvalidArgumentError(
        absl::StrCat("trace.events (STEPMESH_TRACE_EVENTS) = ", trace.events,
                     " records stamps, which trace.enabled = false (STEPMESH_TRACE) turns off"));
  }
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
    return absl::InvalidArgumentError(
        absl::StrCat("rdma.", field, "=", value, " (", variable, "): want ", lo, "..", hi));
  };
  STEPMESH_RETURN_IF_ERROR(range("port", "STEPMESH_RDMA_PORT", port, 0, 255));
  STEPMESH_RETURN_IF_ERROR(range("gid_index", "STEPMESH_RDMA_GID_INDEX", gid_index, -1, 65535));
  STEPMESH_RETURN_IF_ERROR(
      range("traffic_class", "STEPMESH_RDMA_TRAFFIC_CLASS", traffic_class, 0, 255));
  STEPMESH_RETURN_IF_ERROR(
      range("service_level", "STEPMESH_RDMA_SERVICE_LEVEL", service_level, 0, 15));
  STEPMESH_RETURN_IF_ERROR(range("pkey", "STEPMESH_RDMA_PKEY", pkey, 0, 0xFFFF));
  for (const auto& [field, variable, value] :
       {std::tuple{"relaxed_ordering", "STEPMESH_RDMA_RELAXED_ORDERING", &relaxed_ordering},
        std::tuple{"fork_init", "STEPMESH_RDMA_FORK_INIT", &fork_init}}) {
    if (*value != "auto" && *value != "on" && *value != "off") {
      return absl::InvalidArgumentError(
          absl::StrCat("rdma.", field, "='", *value, "' (", variable, "): want auto, on or off"));
    }
  }
  if (path_mtu != 0 && path_mtu != 256 && path_mtu != 512 && path_mtu != 1024 && path_mtu != 2048 &&
      path_mtu != 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("rdma.path_mtu=", path_mtu,
                     " (STEPMESH_RDMA_PATH_MTU): want 0, 256, 512, 1024, 2048 or 4096"));
  }
  STEPMESH_RETURN_IF_ERROR(range("ack_timeout", "STEPMESH_RDMA_ACK_TIMEOUT", ack_timeout, 1, 31));
  STEPMESH_RETURN_IF_ERROR(range("retry_count", "STEPMESH_RDMA_RETRY_COUNT", retry_count, 0, 7));
  STEPMESH_RETURN_IF_ERROR(range("rnr_retry", "STEPMESH_RDMA_RNR_RETRY", rnr_retry, 0, 6));
  STEPMESH_RETURN_IF_ERROR(
      range("min_rnr_timer", "STEPMESH_RDMA_MIN_RNR_TIMER", min_rnr_timer, 1, 31));
  STEPMESH_RETURN_IF_ERROR(range("recv_depth", "STEPMESH_RDMA_RECV_DEPTH", recv_depth, 4, 8192));
  STEPMESH_RETURN_IF_ERROR(range("qps_per_peer", "STEPMESH_RDMA_QPS_PER_PEER", qps_per_peer, 1, 2));
  STEPMESH_RETURN_IF_ERROR(range("stripe_min_bytes", "STEPMESH_RDMA_STRIPE_MIN_BYTES",
                                 stripe_min_bytes, 8192, int64_t{1} << 40));
  return absl::OkStatus();
}

}  // namespace stepmesh
