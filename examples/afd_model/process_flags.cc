// The command line afd_attention and afd_ffn share (process_flags.h).

#include "examples/afd_model/process_flags.h"

#include <cstdint>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace afd::example {

absl::StatusOr<ProcessFlags> ReadProcessFlags(Flags& flags) {
  ProcessFlags p;
  STEPMESH_ASSIGN_OR_RETURN(p.shape, ParseRunFlags(flags));
  STEPMESH_ASSIGN_OR_RETURN(const stepmesh::MeshOptions mesh, stepmesh::MeshOptions::FromEnv());
  p.scheduler = flags.Str("scheduler", mesh.scheduler);
  STEPMESH_ASSIGN_OR_RETURN(const int64_t rank, flags.Int("rank", mesh.rank));
  STEPMESH_ASSIGN_OR_RETURN(const int64_t device, flags.Int("device", mesh.device));
  STEPMESH_ASSIGN_OR_RETURN(const int64_t metrics_port, flags.Int("metrics-port", 0));
  if (metrics_port < 0 || metrics_port > 65535) {
    return absl::InvalidArgumentError("--metrics-port wants a port in [0, 65535]");
  }
  p.rank = rank;
  p.device = device;
  p.metrics_port = static_cast<int>(metrics_port);
  p.metrics_file = flags.Str("metrics-file", "");
  p.trace_file = flags.Str("chrome-trace", "");
  return p;
}

absl::Status CheckProcessFlags(const Flags& flags, const ProcessFlags& process,
                               stepmesh::Role role) {
  STEPMESH_RETURN_IF_ERROR(flags.CheckAllUsed());
  const bool attention = role == stepmesh::Role::kWorker;
  const RunShape most = process.shape.ForFfn();  // every instance of the schedule
  const int instances = attention ? most.attention : most.ffn;
  if (process.scheduler.empty() || process.rank < 0 || process.rank >= instances) {
    return absl::InvalidArgumentError(
        absl::StrCat("need --scheduler and --rank (or STEPMESH_RANK) in [0, ",
                     attention ? "--attention" : "--ffn", ") (with --resize: the most ",
                     attention ? "attention" : "FFN", " instances of the schedule)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ExampleModel> LoadRunModel(const RunShape& shape) {
  std::string error;
  std::optional<ExampleModel> model = LoadExampleModel(shape.config, BundledConfigDir(), &error);
  if (!model) return absl::InvalidArgumentError(absl::StrCat("config: ", error));
  STEPMESH_RETURN_IF_ERROR(ValidateRunForModel(shape, *model));
  return *std::move(model);
}

}  // namespace afd::example
