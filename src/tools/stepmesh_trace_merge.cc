// stepmesh_trace_merge: one Chrome trace of a whole mesh from the files its
// processes wrote (WriteChromeTrace, STEPMESH_TRACE_EVENTS; docs/tracing.md).
//   stepmesh_trace_merge -o merged.json worker0.json server0.json ...
// Open the result in ui.perfetto.dev or chrome://tracing.

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "src/core/chrome_trace.h"
#include "stepmesh/trace.h"

namespace {

int Usage() {
  std::fprintf(stderr, "usage: stepmesh_trace_merge -o OUT.json IN.json [IN.json ...]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out;
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "-o" && i + 1 < argc) {
      out = argv[++i];
    } else if (arg == "-h" || arg == "--help") {
      return Usage();
    } else {
      inputs.emplace_back(arg);
    }
  }
  if (out.empty() || inputs.empty()) return Usage();
  std::vector<std::string> traces;
  for (const std::string& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "stepmesh_trace_merge: cannot read %s\n", path.c_str());
      return 1;
    }
    std::ostringstream text;
    text << in.rdbuf();
    traces.push_back(text.str());
  }
  absl::StatusOr<std::string> merged = stepmesh::MergeChromeTraces(traces);
  if (!merged.ok()) {
    // The merge names inputs by index: say which file that is.
    std::fprintf(stderr,
                 "stepmesh_trace_merge: %s (inputs in order:", merged.status().ToString().c_str());
    for (size_t i = 0; i < inputs.size(); ++i)
      std::fprintf(stderr, " %zu=%s", i, inputs[i].c_str());
    std::fprintf(stderr, ")\n");
    return 1;
  }
  if (absl::Status s = stepmesh::core::WriteTextFile(out, *merged); !s.ok()) {
    std::fprintf(stderr, "stepmesh_trace_merge: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("merged %zu traces into %s\n", inputs.size(), out.c_str());
  return 0;
}
