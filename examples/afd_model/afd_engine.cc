// Engine selection: RunShape::ResolvedEngine() names one; a new way to
// compute adds its engine here.

#include "examples/afd_model/afd_engine.h"

#include "absl/strings/str_cat.h"
#include "examples/afd_model/device_ops.h"
#include "examples/afd_model/wire.h"
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

absl::StatusOr<AttentionWire> HostAttentionWire(stepmesh::Backend& backend, const RunShape& shape,
                                                const ModelConfig& config) {
  const int64_t h = config.hidden_size;
  const int64_t slot = shape.SlotRows();
  const A2FSizes sizes{slot, h, config.top_k, config.fp8_group};
  auto alloc = [&](size_t bytes) {
    return backend.Allocate(bytes, stepmesh::MemoryKind::kHostPinned);
  };
  AttentionWire w;
  STEPMESH_ASSIGN_OR_RETURN(w.header, alloc(sizeof(int32_t) * kWireHeaderInts));
  STEPMESH_ASSIGN_OR_RETURN(w.codes, alloc(sizes.codes_bytes()));
  STEPMESH_ASSIGN_OR_RETURN(w.scales, alloc(sizes.scales_bytes()));
  STEPMESH_ASSIGN_OR_RETURN(w.topk_ids, alloc(sizes.topk_ids_bytes()));
  STEPMESH_ASSIGN_OR_RETURN(w.topk_weights, alloc(sizes.topk_weights_bytes()));
  for (int s = 0; s < shape.ffn; ++s) {
    STEPMESH_ASSIGN_OR_RETURN(auto partial, alloc(F2APartialBytes(slot, h)));
    w.partials.push_back(std::move(partial));
  }
  return w;
}

absl::StatusOr<FfnWire> HostFfnWire(stepmesh::Backend& backend, const RunShape& shape,
                                    const ModelConfig& config) {
  const int64_t w = shape.attention;
  const int64_t slot = shape.SlotRows();
  const int64_t h = config.hidden_size;
  const A2FSizes sizes{w * slot, h, config.top_k, config.fp8_group};
  auto alloc = [&](size_t bytes) {
    return backend.Allocate(bytes, stepmesh::MemoryKind::kHostPinned);
  };
  FfnWire wire;
  STEPMESH_ASSIGN_OR_RETURN(wire.header, alloc(sizeof(int32_t) * w * kWireHeaderInts));
  STEPMESH_ASSIGN_OR_RETURN(wire.codes, alloc(sizes.codes_bytes()));
  STEPMESH_ASSIGN_OR_RETURN(wire.scales, alloc(sizes.scales_bytes()));
  STEPMESH_ASSIGN_OR_RETURN(wire.topk_ids, alloc(sizes.topk_ids_bytes()));
  STEPMESH_ASSIGN_OR_RETURN(wire.topk_weights, alloc(sizes.topk_weights_bytes()));
  STEPMESH_ASSIGN_OR_RETURN(wire.reply, alloc(F2APartialBytes(w * slot, h)));
  return wire;
}

bool RowsContiguous(std::span<const WorkerRows> rows, int64_t slot_rows) {
  for (size_t i = 1; i < rows.size(); ++i) {
    if (rows[i].worker != rows[i - 1].worker + 1 || rows[i - 1].rows != slot_rows) return false;
  }
  return !rows.empty();
}

absl::StatusOr<std::unique_ptr<AttentionEngine>> CreateAttentionEngine(AttentionEngineParams p) {
  const std::string engine = p.shape->ResolvedEngine();
  if (engine == "cpu") return CreateCpuAttentionEngine(std::move(p));
  if (engine == "emulated") return CreateEmulatedAttentionEngine(std::move(p));
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
  if (engine == "emulated") return CreateEmulatedFfnEngine(std::move(p));
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<DeviceOps> ops, OpsFor(engine));
  return CreateDeviceFfnEngine(std::move(p), std::move(ops));
}

}  // namespace afd::example
