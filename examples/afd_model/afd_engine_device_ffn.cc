// The FFN device engine: one partition's FFN forward (the dense SwiGLU or
// shared-expert slice, and the partition's experts grouped) as kernels
// enqueued on the backend's stream (DeviceOps), weights and activations in
// the backend's device memory. The design both device engines follow is at
// the top of afd_engine_device_attention.cc.

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "examples/afd_model/afd_engine.h"
#include "examples/afd_model/device_engine_support.h"
#include "examples/afd_model/device_ops.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/wire.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {
namespace {

using device_engine::Arena;
using device_engine::LinearSpec;
using stepmesh::MemoryKind;

class DeviceFfnEngine final : public FfnEngine {
 public:
  DeviceFfnEngine(FfnEngineParams p, std::unique_ptr<DeviceOps> ops)
      : p_(std::move(p)),
        shape_(*p_.shape),
        config_(*p_.config),
        partition_{p_.rank, shape_.ffn},
        ops_(std::move(ops)),
        arena_(*p_.backend) {}

  absl::Status Init();
  std::string name() const override { return absl::StrCat("device (", ops_->name(), " ops)"); }
  FfnWire& wire(int mb) override { return wires_[mb]; }
  stepmesh::Stream& stream() override { return *stream_; }
  absl::Status EnqueueForward(int mb, int layer, int partitions,
                              std::span<const WorkerRows> rows) override;
  absl::Status Finish() override { return absl::OkStatus(); }

 private:
  struct Mlp {  // a column slice of a SwiGLU; inter 0 when empty
    int64_t inter = 0;
    DeviceWeight gate, up, down;
  };
  struct LayerWeights {
    bool is_moe = false;
    Mlp mlp;  // dense FFN or shared expert slice
    int64_t slots = 0;
    const int32_t* expert_to_slot = nullptr;
    DeviceWeight gate, up, down;  // stacked [slots * I, H] / [slots * H, I]
  };

  absl::StatusOr<Mlp> SliceMlp(const std::string& prefix, int64_t inter);
  absl::Status GenerateWeights();

  const FfnEngineParams p_;
  const RunShape& shape_;
  const ModelConfig& config_;
  const FfnPartition partition_;
  std::unique_ptr<DeviceOps> ops_;
  Arena arena_;
  std::vector<LayerWeights> layers_;
  std::vector<FfnWire> wires_;
  // One stream runs every forward in order, so one set of these suffices.
  float* x_ = nullptr;        // [W * slot, H] dequantised input
  float* partial_ = nullptr;  // [W * slot, H] fp32 partial
  uint8_t* codes_stage_ = nullptr;
  float* scales_stage_ = nullptr;
  int32_t* ids_stage_ = nullptr;
  float* weights_stage_ = nullptr;
  uint16_t* partial_stage_ = nullptr;
  Scratch scratch_;
  OpsStream ops_stream_;
  // Destroyed first: it drains queued work that reads the buffers above.
  std::unique_ptr<stepmesh::Stream> stream_;
};

absl::StatusOr<DeviceFfnEngine::Mlp> DeviceFfnEngine::SliceMlp(const std::string& prefix,
                                                               int64_t inter) {
  const int64_t h = config_.hidden_size;
  const uint64_t seed = config_.weight_seed;
  const int64_t c0 = partition_.ColumnBegin(inter);
  const int64_t c1 = partition_.ColumnEnd(inter);
  Mlp mlp;
  mlp.inter = c1 - c0;
  if (mlp.inter == 0) return mlp;
  // gate/up [inter, H]: rows c0..c1 are contiguous; down [H, inter]: one
  // range of columns per row.
  const ElementRange rows{c0 * h, mlp.inter * h};
  STEPMESH_ASSIGN_OR_RETURN(mlp.gate, ops_->LinearWeight(LinearSpec(prefix + "gate_proj.weight", h),
                                                         seed, {&rows, 1}, mlp.inter, h));
  STEPMESH_ASSIGN_OR_RETURN(mlp.up, ops_->LinearWeight(LinearSpec(prefix + "up_proj.weight", h),
                                                       seed, {&rows, 1}, mlp.inter, h));
  std::vector<ElementRange> columns;
  for (int64_t r = 0; r < h; ++r) columns.push_back({r * inter + c0, mlp.inter});
  STEPMESH_ASSIGN_OR_RETURN(
      mlp.down, ops_->LinearWeight(LinearSpec(prefix + "down_proj.weight", inter), seed, columns, h,
                                   mlp.inter));
  return mlp;
}

absl::Status DeviceFfnEngine::GenerateWeights() {
  const int64_t h = config_.hidden_size;
  const uint64_t seed = config_.weight_seed;
  layers_.resize(config_.num_layers);
  for (int l = 0; l < config_.num_layers; ++l) {
    LayerWeights& w = layers_[l];
    w.is_moe = config_.is_moe_layer[l];
    if (!w.is_moe) {
      STEPMESH_ASSIGN_OR_RETURN(w.mlp,
                                SliceMlp(LayerTensorName(l, "mlp."), config_.dense_intermediate));
      continue;
    }
    STEPMESH_ASSIGN_OR_RETURN(
        w.mlp, SliceMlp(LayerTensorName(l, "share_expert."), config_.shared_intermediate));
    std::vector<int32_t> to_slot(config_.num_experts, -1);
    std::vector<ElementRange> blocks;
    const int64_t inter = config_.expert_intermediate;
    const int64_t matrix = inter * h;
    for (int e = 0; e < config_.num_experts; ++e) {
      if (!partition_.OwnsExpert(e)) continue;
      to_slot[e] = static_cast<int32_t>(w.slots++);
      // Experts are stacked [E, ...]: expert e starts at e * matrix.
      blocks.push_back({e * matrix, matrix});
    }
    STEPMESH_ASSIGN_OR_RETURN(w.expert_to_slot, ops_->Int32Table(to_slot));
    if (w.slots == 0) continue;
    STEPMESH_ASSIGN_OR_RETURN(
        w.gate, ops_->LinearWeight(LinearSpec(LayerTensorName(l, "moe.gate_proj.weight"), h), seed,
                                   blocks, w.slots * inter, h));
    STEPMESH_ASSIGN_OR_RETURN(
        w.up, ops_->LinearWeight(LinearSpec(LayerTensorName(l, "moe.up_proj.weight"), h), seed,
                                 blocks, w.slots * inter, h));
    STEPMESH_ASSIGN_OR_RETURN(
        w.down, ops_->LinearWeight(LinearSpec(LayerTensorName(l, "moe.down_proj.weight"), inter),
                                   seed, blocks, w.slots * h, inter));
  }
  return absl::OkStatus();
}

absl::Status DeviceFfnEngine::Init() {
  STEPMESH_ASSIGN_OR_RETURN(stream_, p_.backend->CreateStream());
  STEPMESH_ASSIGN_OR_RETURN(ops_stream_, ops_->Bind(*stream_));
  STEPMESH_RETURN_IF_ERROR(GenerateWeights());
  const int64_t w = shape_.attention;
  const int64_t slot = shape_.SlotRows();
  const int64_t rows = w * slot;
  const int64_t h = config_.hidden_size;
  const int64_t k = config_.top_k;
  const A2FSizes sizes{rows, h, k, config_.fp8_group};
  for (int m = 0; m < shape_.micro_batches; ++m) {
    FfnWire& wire = wires_.emplace_back();
    auto alloc = [&](size_t bytes, MemoryKind kind) { return p_.backend->Allocate(bytes, kind); };
    STEPMESH_ASSIGN_OR_RETURN(
        wire.header, alloc(sizeof(int32_t) * w * kWireHeaderInts, MemoryKind::kHostPinned));
    STEPMESH_ASSIGN_OR_RETURN(wire.codes, alloc(sizes.codes_bytes(), MemoryKind::kDevice));
    STEPMESH_ASSIGN_OR_RETURN(wire.scales, alloc(sizes.scales_bytes(), MemoryKind::kDevice));
    STEPMESH_ASSIGN_OR_RETURN(wire.topk_ids, alloc(sizes.topk_ids_bytes(), MemoryKind::kDevice));
    STEPMESH_ASSIGN_OR_RETURN(wire.topk_weights,
                              alloc(sizes.topk_weights_bytes(), MemoryKind::kDevice));
    STEPMESH_ASSIGN_OR_RETURN(wire.reply, alloc(F2APartialBytes(rows, h), MemoryKind::kDevice));
  }
  STEPMESH_ASSIGN_OR_RETURN(x_, arena_.Take<float>(rows * h));
  STEPMESH_ASSIGN_OR_RETURN(partial_, arena_.Take<float>(rows * h));
  STEPMESH_ASSIGN_OR_RETURN(codes_stage_, arena_.Take<uint8_t>(rows * h));
  STEPMESH_ASSIGN_OR_RETURN(scales_stage_, arena_.Take<float>(rows * (h / config_.fp8_group)));
  STEPMESH_ASSIGN_OR_RETURN(ids_stage_, arena_.Take<int32_t>(rows * k));
  STEPMESH_ASSIGN_OR_RETURN(weights_stage_, arena_.Take<float>(rows * k));
  STEPMESH_ASSIGN_OR_RETURN(partial_stage_, arena_.Take<uint16_t>(rows * h));
  size_t scratch = 0;
  for (const LayerWeights& l : layers_) {
    scratch = std::max(scratch, ops_->SwiGluScratchBytes(rows, h, l.mlp.inter));
    if (l.slots > 0) {
      scratch =
          std::max(scratch, ops_->GroupedExpertScratchBytes(rows, config_.top_k, h,
                                                            config_.expert_intermediate, l.slots));
    }
  }
  scratch_.bytes = scratch;
  STEPMESH_ASSIGN_OR_RETURN(scratch_.data, arena_.Take<unsigned char>(scratch));
  return absl::OkStatus();
}

absl::Status DeviceFfnEngine::EnqueueForward(int m, int layer, int partitions,
                                             std::span<const WorkerRows> rows) {
  if (partitions != partition_.count) {
    // The device weights are generated once, for one layout (RunShape::Validate
    // keeps --resize off the device engines).
    return absl::InvalidArgumentError(
        absl::StrCat("ffn ", p_.rank, ": the ", name(), " engine holds partition ",
                     partition_.index, " of ", partition_.count, ", not of ", partitions));
  }
  const int64_t slot = shape_.SlotRows();
  const int64_t h = config_.hidden_size;
  const int64_t k = config_.top_k;
  const int64_t groups = h / config_.fp8_group;
  const FfnWire& wire = wires_[m];
  auto* codes = static_cast<uint8_t*>(wire.codes->data());
  auto* scales = static_cast<float*>(wire.scales->data());
  auto* ids = static_cast<int32_t*>(wire.topk_ids->data());
  auto* weights = static_cast<float*>(wire.topk_weights->data());
  auto* reply = static_cast<uint16_t*>(wire.reply->data());
  stepmesh::Stream& st = *stream_;
  const OpsStream& s = ops_stream_;
  int64_t n = 0;
  for (const WorkerRows& wr : rows) n += wr.rows;
  const bool contiguous = RowsContiguous(rows, slot);
  const int64_t base = contiguous ? int64_t{rows.front().worker} * slot : 0;
  if (!contiguous) {
    // Gather each worker's rows into one block (device-to-device copies).
    int64_t at = 0;
    for (const WorkerRows& wr : rows) {
      const int64_t src = int64_t{wr.worker} * slot;
      STEPMESH_RETURN_IF_ERROR(st.CopyAsync(codes_stage_ + at * h, codes + src * h, wr.rows * h));
      STEPMESH_RETURN_IF_ERROR(st.CopyAsync(scales_stage_ + at * groups, scales + src * groups,
                                            sizeof(float) * wr.rows * groups));
      STEPMESH_RETURN_IF_ERROR(
          st.CopyAsync(ids_stage_ + at * k, ids + src * k, sizeof(int32_t) * wr.rows * k));
      STEPMESH_RETURN_IF_ERROR(
          st.CopyAsync(weights_stage_ + at * k, weights + src * k, sizeof(float) * wr.rows * k));
      at += wr.rows;
    }
  }
  const uint8_t* in_codes = contiguous ? codes + base * h : codes_stage_;
  const float* in_scales = contiguous ? scales + base * groups : scales_stage_;
  const int32_t* in_ids = contiguous ? ids + base * k : ids_stage_;
  const float* in_weights = contiguous ? weights + base * k : weights_stage_;
  uint16_t* out = contiguous ? reply + base * h : partial_stage_;

  const LayerWeights& w = layers_[layer];
  STEPMESH_RETURN_IF_ERROR(
      ops_->DequantizeFp8(s, in_codes, in_scales, n, h, config_.fp8_group, x_));
  if (w.mlp.inter > 0) {
    STEPMESH_RETURN_IF_ERROR(
        ops_->SwiGlu(s, x_, n, h, w.mlp.gate, w.mlp.up, w.mlp.down, partial_, scratch_));
  } else {
    STEPMESH_RETURN_IF_ERROR(ops_->Memset(s, partial_, 0, sizeof(float) * n * h));
  }
  if (w.is_moe && w.slots > 0) {
    STEPMESH_RETURN_IF_ERROR(ops_->GroupedExpertSwiGlu(
        s, x_, n, h, in_ids, in_weights, config_.top_k, w.expert_to_slot, config_.num_experts,
        w.slots, w.gate, w.up, w.down, config_.expert_intermediate, partial_, scratch_));
  }
  STEPMESH_RETURN_IF_ERROR(ops_->EncodeBf16(s, partial_, n * h, out));
  if (!contiguous) {
    int64_t at = 0;
    for (const WorkerRows& wr : rows) {
      STEPMESH_RETURN_IF_ERROR(st.CopyAsync(reply + int64_t{wr.worker} * slot * h,
                                            partial_stage_ + at * h,
                                            sizeof(uint16_t) * wr.rows * h));
      at += wr.rows;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<FfnEngine>> CreateDeviceFfnEngine(FfnEngineParams p,
                                                                 std::unique_ptr<DeviceOps> ops) {
  return MakeEngine<FfnEngine, DeviceFfnEngine>(std::move(p), std::move(ops));
}

}  // namespace afd::example
