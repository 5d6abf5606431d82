#pragma once

// The kernels the device engines (afd_engine_device.cc) enqueue, behind one
// interface with two implementations:
//  - CudaOps (cuda/device_ops_cuda.cc): the CUDA kernels (cuda_kernels.h) on
//    the cudaStream_t behind a stepmesh Stream; linear weights in bf16,
//    generated on the device.
//  - CpuOps (device_ops_cpu.cc): the CPU kernels (cpu_kernels.h), each
//    enqueued as a host function on the stepmesh Stream, fp32 weights. On
//    cpu_mock this runs the device engines' whole orchestration (buffers,
//    offsets, ordering, events) in CI, and bitwise equal to the reference.
// Pointers are "device" pointers of the backend the engine allocated them
// from (host memory on cpu_mock). Every call enqueues and returns at once.

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "examples/afd_model/model_weights.h"
#include "stepmesh/backend.h"

namespace afd::example {

// A linear weight [rows, cols] (the [out, in] layout) in the ops' format.
struct DeviceWeight {
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  // Rows [first, first + count) of this weight (no copy).
  DeviceWeight Rows(int64_t first, int64_t count, size_t element_bytes) const {
    return {static_cast<const char*>(data) + first * cols * element_bytes, count, cols};
  }
};

// Elements [first, first + count) of a generated tensor.
struct ElementRange {
  int64_t first = 0;
  int64_t count = 0;
};

// A stream as the ops see it: the stepmesh Stream (host functions, copies)
// and its native handle (cudaStream_t for CudaOps), resolved once.
struct OpsStream {
  stepmesh::Stream* stream = nullptr;
  void* native = nullptr;
};

// Caller-owned scratch of one op, sized by the *ScratchBytes functions.
struct Scratch {
  void* data = nullptr;
  size_t bytes = 0;
};

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  virtual std::string name() const = 0;
  // Bytes per element of a DeviceWeight (2: bf16, 4: fp32).
  virtual size_t weight_bytes() const = 0;

  virtual absl::StatusOr<OpsStream> Bind(stepmesh::Stream& stream) = 0;

  // Weights, generated (weights.h) where the kernels read them; owned by the
  // ops. A linear weight is the concatenation of `ranges` of the tensor,
  // viewed as [rows, cols].
  virtual absl::StatusOr<DeviceWeight> LinearWeight(const TensorSpec& spec, uint64_t seed,
                                                    std::span<const ElementRange> ranges,
                                                    int64_t rows, int64_t cols) = 0;
  virtual absl::StatusOr<const float*> Fp32Tensor(const TensorSpec& spec, uint64_t seed,
                                                  int64_t count) = 0;
  // A small int32 table (expert_to_slot) copied where the kernels read it.
  virtual absl::StatusOr<const int32_t*> Int32Table(std::span<const int32_t> values) = 0;
  // The device array of device pointers SumBf16Partials reads.
  virtual absl::StatusOr<const uint16_t* const*> PointerTable(
      std::span<const uint16_t* const> values) = 0;

  // Scratch each op needs at its largest shape.
  virtual size_t LinearScratchBytes(int64_t rows, int64_t in, int64_t out) const = 0;
  virtual size_t SwiGluScratchBytes(int64_t rows, int64_t hidden, int64_t inter) const = 0;
  virtual size_t GroupedExpertScratchBytes(int64_t tokens, int k, int64_t hidden, int64_t inter,
                                           int64_t slots) const = 0;
  virtual size_t DecodeScratchBytes(int64_t batch, int64_t heads, int64_t head_dim,
                                    int64_t max_kv_len) const = 0;

  // The kernels (cpu_kernels.h / cuda_kernels.h describe each).
  virtual absl::Status RmsNorm(const OpsStream& s, const float* x, const float* gamma, int64_t rows,
                               int64_t dim, float eps, float* y) = 0;
  // y [rows, w.rows] = x [rows, w.cols] w^T.
  virtual absl::Status Linear(const OpsStream& s, const float* x, int64_t rows,
                              const DeviceWeight& w, float* y, Scratch scratch) = 0;
  virtual absl::Status EmbeddingLookup(const OpsStream& s, const float* table, const int32_t* ids,
                                       int64_t tokens, int64_t hidden, float* out) = 0;
  virtual absl::Status AddInPlace(const OpsStream& s, const float* x, int64_t count,
                                  float* acc) = 0;
  virtual absl::Status RopeNeox(const OpsStream& s, float* x, int64_t tokens, int64_t heads,
                                int64_t head_dim, const int32_t* positions, float theta) = 0;
  virtual absl::Status MqaAttention(const OpsStream& s, const float* q, int64_t queries,
                                    int64_t heads, int64_t head_dim, const float* k, const float* v,
                                    int64_t kv_len, const int32_t* query_positions, float scale,
                                    float* out) = 0;
  virtual absl::Status MqaDecodeAttention(const OpsStream& s, const float* q, int64_t batch,
                                          int64_t heads, int64_t head_dim, const float* k_cache,
                                          const float* v_cache, int64_t cache_stride_rows,
                                          const int32_t* kv_lens, int64_t max_kv_len, float scale,
                                          float* out, Scratch scratch) = 0;
  virtual absl::Status RouterSoftmaxTopK(const OpsStream& s, const float* logits, int64_t tokens,
                                         int64_t experts, int k, int32_t* topk_ids,
                                         float* topk_weights) = 0;
  virtual absl::Status QuantizeFp8(const OpsStream& s, const float* x, int64_t tokens,
                                   int64_t hidden, int64_t group, uint8_t* codes,
                                   float* scales) = 0;
  virtual absl::Status DequantizeFp8(const OpsStream& s, const uint8_t* codes, const float* scales,
                                     int64_t tokens, int64_t hidden, int64_t group, float* x) = 0;
  virtual absl::Status EncodeBf16(const OpsStream& s, const float* x, int64_t count,
                                  uint16_t* out) = 0;
  virtual absl::Status SumBf16Partials(const OpsStream& s, const uint16_t* const* partials,
                                       int num_partials, int64_t count, float* sum) = 0;
  // y (overwritten) = down(silu(x gate^T) * (x up^T)); inter = gate.rows.
  virtual absl::Status SwiGlu(const OpsStream& s, const float* x, int64_t rows, int64_t hidden,
                              const DeviceWeight& gate, const DeviceWeight& up,
                              const DeviceWeight& down, float* y, Scratch scratch) = 0;
  // Accumulated into y; gate/up [slots * inter, hidden], down [slots * hidden, inter].
  virtual absl::Status GroupedExpertSwiGlu(const OpsStream& s, const float* x, int64_t tokens,
                                           int64_t hidden, const int32_t* topk_ids,
                                           const float* topk_weights, int k,
                                           const int32_t* expert_to_slot, int64_t num_experts,
                                           int64_t slots, const DeviceWeight& gate,
                                           const DeviceWeight& up, const DeviceWeight& down,
                                           int64_t inter, float* y, Scratch scratch) = 0;
  // ids[r] = argmax of logits[r, :], ties to the lower index.
  virtual absl::Status ArgmaxRows(const OpsStream& s, const float* logits, int64_t rows,
                                  int64_t cols, int32_t* ids) = 0;
  // dst[row_index[r] * width ...] = src[r * width ...] for r < rows (floats).
  virtual absl::Status ScatterRows(const OpsStream& s, const float* src, int64_t rows,
                                   int64_t width, const int32_t* row_index, float* dst) = 0;
  virtual absl::Status Memset(const OpsStream& s, void* ptr, int value, size_t bytes) = 0;
};

// The CPU kernels as host functions on the stream (any backend whose
// "device" memory the host can address: cpu_mock).
std::unique_ptr<DeviceOps> CreateCpuOps();

}  // namespace afd::example
