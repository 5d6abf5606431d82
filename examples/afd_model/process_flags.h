// The command line afd_attention and afd_ffn share (afd_launch passes it):
// the run shape, where the mesh is and who this process is in it, where its
// stats and trace go, and the model the run names.

#ifndef STEPMESH_EXAMPLES_AFD_MODEL_PROCESS_FLAGS_H_
#define STEPMESH_EXAMPLES_AFD_MODEL_PROCESS_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/example_model.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {

struct ProcessFlags {
  RunShape shape;
  std::string scheduler;
  int64_t rank = 0;  // checked against the run by CheckProcessFlags
  int64_t device = 0;
  int metrics_port = 0;      // --metrics-port; 0: none
  std::string metrics_file;  // --metrics-file
  std::string trace_file;    // --chrome-trace
};

// Reads the run flags and --scheduler, --rank, --device, --metrics-port,
// --metrics-file and --chrome-trace from `flags`. Unset --scheduler, --rank
// and --device come from the environment (STEPMESH_SCHEDULER or
// DMLC_PS_ROOT_URI/PORT, STEPMESH_RANK, STEPMESH_DEVICE). A bad value is an
// error naming the flag.
absl::StatusOr<ProcessFlags> ReadProcessFlags(Flags& flags);

// After the program has read its own flags: no flag left unread, and a
// --scheduler and a --rank among `role`'s instances of the run (with
// --resize: the most of the schedule).
absl::Status CheckProcessFlags(const Flags& flags, const ProcessFlags& process,
                               stepmesh::Role role);

// The run's --model, checked against the run shape (ValidateRunForModel).
absl::StatusOr<ExampleModel> LoadRunModel(const RunShape& shape);

}  // namespace afd::example

#endif  // STEPMESH_EXAMPLES_AFD_MODEL_PROCESS_FLAGS_H_
