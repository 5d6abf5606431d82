// The one place stepmesh reads the environment: FromEnv applies the rows of
// the environment table (src/core/env_table.h, generated mostly from
// stepmesh/option_table.inc); docs/configuration.md's tables are generated from
// the same rows (scripts/gen-config-doc.sh). Unknown STEPMESH_* / DMLC_* names
// are warned once.

#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/base/const_init.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "src/base/logging.h"
#include "src/core/env_table.h"
#include "stepmesh/options.h"
#include "stepmesh/status.h"

extern char** environ;

namespace stepmesh {
namespace {

using core::EnvEntry;
using core::EnvTable;

bool Known(absl::string_view name) {
  if (absl::c_linear_search(core::EnvironmentReadElsewhere(), name)) return true;
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
      // StepMesh's own names (DMLC_*, STEPAF_*, its STEPMESH_* knobs) and other
      // programs' names for our fields (aliases) are applied first.
      if ((absl::StartsWith(entry.name, "DMLC_") || entry.stepmesh || entry.alias) != dmlc_pass) {
        continue;
      }
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

}  // namespace stepmesh
