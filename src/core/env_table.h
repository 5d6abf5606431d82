#pragma once
// The environment table: each variable FromEnv reads, the MeshOptions field it
// sets, its default and meaning, and how a value is applied. Most rows are
// generated from the option table (stepmesh/option_table.inc); the rest
// (other programs' names, variables that set two fields, ignored StepMesh
// knobs, the Python layer's names) are written in src/core/env_table.cc.
// stepmesh_env_doc prints docs/configuration.md's tables from it; a test
// checks the two agree.

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "stepmesh/options.h"

namespace stepmesh::core {

// One row of the environment table.
struct EnvEntry {
  const char* name;
  const char* field;          // the MeshOptions field, "" when none
  const char* default_value;  // as the docs show it
  std::string meaning;        // markdown, one line
  std::function<absl::Status(absl::string_view, MeshOptions&)> apply;
  bool stepmesh = false;  // one of StepMesh's own names: the StepMesh section of the docs
  // Another program's name for one of our fields (FI_PROVIDER): applied in
  // the first pass with the DMLC_* and StepMesh names, so our own name wins.
  bool alias = false;
};

// The rows in table order: FromEnv applies them in two passes (DMLC_*,
// StepMesh and alias rows first), a later row winning within a pass.
const std::vector<EnvEntry>& EnvTable();

struct EnvVariableDoc {
  absl::string_view name;
  absl::string_view field;          // "" when the variable sets no field
  absl::string_view default_value;  // markdown, as the docs show it
  absl::string_view meaning;        // markdown, one line
  bool stepmesh = false;            // one of StepMesh's names (the StepMesh section)
};

// In table order.
std::vector<EnvVariableDoc> DocumentedEnvironment();
// Names FromEnv does not read and does not warn about (read by the Python layer).
std::vector<absl::string_view> EnvironmentReadElsewhere();

}  // namespace stepmesh::core
