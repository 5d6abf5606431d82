// Engine selection (the model selection point of the programs: a second
// model or a compute emulation adds its engine here).

#include "examples/afd_model/afd_engine.h"

namespace afd::example {

#ifdef AFD_HAVE_CUDA_ENGINE
// examples/afd_model/cuda/afd_engine_cuda.cc
absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateCudaAttentionEngine(AttentionEngineParams p);
absl::StatusOr<std::unique_ptr<FfnEngine>> CreateCudaFfnEngine(FfnEngineParams p);
#endif

bool RowsContiguous(std::span<const WorkerRows> rows, int64_t slot_rows) {
  for (size_t i = 1; i < rows.size(); ++i) {
    if (rows[i].worker != rows[i - 1].worker + 1 || rows[i - 1].rows != slot_rows) return false;
  }
  return !rows.empty();
}

absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateAttentionEngine(AttentionEngineParams p) {
  if (p.shape->ResolvedEngine() == "cuda") {
#ifdef AFD_HAVE_CUDA_ENGINE
    return CreateCudaAttentionEngine(std::move(p));
#else
    return absl::UnimplementedError("this build has no CUDA engine (built without CUDA)");
#endif
  }
  return CreateCpuAttentionEngine(std::move(p));
}

absl::StatusOr<std::unique_ptr<FfnEngine>> CreateFfnEngine(FfnEngineParams p) {
  if (p.shape->ResolvedEngine() == "cuda") {
#ifdef AFD_HAVE_CUDA_ENGINE
    return CreateCudaFfnEngine(std::move(p));
#else
    return absl::UnimplementedError("this build has no CUDA engine (built without CUDA)");
#endif
  }
  return CreateCpuFfnEngine(std::move(p));
}

}  // namespace afd::example
