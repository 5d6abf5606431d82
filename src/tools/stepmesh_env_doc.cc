// Prints the variable tables of docs/configuration.md from the one
// environment table (src/core/env_table.cc, its rows mostly generated from
// stepmesh/option_table.inc) and the field table from the option table, so the
// docs cannot drift from the code.
// scripts/gen-config-doc.sh pastes the output into the page; the
// config_doc_check test fails when the page and this output differ.
//   stepmesh_env_doc main|rdma|stepmesh|elsewhere|fields

#include <cstdio>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "src/core/env_table.h"
#include "stepmesh/option_table.h"

namespace {

using stepmesh::core::EnvVariableDoc;

enum class Section { kMain, kRdma, kStepMesh };

Section SectionOf(const EnvVariableDoc& v) {
  if (absl::StartsWith(v.name, "STEPMESH_RDMA_")) return Section::kRdma;
  if (absl::StartsWith(v.name, "DMLC_") || v.stepmesh) return Section::kStepMesh;
  return Section::kMain;
}

std::string Table(Section section) {
  std::string out = "| variable | field | default | meaning |\n|---|---|---|---|\n";
  for (const EnvVariableDoc& v : stepmesh::core::DocumentedEnvironment()) {
    if (SectionOf(v) != section) continue;
    std::string field = "—";
    if (!v.field.empty()) {
      std::vector<std::string> fields;
      for (absl::string_view f : absl::StrSplit(v.field, ", "))
        fields.push_back(absl::StrCat("`", f, "`"));
      field = absl::StrJoin(fields, ", ");
    }
    absl::StrAppend(&out, "| `", v.name, "` | ", field, " | ", v.default_value, " | ", v.meaning,
                    " |\n");
  }
  return out;
}

std::string ReadElsewhere() {
  std::vector<std::string> names;
  for (absl::string_view n : stepmesh::core::EnvironmentReadElsewhere()) {
    names.push_back(absl::StrCat("`", n, "`"));
  }
  if (names.empty()) {
    return "Every variable above is read by `FromEnv`; the Python fserver layer reads its own\n"
           "through `MeshOptions` (the `fserver.*` fields), never the environment.\n";
  }
  const std::string last = names.back();
  names.pop_back();
  return absl::StrCat(absl::StrJoin(names, ", "), " and ", last,
                      " are read by the Python fserver layer (docs/python.md), not by `FromEnv`,\n"
                      "which therefore does not warn about them.\n");
}

// Every MeshOptions field (the option table): its Python attribute, the
// variable that sets it, what Validate() accepts and its default.
std::string Fields() {
  std::string out = "| field | Python | variable | accepts | default |\n|---|---|---|---|---|\n";
  for (const stepmesh::OptionInfo& o : stepmesh::OptionTable()) {
    const std::string accepts = o.check.Describe();
    absl::StrAppend(&out, "| `", o.member, "` | `", o.name, "` | ",
                    o.variable.empty() ? "—" : absl::StrCat("`", o.variable, "`"), " | ",
                    accepts.empty() ? "—" : accepts, " | ", o.default_value, " |\n");
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc == 2 ? argv[1] : "";
  std::string out;
  if (which == "main") {
    out = Table(Section::kMain);
  } else if (which == "rdma") {
    out = Table(Section::kRdma);
  } else if (which == "stepmesh") {
    out = Table(Section::kStepMesh);
  } else if (which == "fields") {
    out = Fields();
  } else if (which == "elsewhere") {
    out = ReadElsewhere();
  } else {
    std::fprintf(stderr, "usage: stepmesh_env_doc main|rdma|stepmesh|elsewhere|fields\n");
    return 2;
  }
  std::fputs(out.c_str(), stdout);
  return 0;
}
