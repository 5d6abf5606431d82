// CpuOps: every kernel of DeviceOps is the CPU kernel, enqueued as a host
// function on the stepmesh stream, so it runs in stream order after the
// copies and host functions enqueued before it (as a CUDA kernel would). The
// arguments are captured by value at enqueue time, like kernel arguments.

#include <algorithm>
#include <cstring>
#include <deque>
#include <vector>

#include "examples/afd_model/device_ops.h"
#include "examples/afd_model/kernels/cpu_kernels.h"

namespace afd::example {
namespace {

class CpuOps final : public DeviceOps {
 public:
  std::string name() const override { return "cpu"; }
  size_t weight_bytes() const override { return sizeof(float); }

  absl::StatusOr<OpsStream> Bind(stepmesh::Stream& stream) override {
    return OpsStream{&stream, nullptr};
  }

  absl::StatusOr<DeviceWeight> LinearWeight(const TensorSpec& spec, uint64_t seed,
                                            std::span<const ElementRange> ranges, int64_t rows,
                                            int64_t cols) override {
    std::vector<float>& w = floats_.emplace_back(rows * cols);
    int64_t at = 0;
    for (const ElementRange& r : ranges) {
      if (at + r.count > rows * cols) {
        return absl::InvalidArgumentError(spec.name + ": ranges exceed the weight's shape");
      }
      FillTensor(spec, seed, r.first, r.count, w.data() + at);
      at += r.count;
    }
    if (at != rows * cols) {
      return absl::InvalidArgumentError(spec.name + ": ranges do not fill the weight");
    }
    return DeviceWeight{w.data(), rows, cols};
  }

  absl::StatusOr<const float*> Fp32Tensor(const TensorSpec& spec, uint64_t seed,
                                          int64_t count) override {
    std::vector<float>& t = floats_.emplace_back(count);
    FillTensor(spec, seed, 0, count, t.data());
    return t.data();
  }

  absl::StatusOr<const int32_t*> Int32Table(std::span<const int32_t> values) override {
    return ints_.emplace_back(values.begin(), values.end()).data();
  }

  absl::StatusOr<const uint16_t* const*> PointerTable(
      std::span<const uint16_t* const> values) override {
    return pointers_.emplace_back(values.begin(), values.end()).data();
  }

  size_t LinearScratchBytes(int64_t, int64_t, int64_t) const override { return 0; }
  size_t SwiGluScratchBytes(int64_t rows, int64_t, int64_t inter) const override {
    return sizeof(float) * cpu::SwiGluScratchFloats(rows, inter);
  }
  size_t GroupedExpertScratchBytes(int64_t tokens, int, int64_t hidden, int64_t inter,
                                   int64_t) const override {
    return sizeof(float) * cpu::GroupedExpertScratchFloats(tokens, hidden, inter);
  }
  size_t DecodeScratchBytes(int64_t, int64_t, int64_t, int64_t) const override { return 0; }

  absl::Status RmsNorm(const OpsStream& s, const float* x, const float* gamma, int64_t rows,
                       int64_t dim, float eps, float* y) override {
    return Enqueue(s, [=] { cpu::RmsNorm(x, gamma, rows, dim, eps, y); });
  }
  absl::Status Linear(const OpsStream& s, const float* x, int64_t rows, const DeviceWeight& w,
                      float* y, Scratch) override {
    const auto* weight = static_cast<const float*>(w.data);
    const int64_t in = w.cols, out = w.rows;
    return Enqueue(s, [=] { cpu::Linear(x, rows, in, weight, out, y); });
  }
  absl::Status EmbeddingLookup(const OpsStream& s, const float* table, const int32_t* ids,
                               int64_t tokens, int64_t hidden, float* out) override {
    return Enqueue(s, [=] { cpu::EmbeddingLookup(table, ids, tokens, hidden, out); });
  }
  absl::Status AddInPlace(const OpsStream& s, const float* x, int64_t count, float* acc) override {
    return Enqueue(s, [=] { cpu::AddInPlace(x, count, acc); });
  }
  absl::Status RopeNeox(const OpsStream& s, float* x, int64_t tokens, int64_t heads,
                        int64_t head_dim, const int32_t* positions, float theta) override {
    return Enqueue(s, [=] { cpu::RopeNeoxInPlace(x, tokens, heads, head_dim, positions, theta); });
  }
  absl::Status MqaAttention(const OpsStream& s, const float* q, int64_t queries, int64_t heads,
                            int64_t head_dim, const float* k, const float* v, int64_t kv_len,
                            const int32_t* query_positions, float scale, float* out) override {
    return Enqueue(s, [=] {
      cpu::MqaAttention(q, queries, heads, head_dim, k, v, kv_len, query_positions, scale, out);
    });
  }
  absl::Status MqaDecodeAttention(const OpsStream& s, const float* q, int64_t batch, int64_t heads,
                                  int64_t head_dim, const float* k_cache, const float* v_cache,
                                  int64_t stride, const int32_t* kv_lens, int64_t max_kv_len,
                                  float scale, float* out, Scratch) override {
    // What the CUDA decode kernel computes: one query per sequence at
    // position kv_len - 1 over rows [0, kv_len), kv_len clamped to
    // [0, max_kv_len].
    return Enqueue(s, [=] {
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t len = std::min<int64_t>(std::max<int32_t>(kv_lens[b], 0), max_kv_len);
        const int32_t position = static_cast<int32_t>(len - 1);
        cpu::MqaAttention(q + b * heads * head_dim, 1, heads, head_dim,
                          k_cache + b * stride * head_dim, v_cache + b * stride * head_dim, len,
                          &position, scale, out + b * heads * head_dim);
      }
    });
  }
  absl::Status RouterSoftmaxTopK(const OpsStream& s, const float* logits, int64_t tokens,
                                 int64_t experts, int k, int32_t* topk_ids,
                                 float* topk_weights) override {
    return Enqueue(
        s, [=] { cpu::RouterSoftmaxTopK(logits, tokens, experts, k, topk_ids, topk_weights); });
  }
  absl::Status QuantizeFp8(const OpsStream& s, const float* x, int64_t tokens, int64_t hidden,
                           int64_t group, uint8_t* codes, float* scales) override {
    return Enqueue(s, [=] { cpu::QuantizeFp8PerGroup(x, tokens, hidden, group, codes, scales); });
  }
  absl::Status DequantizeFp8(const OpsStream& s, const uint8_t* codes, const float* scales,
                             int64_t tokens, int64_t hidden, int64_t group, float* x) override {
    return Enqueue(s, [=] { cpu::DequantizeFp8PerGroup(codes, scales, tokens, hidden, group, x); });
  }
  absl::Status EncodeBf16(const OpsStream& s, const float* x, int64_t count,
                          uint16_t* out) override {
    return Enqueue(s, [=] { cpu::EncodeBf16Array(x, count, out); });
  }
  absl::Status SumBf16Partials(const OpsStream& s, const uint16_t* const* partials,
                               int num_partials, int64_t count, float* sum) override {
    return Enqueue(s, [=] { cpu::SumBf16Partials(partials, num_partials, count, sum); });
  }
  absl::Status SwiGlu(const OpsStream& s, const float* x, int64_t rows, int64_t hidden,
                      const DeviceWeight& gate, const DeviceWeight& up, const DeviceWeight& down,
                      float* y, Scratch scratch) override {
    const auto* g = static_cast<const float*>(gate.data);
    const auto* u = static_cast<const float*>(up.data);
    const auto* d = static_cast<const float*>(down.data);
    const int64_t inter = gate.rows;
    auto* work = static_cast<float*>(scratch.data);
    return Enqueue(s, [=] { cpu::SwiGlu(x, rows, hidden, g, u, d, inter, work, y); });
  }
  absl::Status GroupedExpertSwiGlu(const OpsStream& s, const float* x, int64_t tokens,
                                   int64_t hidden, const int32_t* topk_ids,
                                   const float* topk_weights, int k, const int32_t* expert_to_slot,
                                   int64_t num_experts, int64_t slots, const DeviceWeight& gate,
                                   const DeviceWeight& up, const DeviceWeight& down, int64_t inter,
                                   float* y, Scratch scratch) override {
    const auto* g = static_cast<const float*>(gate.data);
    const auto* u = static_cast<const float*>(up.data);
    const auto* d = static_cast<const float*>(down.data);
    auto* work = static_cast<float*>(scratch.data);
    return Enqueue(s, [=] {
      cpu::GroupedExpertSwiGlu(x, tokens, hidden, topk_ids, topk_weights, k, expert_to_slot,
                               num_experts, slots, g, u, d, inter, work, y);
    });
  }
  absl::Status ArgmaxRows(const OpsStream& s, const float* logits, int64_t rows, int64_t cols,
                          int32_t* ids) override {
    return Enqueue(s, [=] { cpu::ArgmaxRows(logits, rows, cols, ids); });
  }
  absl::Status ScatterRows(const OpsStream& s, const float* src, int64_t rows, int64_t width,
                           const int32_t* row_index, float* dst) override {
    return Enqueue(s, [=] {
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(dst + int64_t{row_index[r]} * width, src + r * width, sizeof(float) * width);
      }
    });
  }
  absl::Status Memset(const OpsStream& s, void* ptr, int value, size_t bytes) override {
    return Enqueue(s, [=] { std::memset(ptr, value, bytes); });
  }

 private:
  template <typename F>
  static absl::Status Enqueue(const OpsStream& s, F fn) {
    return s.stream->LaunchHostFunc(std::move(fn));
  }

  // Deques: references to earlier elements stay valid as more are added.
  std::deque<std::vector<float>> floats_;
  std::deque<std::vector<int32_t>> ints_;
  std::deque<std::vector<const uint16_t*>> pointers_;
};

}  // namespace

std::unique_ptr<DeviceOps> CreateCpuOps() { return std::make_unique<CpuOps>(); }

}  // namespace afd::example
