#pragma once
// The environment table as documentation: each variable FromEnv reads, the
// MeshOptions field it sets, its default and meaning. stepmesh_env_doc prints
// docs/configuration.md's tables from it; a test checks the two agree.

#include <vector>

#include "absl/strings/string_view.h"

namespace stepmesh::core {

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
