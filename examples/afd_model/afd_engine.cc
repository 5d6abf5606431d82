// Engine selection (the model selection point of the programs: a second
// model or a compute emulation adds its engine here).

#include "examples/afd_model/afd_engine.h"

#include "absl/strings/str_cat.h"
#include "examples/afd_model/device_ops.h"
#include "stepmesh/status.h"

namespace afd::example {

#ifdef AFD_HAVE_CUDA_ENGINE
// examples/afd_model/cuda/device_ops_cuda.cc
absl::StatusOr<std::unique_ptr<DeviceOps>> CreateCudaOps();
absl::StatusOr<int64_t> CudaFreeBytes();
#endif

absl::StatusOr<int64_t> CudaDeviceFreeBytes() {
#ifdef AFD_HAVE_CUDA_ENGINE
  return CudaFreeBytes();
#else
  return absl::UnimplementedError("this build has no CUDA engine (built without CUDA)");
#endif
}

namespace {

absl::StatusOr<std::unique_ptr<DeviceOps>> OpsFor(const std::string& engine) {
  if (engine == "cpu-device") return CreateCpuOps();
#ifdef AFD_HAVE_CUDA_ENGINE
  return CreateCudaOps();
#else
  return absl::UnimplementedError("this build has no CUDA engine (built without CUDA)");
#endif
}

}  // namespace

bool RowsContiguous(std::span<const WorkerRows> rows, int64_t slot_rows) {
  for (size_t i = 1; i < rows.size(); ++i) {
    if (rows[i].worker != rows[i - 1].worker + 1 || rows[i - 1].rows != slot_rows) return false;
  }
  return !rows.empty();
}

absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateAttentionEngine(AttentionEngineParams p) {
  const std::string engine = p.shape->ResolvedEngine();
  if (engine == "cpu") return CreateCpuAttentionEngine(std::move(p));
  if (p.model->step5) {
    return absl::InvalidArgumentError(absl::StrCat("the ", engine,
                                                   " engine implements Step-3's attention, not ",
                                                   p.model->config.name, "'s (use --engine cpu)"));
  }
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<DeviceOps> ops, OpsFor(engine));
  return CreateDeviceAttentionEngine(std::move(p), std::move(ops));
}

absl::StatusOr<std::unique_ptr<FfnEngine>> CreateFfnEngine(FfnEngineParams p) {
  const std::string engine = p.shape->ResolvedEngine();
  if (engine == "cpu") return CreateCpuFfnEngine(std::move(p));
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<DeviceOps> ops, OpsFor(engine));
  return CreateDeviceFfnEngine(std::move(p), std::move(ops));
}

}  // namespace afd::example
