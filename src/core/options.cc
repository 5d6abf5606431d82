// MeshOptions' enumerations by name, the option table as data, and
// Validate(): each field's own check comes from its row of
// stepmesh/option_table.inc (the message names the field and its variable);
// the checks that relate fields are written below.

#include "stepmesh/options.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/base/enum_names.h"
#include "stepmesh/option_table.h"
#include "stepmesh/status.h"

namespace stepmesh {

namespace {

using base::JoinOr;

// An enumeration's names, indexed by its values (0, 1, 2, ...).
constexpr absl::string_view kRoleNames[] = {"scheduler", "worker", "server"};
constexpr absl::string_view kPollModeNames[] = {"spin", "adaptive", "blocking"};
constexpr absl::string_view kAuthModeNames[] = {"auto", "on", "off"};
constexpr absl::string_view kGpuDirectNames[] = {"auto", "off", "require"};

}  // namespace

// EnumName(value) and ParseEnum(name) of one enumeration; `what` names it in
// the parse error.
#define STEPMESH_NAMED_ENUM(Enum, names, what)                                               \
  absl::string_view Enum##Name(Enum value) { return base::NameOf(names, value, "invalid"); } \
  absl::StatusOr<Enum> Parse##Enum(absl::string_view name) {                                 \
    return base::ParseName<Enum>(names, what, name);                                         \
  }
STEPMESH_NAMED_ENUM(Role, kRoleNames, "role")
STEPMESH_NAMED_ENUM(PollMode, kPollModeNames, "poll mode")
STEPMESH_NAMED_ENUM(AuthMode, kAuthModeNames, "auth mode")
STEPMESH_NAMED_ENUM(GpuDirect, kGpuDirectNames, "GPUDirect mode")
#undef STEPMESH_NAMED_ENUM

std::string OptionCheck::Describe() const {
  switch (kind) {
    case Kind::kAny:
      return "";
    case Kind::kRange:
      if (hi == std::numeric_limits<int64_t>::max()) return absl::StrCat(">= ", lo);
      return absl::StrCat(lo, "..", hi);
    case Kind::kOneOf:
      return JoinOr(std::vector<absl::string_view>(absl::StrSplit(values, '|')));
    case Kind::kPositive:
      return "> 0";
  }
  return "";
}

namespace {

constexpr OptionInfo kOptionTable[] = {
#define STEPMESH_OPTION(name, member, variable, check, parse, default_value, meaning) \
  {#name, #member, variable, OptionCheck::check, default_value, meaning},
#include "stepmesh/option_table.inc"
#undef STEPMESH_OPTION
};

// " (STEPMESH_RDMA_PORT)", or "" for a field no variable sets.
std::string VariableOf(const OptionInfo& info) {
  return info.variable.empty() ? "" : absl::StrCat(" (", info.variable, ")");
}

absl::Status Refuse(const OptionInfo& info, absl::string_view shown) {
  return absl::InvalidArgumentError(
      absl::StrCat(info.member, "=", shown, VariableOf(info), ": want ", info.check.Describe()));
}

// Whether `shown` is one of a kOneOf check's values.
bool Listed(const OptionCheck& c, absl::string_view shown) {
  return absl::c_linear_search(std::vector<absl::string_view>(absl::StrSplit(c.values, '|')),
                               shown);
}

absl::Status CheckField(const OptionInfo& info, int64_t value) {
  const OptionCheck& c = info.check;
  if (c.kind == OptionCheck::Kind::kRange && (value < c.lo || value > c.hi)) {
    return Refuse(info, absl::StrCat(value));
  }
  if (c.kind == OptionCheck::Kind::kOneOf && !Listed(c, absl::StrCat(value))) {
    return Refuse(info, absl::StrCat(value));
  }
  return absl::OkStatus();
}
absl::Status CheckField(const OptionInfo& info, int value) {
  return CheckField(info, static_cast<int64_t>(value));
}
absl::Status CheckField(const OptionInfo& info, const std::string& value) {
  const OptionCheck& c = info.check;
  if (c.kind == OptionCheck::Kind::kOneOf && !Listed(c, value)) {
    return Refuse(info, absl::StrCat("'", value, "'"));
  }
  return absl::OkStatus();
}
absl::Status CheckField(const OptionInfo& info, absl::Duration value) {
  if (info.check.kind == OptionCheck::Kind::kPositive && value <= absl::ZeroDuration()) {
    return Refuse(info, absl::FormatDuration(value));
  }
  return absl::OkStatus();
}
// Enumerations hold a valid value by construction; flags and core lists have no check.
template <typename T>
absl::Status CheckField(const OptionInfo&, const T&) {
  return absl::OkStatus();
}

// Every field whose member starts with `prefix` ("" for all), in table order.
absl::Status CheckFields(const MeshOptions& o, absl::string_view prefix) {
  size_t row = 0;
#define STEPMESH_OPTION(name, member, variable, check, parse, default_value, meaning) \
  if (absl::StartsWith(#member, prefix)) {                                            \
    STEPMESH_RETURN_IF_ERROR(CheckField(kOptionTable[row], o.member));                \
  }                                                                                   \
  ++row;
#include "stepmesh/option_table.inc"
#undef STEPMESH_OPTION
  return absl::OkStatus();
}

}  // namespace

absl::Span<const OptionInfo> OptionTable() { return kOptionTable; }

absl::Status MeshOptions::Validate() const {
  STEPMESH_RETURN_IF_ERROR(CheckFields(*this, ""));
  // What one field's row cannot say: checks across fields, and formats.
  if (max_workers != 0 && max_workers < num_workers) {
    return absl::InvalidArgumentError(absl::StrCat("max_workers=", max_workers,
                                                   " (STEPMESH_MAX_WORKERS): want 0 or at least "
                                                   "num_workers=",
                                                   num_workers));
  }
  if (max_servers != 0 && max_servers < num_servers) {
    return absl::InvalidArgumentError(absl::StrCat("max_servers=", max_servers,
                                                   " (STEPMESH_MAX_SERVERS): want 0 or at least "
                                                   "num_servers=",
                                                   num_servers));
  }
  // Ranks run over the capacity (the start shape unless max_* is set).
  const int peers = role == Role::kWorker ? WorkerCapacity() : ServerCapacity();
  if (role != Role::kScheduler && (rank < -1 || rank >= peers)) {
    return absl::InvalidArgumentError(absl::StrCat(
        RoleName(role), " rank ", rank, " (STEPMESH_RANK) out of range [0, ", peers, ")"));
  }
  if (scheduler.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("scheduler '", scheduler, "' (STEPMESH_SCHEDULER) is not host:port"));
  }
  if (!rendezvous.empty() && !absl::StartsWith(rendezvous, "scheduler://") &&
      !absl::StartsWith(rendezvous, "etcd://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous '", rendezvous.substr(0, rendezvous.find("://")),
                     "...' (STEPMESH_RENDEZVOUS): want scheduler://HOST:PORT or "
                     "etcd://HOST:PORT[,HOST:PORT...][/PREFIX]"));
  }
  if (!fserver.role.empty() && fserver.role != "worker" && fserver.role != "server" &&
      fserver.role != "scheduler" && fserver.role != "joint") {
    return absl::InvalidArgumentError(absl::StrCat("fserver.role (DMLC_ROLE) = '", fserver.role,
                                                   "' (want worker, server, scheduler or joint)"));
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
  return absl::OkStatus();
}

absl::Status RdmaOptions::Validate() const {
  MeshOptions options;
  options.rdma = *this;
  return CheckFields(options, "rdma.");
}

}  // namespace stepmesh
