// The environment table (src/core/env_table.h): the rows generated from the
// option table (stepmesh/option_table.inc) and the ones written here. Reads no
// environment itself: src/core/env.cc applies the rows.

#include "src/core/env_table.h"

#include <set>
#include <string>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "src/base/logging.h"
#include "src/core/env_parse.h"
#include "stepmesh/option_table.h"
#include "stepmesh/status.h"

namespace stepmesh::core {
namespace {

// A variable that sets `member` by its type, as a generated row does.
#define STEPMESH_ENV_SET(member)                            \
  [](absl::string_view v, MeshOptions& o) -> absl::Status { \
    return ParseInto(v, o.member, OptionCheck::Any());      \
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

// The rows of option_table.inc that have a variable; HandWritten and None
// rows have none here (their variable's row below sets more than the field).
void AddOptionRows(std::vector<EnvEntry>& rows) {
#define STEPMESH_ENV_ROW_Generic(variable, member, check, default_value, meaning) \
  rows.push_back({variable, #member, default_value, meaning,                      \
                  [](absl::string_view v, MeshOptions& o) -> absl::Status {       \
                    return ParseInto(v, o.member, OptionCheck::check);            \
                  }});
#define STEPMESH_ENV_ROW_Pkey(variable, member, check, default_value, meaning) \
  rows.push_back(                                                              \
      {variable, #member, default_value, meaning,                              \
       [](absl::string_view v, MeshOptions& o) { return ParsePkeyInto(v, o.member); }});
#define STEPMESH_ENV_ROW_Cores(variable, member, check, default_value, meaning) \
  rows.push_back(                                                               \
      {variable, #member, default_value, meaning,                               \
       [](absl::string_view v, MeshOptions& o) { return ParseCoresInto(v, o.member, o); }});
#define STEPMESH_ENV_ROW_HandWritten(variable, member, check, default_value, meaning)
#define STEPMESH_ENV_ROW_None(variable, member, check, default_value, meaning)
#define STEPMESH_OPTION(name, member, variable, check, parse, default_value, meaning) \
  STEPMESH_ENV_ROW_##parse(variable, member, check, default_value, meaning)
#include "stepmesh/option_table.inc"
#undef STEPMESH_OPTION
#undef STEPMESH_ENV_ROW_Generic
#undef STEPMESH_ENV_ROW_Pkey
#undef STEPMESH_ENV_ROW_Cores
#undef STEPMESH_ENV_ROW_HandWritten
#undef STEPMESH_ENV_ROW_None
}

// Names FromEnv leaves alone without a warning (none: the fserver layer's
// variables are rows of the table, FserverOptions).
constexpr absl::string_view kReadElsewhere[] = {""};

}  // namespace

// The one environment table. STEPMESH_RDMA_* rows form the RDMA section of
// docs/configuration.md, DMLC_* rows the StepMesh section, the rest the main one.
const std::vector<EnvEntry>& EnvTable() {
  static const std::vector<EnvEntry>* table = [] {
    auto* rows = new std::vector<EnvEntry>();
    AddOptionRows(*rows);
    std::vector<EnvEntry> written = {

        // libfabric's own variable (it also filters libfabric's providers); an
        // alias, so STEPMESH_FI_PROVIDER wins.
        {"FI_PROVIDER", "fi_provider", "—", "as `STEPMESH_FI_PROVIDER` (libfabric's own name)",
         STEPMESH_ENV_SET(fi_provider), false, true},
        // After the generated rows: wins over STEPMESH_RDMA_TRAFFIC_CLASS.
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
        {"DMLC_PS_VAN_TYPE", "transport", "—",
         "as `DMLC_ENABLE_RDMA`, which wins when both are set", ApplyVanType},
        {"DMLC_ENABLE_RDMA", "transport", "—",
         "StepMesh's van: `zmq`, `0`, `false` or empty is `tcp`; `ibverbs`, `1` or `true` is "
         "`rdma`; `fabric` is `libfabric` (an error naming it when this build has none)",
         ApplyVanType},
        {"DMLC_NUM_WORKER", "num_workers", "—", "as `STEPMESH_NUM_WORKERS`",
         STEPMESH_ENV_SET(num_workers)},
        {"DMLC_NUM_SERVER", "num_servers", "—", "as `STEPMESH_NUM_SERVERS`",
         STEPMESH_ENV_SET(num_servers)},
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
         STEPMESH_ENV_SET(interface)},
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
        Ignored("STEPMESH_MEM_SYNC",
                "the cuda backend picks its ready events itself (docs/cuda.md)"),
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
    for (EnvEntry& e : written) rows->push_back(std::move(e));
    return rows;
  }();
  return *table;
}

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

}  // namespace stepmesh::core
