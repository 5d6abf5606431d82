// CudaOps: DeviceOps over the CUDA kernels (cuda_kernels.h), enqueued on the
// cudaStream_t behind each stepmesh Stream. Linear and expert weights are
// bf16 (exact for the generated values), generated on the device, so even
// the full-width config never materialises weights on the host. Every
// kernel is enqueued without a host synchronisation (the tiled GEMMs keep
// the expert schedule on the device).

#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "examples/afd_model/cuda/cuda_kernels.h"
#include "examples/afd_model/cuda/cuda_raii.h"
#include "examples/afd_model/device_ops.h"
#include "stepmesh/cuda.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {
namespace {

absl::Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
  return e == cudaErrorMemoryAllocation ? absl::ResourceExhaustedError(message)
                                        : absl::InternalError(message);
}

cudaStream_t Native(const OpsStream& s) { return static_cast<cudaStream_t>(s.native); }

class CudaOps final : public DeviceOps {
 public:
  absl::Status Init() { return Check(init_stream_.status(), "cudaStreamCreate"); }

  std::string name() const override { return "cuda"; }
  size_t weight_bytes() const override { return sizeof(uint16_t); }

  absl::StatusOr<OpsStream> Bind(stepmesh::Stream& stream) override {
    STEPMESH_ASSIGN_OR_RETURN(void* native, stepmesh::NativeCudaStream(stream));
    return OpsStream{&stream, native};
  }

  absl::StatusOr<DeviceWeight> LinearWeight(const TensorSpec& spec, uint64_t seed,
                                            std::span<const ElementRange> ranges, int64_t rows,
                                            int64_t cols) override {
    cuda::DeviceBuffer<uint16_t>& w = bf16_.emplace_back(static_cast<size_t>(rows * cols));
    STEPMESH_RETURN_IF_ERROR(Check(w.status(), "cudaMalloc (weights)"));
    int64_t at = 0;
    for (const ElementRange& r : ranges) {
      if (at + r.count > rows * cols) {
        return absl::InvalidArgumentError(spec.name + ": ranges exceed the weight's shape");
      }
      STEPMESH_RETURN_IF_ERROR(Check(
          cuda::FillTensorBf16(spec, seed, r.first, r.count, w.get() + at, init_stream_.get()),
          "FillTensorBf16"));
      at += r.count;
    }
    if (at != rows * cols) {
      return absl::InvalidArgumentError(spec.name + ": ranges do not fill the weight");
    }
    STEPMESH_RETURN_IF_ERROR(Check(cudaStreamSynchronize(init_stream_.get()), "weights"));
    return DeviceWeight{w.get(), rows, cols};
  }

  absl::StatusOr<const float*> Fp32Tensor(const TensorSpec& spec, uint64_t seed,
                                          int64_t count) override {
    cuda::DeviceBuffer<float>& t = f32_.emplace_back(static_cast<size_t>(count));
    STEPMESH_RETURN_IF_ERROR(Check(t.status(), "cudaMalloc (tensor)"));
    STEPMESH_RETURN_IF_ERROR(
        Check(cuda::FillTensor(spec, seed, 0, count, t.get(), init_stream_.get()), "FillTensor"));
    STEPMESH_RETURN_IF_ERROR(Check(cudaStreamSynchronize(init_stream_.get()), "tensor"));
    return t.get();
  }

  absl::StatusOr<const int32_t*> Int32Table(std::span<const int32_t> values) override {
    cuda::DeviceBuffer<int32_t>& t = i32_.emplace_back(values.size());
    STEPMESH_RETURN_IF_ERROR(Check(t.status(), "cudaMalloc (table)"));
    STEPMESH_RETURN_IF_ERROR(Check(
        cudaMemcpy(t.get(), values.data(), values.size_bytes(), cudaMemcpyHostToDevice), "table"));
    return t.get();
  }

  absl::StatusOr<const uint16_t* const*> PointerTable(
      std::span<const uint16_t* const> values) override {
    cuda::DeviceBuffer<const uint16_t*>& t = pointers_.emplace_back(values.size());
    STEPMESH_RETURN_IF_ERROR(Check(t.status(), "cudaMalloc (pointers)"));
    STEPMESH_RETURN_IF_ERROR(
        Check(cudaMemcpy(t.get(), values.data(), values.size_bytes(), cudaMemcpyHostToDevice),
              "pointers"));
    return t.get();
  }

  size_t LinearScratchBytes(int64_t rows, int64_t in, int64_t out) const override {
    return cuda::LinearWorkspaceBytes(rows, in, out);
  }
  size_t SwiGluScratchBytes(int64_t rows, int64_t hidden, int64_t inter) const override {
    return inter == 0 ? 0 : cuda::SwiGluWorkspaceBytes(rows, hidden, inter);
  }
  size_t GroupedExpertScratchBytes(int64_t tokens, int k, int64_t hidden, int64_t inter,
                                   int64_t slots) const override {
    return cuda::GroupedExpertWorkspaceBytes(tokens, k, hidden, inter, slots);
  }
  size_t DecodeScratchBytes(int64_t batch, int64_t heads, int64_t head_dim,
                            int64_t max_kv_len) const override {
    return cuda::MqaDecodeWorkspaceBytes(batch, heads, head_dim, max_kv_len);
  }

  absl::Status RmsNorm(const OpsStream& s, const float* x, const float* gamma, int64_t rows,
                       int64_t dim, float eps, float* y) override {
    return Check(cuda::RmsNorm(x, gamma, rows, dim, eps, y, Native(s)), "RmsNorm");
  }
  absl::Status Linear(const OpsStream& s, const float* x, int64_t rows, const DeviceWeight& w,
                      float* y, Scratch scratch) override {
    return Check(cuda::Linear(x, rows, w.cols, static_cast<const uint16_t*>(w.data), w.rows, y,
                              scratch.data, scratch.bytes, Native(s)),
                 "Linear");
  }
  absl::Status EmbeddingLookup(const OpsStream& s, const float* table, const int32_t* ids,
                               int64_t tokens, int64_t hidden, float* out) override {
    return Check(cuda::EmbeddingLookup(table, ids, tokens, hidden, out, Native(s)),
                 "EmbeddingLookup");
  }
  absl::Status AddInPlace(const OpsStream& s, const float* x, int64_t count, float* acc) override {
    return Check(cuda::AddInPlace(x, count, acc, Native(s)), "AddInPlace");
  }
  absl::Status RopeNeox(const OpsStream& s, float* x, int64_t tokens, int64_t heads,
                        int64_t head_dim, const int32_t* positions, float theta) override {
    return Check(cuda::RopeNeoxInPlace(x, tokens, heads, head_dim, positions, theta, Native(s)),
                 "RopeNeoxInPlace");
  }
  absl::Status MqaAttention(const OpsStream& s, const float* q, int64_t queries, int64_t heads,
                            int64_t head_dim, const float* k, const float* v, int64_t kv_len,
                            const int32_t* query_positions, float scale, float* out) override {
    return Check(cuda::MqaAttention(q, queries, heads, head_dim, k, v, kv_len, query_positions,
                                    scale, out, Native(s)),
                 "MqaAttention");
  }
  absl::Status MqaDecodeAttention(const OpsStream& s, const float* q, int64_t batch, int64_t heads,
                                  int64_t head_dim, const float* k_cache, const float* v_cache,
                                  int64_t stride, const int32_t* kv_lens, int64_t max_kv_len,
                                  float scale, float* out, Scratch scratch) override {
    return Check(
        cuda::MqaDecodeAttention(q, batch, heads, head_dim, k_cache, v_cache, stride, kv_lens,
                                 max_kv_len, scale, out, scratch.data, scratch.bytes, Native(s)),
        "MqaDecodeAttention");
  }
  absl::Status RouterSoftmaxTopK(const OpsStream& s, const float* logits, int64_t tokens,
                                 int64_t experts, int k, int32_t* topk_ids,
                                 float* topk_weights) override {
    return Check(
        cuda::RouterSoftmaxTopK(logits, tokens, experts, k, topk_ids, topk_weights, Native(s)),
        "RouterSoftmaxTopK");
  }
  absl::Status QuantizeFp8(const OpsStream& s, const float* x, int64_t tokens, int64_t hidden,
                           int64_t group, uint8_t* codes, float* scales) override {
    return Check(cuda::QuantizeFp8PerGroup(x, tokens, hidden, group, codes, scales, Native(s)),
                 "QuantizeFp8PerGroup");
  }
  absl::Status DequantizeFp8(const OpsStream& s, const uint8_t* codes, const float* scales,
                             int64_t tokens, int64_t hidden, int64_t group, float* x) override {
    return Check(cuda::DequantizeFp8PerGroup(codes, scales, tokens, hidden, group, x, Native(s)),
                 "DequantizeFp8PerGroup");
  }
  absl::Status EncodeBf16(const OpsStream& s, const float* x, int64_t count,
                          uint16_t* out) override {
    return Check(cuda::EncodeBf16Array(x, count, out, Native(s)), "EncodeBf16Array");
  }
  absl::Status SumBf16Partials(const OpsStream& s, const uint16_t* const* partials,
                               int num_partials, int64_t count, float* sum) override {
    return Check(cuda::SumBf16Partials(partials, num_partials, count, sum, Native(s)),
                 "SumBf16Partials");
  }
  absl::Status SwiGlu(const OpsStream& s, const float* x, int64_t rows, int64_t hidden,
                      const DeviceWeight& gate, const DeviceWeight& up, const DeviceWeight& down,
                      float* y, Scratch scratch) override {
    return Check(
        cuda::SwiGlu(x, rows, hidden, static_cast<const uint16_t*>(gate.data),
                     static_cast<const uint16_t*>(up.data), static_cast<const uint16_t*>(down.data),
                     gate.rows, scratch.data, scratch.bytes, y, Native(s)),
        "SwiGlu");
  }
  absl::Status GroupedExpertSwiGlu(const OpsStream& s, const float* x, int64_t tokens,
                                   int64_t hidden, const int32_t* topk_ids,
                                   const float* topk_weights, int k, const int32_t* expert_to_slot,
                                   int64_t num_experts, int64_t slots, const DeviceWeight& gate,
                                   const DeviceWeight& up, const DeviceWeight& down, int64_t inter,
                                   float* y, Scratch scratch) override {
    return Check(cuda::GroupedExpertSwiGlu(
                     x, tokens, hidden, topk_ids, topk_weights, k, expert_to_slot, num_experts,
                     slots, static_cast<const uint16_t*>(gate.data),
                     static_cast<const uint16_t*>(up.data), static_cast<const uint16_t*>(down.data),
                     inter, scratch.data, scratch.bytes, y, Native(s)),
                 "GroupedExpertSwiGlu");
  }
  absl::Status ArgmaxRows(const OpsStream& s, const float* logits, int64_t rows, int64_t cols,
                          int32_t* ids) override {
    return Check(cuda::ArgmaxRows(logits, rows, cols, ids, Native(s)), "ArgmaxRows");
  }
  absl::Status ScatterRows(const OpsStream& s, const float* src, int64_t rows, int64_t width,
                           const int32_t* row_index, float* dst) override {
    return Check(cuda::ScatterRows(src, rows, width, row_index, dst, Native(s)), "ScatterRows");
  }
  absl::Status Memset(const OpsStream& s, void* ptr, int value, size_t bytes) override {
    return Check(cudaMemsetAsync(ptr, value, bytes, Native(s)), "cudaMemsetAsync");
  }

 private:
  cuda::Stream init_stream_;  // weight generation at start-up
  std::vector<cuda::DeviceBuffer<uint16_t>> bf16_;
  std::vector<cuda::DeviceBuffer<float>> f32_;
  std::vector<cuda::DeviceBuffer<int32_t>> i32_;
  std::vector<cuda::DeviceBuffer<const uint16_t*>> pointers_;
};

}  // namespace

absl::StatusOr<int64_t> CudaFreeBytes() {
  size_t free_bytes = 0, total = 0;
  if (cudaError_t e = cudaMemGetInfo(&free_bytes, &total); e != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cudaMemGetInfo: ", cudaGetErrorString(e)));
  }
  return static_cast<int64_t>(free_bytes);
}

absl::StatusOr<std::unique_ptr<DeviceOps>> CreateCudaOps() {
  auto ops = std::make_unique<CudaOps>();
  STEPMESH_RETURN_IF_ERROR(ops->Init());
  return ops;
}

}  // namespace afd::example
