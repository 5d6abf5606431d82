// Compares every CUDA kernel of examples/afd_model/cuda with its CPU twin on
// random inputs of Step-3's full widths, and times the ones that matter:
// MFA decode attention against HBM bandwidth, and the bf16 GEMMs against
// cuBLAS. Prints one table; exits 0 when every check passes, 1 otherwise,
// 77 (ctest: skipped) without a GPU.
//
// Bounds (docs/step3 §3.5): codecs, routing ids and weight generation must
// match bit for bit; fp32 reductions in another order to ~1e-6; TF32 / bf16
// tensor-core paths get kTensorCoreBound (the doc's "bf16 GEMMs add ~3e-3
// relative noise", with headroom).

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "examples/afd_model/config.h"
#include "examples/afd_model/cuda/cuda_kernels.h"
#include "examples/afd_model/cuda/cuda_raii.h"
#include "examples/afd_model/kernels/codec.h"
#include "examples/afd_model/kernels/cpu_kernels.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/weights.h"
#include "tests/support/random_vector.h"

namespace afd {
namespace {

using cuda::DeviceBuffer;

constexpr double kHbmGBs = 4800.0;  // H200 datasheet
constexpr double kFp32OrderBound = 1e-5;
constexpr double kTensorCoreBound = 1e-2;

// ---------------------------------------------------------------- plumbing

[[noreturn]] void Fail(const char* file, int line, const std::string& what) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + what);
}

#define CUDA_OK(expr)                                                       \
  do {                                                                      \
    const cudaError_t status_ = (expr);                                     \
    if (status_ != cudaSuccess) {                                           \
      Fail(__FILE__, __LINE__,                                              \
           std::string(#expr) + " -> " + cudaGetErrorName(status_) + " (" + \
               cudaGetErrorString(status_) + ")");                          \
    }                                                                       \
  } while (0)

template <typename T>
DeviceBuffer<T> Alloc(size_t count) {
  DeviceBuffer<T> buffer(count);
  CUDA_OK(buffer.status());
  return buffer;
}

template <typename T>
DeviceBuffer<T> ToDevice(const std::vector<T>& host) {
  DeviceBuffer<T> buffer = Alloc<T>(host.size());
  CUDA_OK(cudaMemcpy(buffer.get(), host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice));
  // cudaMemcpy from pageable memory may return before the DMA lands, and the
  // test's stream does not synchronise with the legacy default stream.
  CUDA_OK(cudaDeviceSynchronize());
  return buffer;
}

template <typename T>
std::vector<T> ToHost(const T* device, size_t count) {
  std::vector<T> host(count);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(host.data(), device, sizeof(T) * count, cudaMemcpyDeviceToHost));
  return host;
}

double RelL2(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0.0;
  double norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  if (!std::isfinite(diff)) return INFINITY;
  return norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

size_t NonFinite(const std::vector<float>& values) {
  size_t count = 0;
  for (float x : values) count += std::isfinite(x) ? 0 : 1;
  return count;
}

template <typename T>
size_t BitMismatches(const std::vector<T>& a, const std::vector<T>& b) {
  size_t count = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) ++count;
  }
  return count;
}

// Bitwise, except that any two NaNs are equal: arithmetic NaNs (0 * inf in
// a dequantised all-infinite group) have a different bit pattern on x86
// (0xFFC00000) and on a GPU (0x7FFFFFFF).
size_t FloatMismatches(const std::vector<float>& a, const std::vector<float>& b) {
  size_t count = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) ++count;
  }
  return count;
}

// The 64-bit engine these cases were written against.
std::vector<float> RandomNormal(size_t count, uint64_t seed, float stddev = 1.0f) {
  return stepmesh::testing::RandomNormal<std::mt19937_64>(count, seed, stddev);
}

std::vector<uint16_t> ToBf16(const std::vector<float>& x) {
  std::vector<uint16_t> out(x.size());
  cpu::EncodeBf16Array(x.data(), static_cast<int64_t>(x.size()), out.data());
  return out;
}

// Average milliseconds of `enqueue` over `iterations` back-to-back calls on
// `stream`, after two warm-up calls.
double TimeMs(cudaStream_t stream, int iterations, const std::function<void()>& enqueue) {
  cuda::Event start;
  cuda::Event stop;
  CUDA_OK(start.status());
  CUDA_OK(stop.status());
  enqueue();
  enqueue();
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaEventRecord(start.get(), stream));
  for (int i = 0; i < iterations; ++i) enqueue();
  CUDA_OK(cudaEventRecord(stop.get(), stream));
  CUDA_OK(cudaEventSynchronize(stop.get()));
  float ms = 0.0f;
  CUDA_OK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
  return ms / iterations;
}

std::string Format(const char* format, double a) {
  char buffer[96];
  std::snprintf(buffer, sizeof(buffer), format, a);
  return buffer;
}
std::string Format(const char* format, double a, double b) {
  char buffer[96];
  std::snprintf(buffer, sizeof(buffer), format, a, b);
  return buffer;
}

struct Row {
  std::string check;
  std::string shape;
  std::string error;  // measured
  std::string bound;
  bool pass = true;
  std::string time;        // GPU ms
  std::string throughput;  // GB/s, TFLOP/s, ...
};

class Report {
 public:
  void Add(Row row) { rows_.push_back(std::move(row)); }
  void Check(std::string check, std::string shape, double error, double bound,
             std::string time = "", std::string throughput = "") {
    Add({std::move(check), std::move(shape), Format("%.3g", error), Format("%.0e", bound),
         error <= bound, std::move(time), std::move(throughput)});
  }
  void Exact(std::string check, std::string shape, size_t mismatches, std::string time = "",
             std::string throughput = "") {
    Add({std::move(check), std::move(shape), std::to_string(mismatches) + " diff", "bitwise",
         mismatches == 0, std::move(time), std::move(throughput)});
  }
  void Info(std::string check, std::string shape, std::string what, std::string time = "",
            std::string throughput = "") {
    Add({std::move(check), std::move(shape), std::move(what), "-", true, std::move(time),
         std::move(throughput)});
  }
  void Error(const std::string& check, const std::string& message) {
    Add({check, "", "ERROR", "", false, "", ""});
    std::fprintf(stderr, "[%s] %s\n", check.c_str(), message.c_str());
  }
  bool AllPassed() const {
    return std::all_of(rows_.begin(), rows_.end(), [](const Row& r) { return r.pass; });
  }
  void Print() const {
    std::printf("\n%-34s %-30s %-12s %-8s %-5s %-10s %s\n", "check", "shape", "error", "bound",
                "ok", "gpu ms", "throughput");
    std::printf("%s\n", std::string(128, '-').c_str());
    for (const Row& r : rows_) {
      std::printf("%-34s %-30s %-12s %-8s %-5s %-10s %s\n", r.check.c_str(), r.shape.c_str(),
                  r.error.c_str(), r.bound.c_str(), r.pass ? "ok" : "FAIL", r.time.c_str(),
                  r.throughput.c_str());
    }
    std::fflush(stdout);
  }

 private:
  std::vector<Row> rows_;
};

struct Env {
  ModelConfig config;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  Report* report = nullptr;
};

// ---------------------------------------------------------------- checks

void CheckWeights(const Env& env) {
  const ModelConfig& c = env.config;
  struct Case {
    TensorSpec spec;
    int64_t first;
    int64_t count;
  };
  const std::vector<Case> cases = {
      {{LayerTensorName(0, "self_attn.q_proj.weight"), WeightKind::kLinear, c.hidden_size},
       12345,
       int64_t{1} << 22},
      {{LayerTensorName(1, "moe.gate.weight"), WeightKind::kRouter, c.hidden_size},
       0,
       c.num_experts * c.hidden_size},
      {{LayerTensorName(0, "input_layernorm.weight"), WeightKind::kNormGamma, 1}, 0, c.hidden_size},
      {{"model.embed_tokens.weight", WeightKind::kEmbedding, 1},
       100000 * c.hidden_size,
       int64_t{1} << 20},
      {{LayerTensorName(1, "moe.down_proj.weight"), WeightKind::kLinear, c.expert_intermediate},
       47 * c.hidden_size * c.expert_intermediate,
       int64_t{1} << 20},
  };
  size_t mismatches = 0;
  int64_t total = 0;
  for (const Case& k : cases) {
    std::vector<float> want(k.count);
    FillTensor(k.spec, c.weight_seed, k.first, k.count, want.data());
    DeviceBuffer<float> got = Alloc<float>(k.count);
    DeviceBuffer<uint16_t> got_bf16 = Alloc<uint16_t>(k.count);
    CUDA_OK(cuda::FillTensor(k.spec, c.weight_seed, k.first, k.count, got.get(), env.stream));
    CUDA_OK(
        cuda::FillTensorBf16(k.spec, c.weight_seed, k.first, k.count, got_bf16.get(), env.stream));
    mismatches += BitMismatches(ToHost(got.get(), k.count), want);
    mismatches += BitMismatches(ToHost(got_bf16.get(), k.count), ToBf16(want));
    total += k.count;
  }
  env.report->Exact("weights fp32+bf16 (5 kinds)", std::to_string(total) + " elems", mismatches);
}

void CheckRmsNorm(const Env& env) {
  const int64_t rows = 128;
  const int64_t dim = env.config.hidden_size;
  const std::vector<float> x = RandomNormal(rows * dim, 1, 3.0f);
  std::vector<float> gamma(dim);
  FillTensor({LayerTensorName(0, "input_layernorm.weight"), WeightKind::kNormGamma, 1},
             env.config.weight_seed, 0, dim, gamma.data());
  std::vector<float> want(rows * dim);
  cpu::RmsNorm(x.data(), gamma.data(), rows, dim, env.config.rms_norm_eps, want.data());
  DeviceBuffer<float> d_x = ToDevice(x);
  DeviceBuffer<float> d_gamma = ToDevice(gamma);
  DeviceBuffer<float> d_y = Alloc<float>(rows * dim);
  CUDA_OK(cuda::RmsNorm(d_x.get(), d_gamma.get(), rows, dim, env.config.rms_norm_eps, d_y.get(),
                        env.stream));
  const std::vector<float> got = ToHost(d_y.get(), rows * dim);
  // In place must give the same bits as out of place.
  CUDA_OK(cuda::RmsNorm(d_x.get(), d_gamma.get(), rows, dim, env.config.rms_norm_eps, d_x.get(),
                        env.stream));
  const size_t in_place_diff = BitMismatches(ToHost(d_x.get(), rows * dim), got);
  const double ms = TimeMs(env.stream, 50, [&] {
    CUDA_OK(cuda::RmsNorm(d_y.get(), d_gamma.get(), rows, dim, env.config.rms_norm_eps, d_y.get(),
                          env.stream));
  });
  const double gbs = 2.0 * rows * dim * 4 / (ms * 1e-3) / 1e9;
  const std::string shape = Format("%.0f x %.0f", rows, dim);
  env.report->Check("rmsnorm", shape, RelL2(got, want), kFp32OrderBound, Format("%.4f", ms),
                    Format("%.0f GB/s", gbs));
  env.report->Exact("rmsnorm in place == out of place", shape, in_place_diff);
}

void CheckRope(const Env& env) {
  const int64_t tokens = 128;
  const int64_t heads = env.config.num_heads;
  const int64_t d = env.config.head_dim;
  std::vector<float> x = RandomNormal(tokens * heads * d, 2);
  std::vector<int32_t> positions(tokens);
  std::mt19937 rng(3);
  for (int32_t& p : positions) p = static_cast<int32_t>(rng() % 65536);
  positions[0] = 0;
  DeviceBuffer<float> d_x = ToDevice(x);
  DeviceBuffer<int32_t> d_pos = ToDevice(positions);
  CUDA_OK(cuda::RopeNeoxInPlace(d_x.get(), tokens, heads, d, d_pos.get(), env.config.rope_theta,
                                env.stream));
  const std::vector<float> got = ToHost(d_x.get(), x.size());
  cpu::RopeNeoxInPlace(x.data(), tokens, heads, d, positions.data(), env.config.rope_theta);
  const size_t differing = BitMismatches(got, x);
  const double ms = TimeMs(env.stream, 50, [&] {
    CUDA_OK(cuda::RopeNeoxInPlace(d_x.get(), tokens, heads, d, d_pos.get(), env.config.rope_theta,
                                  env.stream));
  });
  env.report->Check("rope neox (" + std::to_string(differing) + " elems not bitwise)",
                    Format("%.0f tok x %.0f heads", tokens, heads) + " x 256", RelL2(got, x), 1e-6,
                    Format("%.4f", ms));
}

void CheckRouter(const Env& env) {
  const int64_t experts = env.config.num_experts;
  const int k = env.config.top_k;
  const int64_t tokens = 128;
  std::vector<float> logits = RandomNormal(tokens * experts, 4, 2.0f);
  // Ties: an all-equal row (ids 0, 1, 2), and a row whose top values repeat.
  std::fill(logits.begin(), logits.begin() + experts, 0.5f);
  logits[experts + 40] = 9.0f;
  logits[experts + 7] = 9.0f;
  logits[experts + 30] = 8.0f;
  logits[experts + 12] = 8.0f;
  std::vector<int32_t> want_ids(tokens * k);
  std::vector<float> want_w(tokens * k);
  cpu::RouterSoftmaxTopK(logits.data(), tokens, experts, k, want_ids.data(), want_w.data());
  DeviceBuffer<float> d_logits = ToDevice(logits);
  DeviceBuffer<int32_t> d_ids = Alloc<int32_t>(tokens * k);
  DeviceBuffer<float> d_w = Alloc<float>(tokens * k);
  CUDA_OK(cuda::RouterSoftmaxTopK(d_logits.get(), tokens, experts, k, d_ids.get(), d_w.get(),
                                  env.stream));
  const std::vector<int32_t> ids = ToHost(d_ids.get(), tokens * k);
  const std::vector<float> weights = ToHost(d_w.get(), tokens * k);
  const std::string shape = Format("%.0f tok x %.0f experts", tokens, experts) + " top-3";
  env.report->Exact("router top-k ids (incl. ties)", shape, BitMismatches(ids, want_ids));
  double max_rel = 0.0;
  for (size_t i = 0; i < weights.size(); ++i) {
    max_rel = std::max(max_rel, std::fabs(static_cast<double>(weights[i]) - want_w[i]) /
                                    std::max(1e-30, static_cast<double>(want_w[i])));
  }
  env.report->Check("router weights (max rel, expf ulp)", shape, max_rel, 1e-5);
}

void CheckFp8(const Env& env) {
  const int64_t tokens = 128;
  const int64_t hidden = env.config.hidden_size;
  const int64_t group = env.config.fp8_group;
  std::vector<float> x = RandomNormal(tokens * hidden, 5);
  std::mt19937 rng(6);
  std::uniform_real_distribution<float> exponent(-8.0f, 8.0f);
  for (int64_t g = 0; g < tokens * hidden / group; ++g) {
    const float magnitude = std::exp2(exponent(rng));
    for (int64_t c = 0; c < group; ++c) x[g * group + c] *= magnitude;
  }
  // Specials: an all-zero group, NaN and infinities, exact ties of the E4M3
  // grid (amax 448 so scale 1), subnormal codes and values past 448.
  std::fill(x.begin(), x.begin() + group, 0.0f);
  x[group + 1] = NAN;
  x[2 * group + 2] = INFINITY;
  x[3 * group + 3] = -INFINITY;
  float* tie = x.data() + 4 * group;
  tie[0] = 448.0f;
  const float ties[] = {1.0625f,        1.1875f, 3.0f / 1024.0f, 5.0f / 1024.0f, -0.5f / 512.0f,
                        1.0f / 4096.0f, 240.0f,  232.0f,         -9.5f / 512.0f, 17.0f / 16.0f};
  for (int i = 0; i < 10; ++i) tie[1 + i] = ties[i];
  std::vector<uint8_t> want_codes(tokens * hidden);
  std::vector<float> want_scales(tokens * hidden / group);
  cpu::QuantizeFp8PerGroup(x.data(), tokens, hidden, group, want_codes.data(), want_scales.data());
  std::vector<float> want_x(tokens * hidden);
  cpu::DequantizeFp8PerGroup(want_codes.data(), want_scales.data(), tokens, hidden, group,
                             want_x.data());
  DeviceBuffer<float> d_x = ToDevice(x);
  DeviceBuffer<uint8_t> d_codes = Alloc<uint8_t>(tokens * hidden);
  DeviceBuffer<float> d_scales = Alloc<float>(want_scales.size());
  DeviceBuffer<float> d_back = Alloc<float>(tokens * hidden);
  CUDA_OK(cuda::QuantizeFp8PerGroup(d_x.get(), tokens, hidden, group, d_codes.get(), d_scales.get(),
                                    env.stream));
  CUDA_OK(cuda::DequantizeFp8PerGroup(d_codes.get(), d_scales.get(), tokens, hidden, group,
                                      d_back.get(), env.stream));
  const size_t diff = BitMismatches(ToHost(d_codes.get(), want_codes.size()), want_codes) +
                      BitMismatches(ToHost(d_scales.get(), want_scales.size()), want_scales);
  const size_t back_diff = FloatMismatches(ToHost(d_back.get(), want_x.size()), want_x);
  const std::string shape = Format("%.0f x %.0f", tokens, hidden) + " g128";
  const double q_ms = TimeMs(env.stream, 50, [&] {
    CUDA_OK(cuda::QuantizeFp8PerGroup(d_x.get(), tokens, hidden, group, d_codes.get(),
                                      d_scales.get(), env.stream));
  });
  const double bytes = tokens * hidden * 5.0 + want_scales.size() * 4.0;
  env.report->Exact("fp8 quantise codes+scales", shape, diff, Format("%.4f", q_ms),
                    Format("%.0f GB/s", bytes / (q_ms * 1e-3) / 1e9));
  env.report->Exact("fp8 dequantise", shape, back_diff);

  // Informational: does cuda_fp8.h (NaN mapped to 0 first) agree with the
  // shared codec on every fp32 bit pattern?
  DeviceBuffer<unsigned long long> d_mismatches = Alloc<unsigned long long>(1);
  DeviceBuffer<unsigned int> d_first = Alloc<unsigned int>(1);
  CUDA_OK(cuda::CompareCudaFp8Conversion(0, uint64_t{1} << 32, d_mismatches.get(), d_first.get(),
                                         env.stream));
  const unsigned long long mismatches = ToHost(d_mismatches.get(), 1)[0];
  const unsigned int first = ToHost(d_first.get(), 1)[0];
  char what[64];
  std::snprintf(what, sizeof(what), "%llu diff, first 0x%08X", mismatches, first);
  env.report->Info("cuda_fp8 satfinite vs codec (info)", "all 2^32 fp32", what);
}

void CheckBf16(const Env& env) {
  const int64_t count = int64_t{1} << 20;
  std::vector<float> x = RandomNormal(count, 7, 100.0f);
  std::mt19937 rng(8);
  for (int64_t i = 0; i < count; i += 97) {
    // Exact ties at the bf16 rounding point, both parities, and denormals.
    const uint32_t bits = (static_cast<uint32_t>(rng()) & 0xFFFF0000u) | 0x8000u;
    x[i] = BitsToFloat(bits);
  }
  x[1] = NAN;
  x[2] = INFINITY;
  x[3] = -INFINITY;
  x[4] = BitsToFloat(0x00000001u);
  x[5] = BitsToFloat(0x7F7FFFFFu);  // rounds to infinity
  std::vector<uint16_t> want(count);
  cpu::EncodeBf16Array(x.data(), count, want.data());
  std::vector<float> want_back(count);
  cpu::DecodeBf16Array(want.data(), count, want_back.data());
  DeviceBuffer<float> d_x = ToDevice(x);
  DeviceBuffer<uint16_t> d_bf16 = Alloc<uint16_t>(count);
  DeviceBuffer<float> d_back = Alloc<float>(count);
  CUDA_OK(cuda::EncodeBf16Array(d_x.get(), count, d_bf16.get(), env.stream));
  CUDA_OK(cuda::DecodeBf16Array(d_bf16.get(), count, d_back.get(), env.stream));
  const std::string shape = std::to_string(count) + " elems";
  env.report->Exact("bf16 encode", shape, BitMismatches(ToHost(d_bf16.get(), count), want));
  env.report->Exact("bf16 decode", shape, BitMismatches(ToHost(d_back.get(), count), want_back));

  // The F2A reduction of three partials of one 128-token micro-batch.
  const int64_t n = 128 * env.config.hidden_size;
  std::vector<std::vector<uint16_t>> partials;
  std::vector<DeviceBuffer<uint16_t>> d_partials;
  std::vector<const uint16_t*> host_ptrs;
  std::vector<const uint16_t*> device_ptrs;
  for (int p = 0; p < 3; ++p) {
    partials.push_back(ToBf16(RandomNormal(n, 20 + p)));
    d_partials.push_back(ToDevice(partials.back()));
    host_ptrs.push_back(partials.back().data());
    device_ptrs.push_back(d_partials.back().get());
  }
  std::vector<float> want_sum(n);
  cpu::SumBf16Partials(host_ptrs.data(), 3, n, want_sum.data());
  DeviceBuffer<const uint16_t*> d_ptrs = ToDevice(device_ptrs);
  DeviceBuffer<float> d_sum = Alloc<float>(n);
  CUDA_OK(cuda::SumBf16Partials(d_ptrs.get(), 3, n, d_sum.get(), env.stream));
  env.report->Exact("bf16 partial sum (3 partials)", "128 x 7168",
                    BitMismatches(ToHost(d_sum.get(), n), want_sum));
}

void CheckSiluMul(const Env& env) {
  const int64_t count = 128 * env.config.expert_intermediate;
  const std::vector<float> gate = RandomNormal(count, 9, 3.0f);
  const std::vector<float> up = RandomNormal(count, 10);
  std::vector<float> want(count);
  cpu::SiluMul(gate.data(), up.data(), count, want.data());
  DeviceBuffer<float> d_gate = ToDevice(gate);
  DeviceBuffer<float> d_up = ToDevice(up);
  DeviceBuffer<float> d_out = Alloc<float>(count);
  CUDA_OK(cuda::SiluMul(d_gate.get(), d_up.get(), count, d_out.get(), env.stream));
  env.report->Check("silu * up", "128 x 5120", RelL2(ToHost(d_out.get(), count), want), 1e-6);
}

// The device engine's own kernels: greedy argmax (ties to the lower index,
// as the CPU) and the KV-cache append.
void CheckEngineKernels(const Env& env) {
  const int64_t rows = 64;
  const int64_t vocab = env.config.vocab_size;  // 128815: odd, not a multiple of the block
  std::vector<float> logits = RandomNormal(rows * vocab, 21, 2.0f);
  // Ties: row 1's maximum appears at two columns, row 2's at the last one.
  logits[1 * vocab + 17] = logits[1 * vocab + 90000] = 50.0f;
  logits[2 * vocab + vocab - 1] = 60.0f;
  std::vector<int32_t> want(rows);
  cpu::ArgmaxRows(logits.data(), rows, vocab, want.data());
  DeviceBuffer<float> d_logits = ToDevice(logits);
  DeviceBuffer<int32_t> d_ids = Alloc<int32_t>(rows);
  CUDA_OK(cuda::ArgmaxRows(d_logits.get(), rows, vocab, d_ids.get(), env.stream));
  const std::vector<int32_t> got = ToHost(d_ids.get(), rows);
  size_t mismatches = 0;
  for (int64_t r = 0; r < rows; ++r) mismatches += got[r] == want[r] ? 0 : 1;
  env.report->Exact("argmax rows (ties to lower id)", "64 x 128815", mismatches);

  const int64_t width = env.config.head_dim;
  const int64_t n = 96;
  const std::vector<float> src = RandomNormal(n * width, 22);
  std::vector<int32_t> index(n);
  for (int64_t r = 0; r < n; ++r) index[r] = static_cast<int32_t>((r * 37) % 200 + 5);
  std::vector<float> cache(256 * width, 0.0f);
  for (int64_t r = 0; r < n; ++r) {
    std::copy(src.begin() + r * width, src.begin() + (r + 1) * width,
              cache.begin() + int64_t{index[r]} * width);
  }
  DeviceBuffer<float> d_src = ToDevice(src);
  DeviceBuffer<int32_t> d_index = ToDevice(index);
  DeviceBuffer<float> d_cache = ToDevice(std::vector<float>(256 * width, 0.0f));
  CUDA_OK(cuda::ScatterRows(d_src.get(), n, width, d_index.get(), d_cache.get(), env.stream));
  env.report->Exact("scatter rows (kv append)", "96 rows of 256",
                    BitMismatches(ToHost(d_cache.get(), cache.size()), cache));
}

void CheckPrefillAttention(const Env& env) {
  const int64_t t = 256;
  const int64_t heads = env.config.num_heads;
  const int64_t d = env.config.head_dim;
  const float scale = env.config.attention_scale();
  const std::vector<float> q = RandomNormal(t * heads * d, 11);
  const std::vector<float> k = RandomNormal(t * d, 12);
  const std::vector<float> v = RandomNormal(t * d, 13);
  std::vector<int32_t> positions(t);
  for (int64_t i = 0; i < t; ++i) positions[i] = static_cast<int32_t>(i);
  std::vector<float> want(t * heads * d);
  cpu::MqaAttention(q.data(), t, heads, d, k.data(), v.data(), t, positions.data(), scale,
                    want.data());
  DeviceBuffer<float> d_q = ToDevice(q);
  DeviceBuffer<float> d_k = ToDevice(k);
  DeviceBuffer<float> d_v = ToDevice(v);
  DeviceBuffer<int32_t> d_pos = ToDevice(positions);
  DeviceBuffer<float> d_out = Alloc<float>(want.size());
  auto run = [&] {
    CUDA_OK(cuda::MqaAttention(d_q.get(), t, heads, d, d_k.get(), d_v.get(), t, d_pos.get(), scale,
                               d_out.get(), env.stream));
  };
  run();
  const std::vector<float> got = ToHost(d_out.get(), want.size());
  const double ms = TimeMs(env.stream, 10, run);
  env.report->Check("prefill attention (fp32, causal)", "T=256, 64 x 256", RelL2(got, want),
                    kFp32OrderBound, Format("%.4f", ms));

  // A negative position sees no row: zeros on both sides, never NaN.
  std::vector<int32_t> negative = positions;
  negative[0] = -1;
  negative[5] = -7;
  std::vector<float> want_negative(want.size());
  cpu::MqaAttention(q.data(), t, heads, d, k.data(), v.data(), t, negative.data(), scale,
                    want_negative.data());
  DeviceBuffer<int32_t> d_negative = ToDevice(negative);
  CUDA_OK(cudaMemsetAsync(d_out.get(), 0xFF, d_out.bytes(), env.stream));
  CUDA_OK(cuda::MqaAttention(d_q.get(), t, heads, d, d_k.get(), d_v.get(), t, d_negative.get(),
                             scale, d_out.get(), env.stream));
  const std::vector<float> got_negative = ToHost(d_out.get(), want.size());
  env.report->Exact("prefill attention, negative positions: finite", "T=256",
                    NonFinite(got_negative));
  env.report->Check("prefill attention, negative positions vs cpu", "T=256",
                    RelL2(got_negative, want_negative), kFp32OrderBound);
}

void CheckDecodeAttention(const Env& env) {
  const int64_t heads = env.config.num_heads;
  const int64_t d = env.config.head_dim;
  const float scale = env.config.attention_scale();
  // Lengths around the tile (32) and split (256) boundaries, down to 1.
  const std::vector<int32_t> lens = {4096, 4000, 3333, 2049, 1024, 777,  256,  255,
                                     100,  33,   32,   17,   1,    1500, 2500, 3900};
  const int64_t batch = static_cast<int64_t>(lens.size());
  const int64_t stride = 4096;
  const std::vector<float> q = RandomNormal(batch * heads * d, 14);
  const std::vector<float> k = RandomNormal(batch * stride * d, 15);
  const std::vector<float> v = RandomNormal(batch * stride * d, 16);
  std::vector<float> want(batch * heads * d);
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t position = lens[b] - 1;
    cpu::MqaAttention(q.data() + b * heads * d, 1, heads, d, k.data() + b * stride * d,
                      v.data() + b * stride * d, lens[b], &position, scale,
                      want.data() + b * heads * d);
  }
  DeviceBuffer<float> d_q = ToDevice(q);
  DeviceBuffer<float> d_k = ToDevice(k);
  DeviceBuffer<float> d_v = ToDevice(v);
  DeviceBuffer<int32_t> d_lens = ToDevice(lens);
  DeviceBuffer<float> d_out = Alloc<float>(want.size());
  const size_t ws_bytes = cuda::MqaDecodeWorkspaceBytes(batch, heads, d, stride);
  DeviceBuffer<unsigned char> d_ws = Alloc<unsigned char>(ws_bytes);
  CUDA_OK(cuda::MqaDecodeAttention(d_q.get(), batch, heads, d, d_k.get(), d_v.get(), stride,
                                   d_lens.get(), stride, scale, d_out.get(), d_ws.get(), ws_bytes,
                                   env.stream));
  env.report->Check("decode attention (tf32) vs cpu", "16 seqs, kv 1..4096",
                    RelL2(ToHost(d_out.get(), want.size()), want), kTensorCoreBound);

  {
    // Out-of-contract lengths: 0 and negative give zeros (not 0/0 = NaN);
    // above max_kv_len (here 300, 2 splits) is clamped to it in both kernels
    // (the merge once read past the workspace of its sequence). A poisoned
    // output shows that every element is written.
    const std::vector<int32_t> edge_lens = {0, 5000, -3, 300, 1};
    const int64_t edge_batch = static_cast<int64_t>(edge_lens.size());
    const int64_t max_kv = 300;
    std::vector<float> edge_want(edge_batch * heads * d, 0.0f);
    for (int64_t b = 0; b < edge_batch; ++b) {
      const int32_t len = std::clamp<int32_t>(edge_lens[b], 0, static_cast<int32_t>(max_kv));
      const int32_t position = len - 1;
      cpu::MqaAttention(q.data() + b * heads * d, 1, heads, d, k.data() + b * stride * d,
                        v.data() + b * stride * d, len, &position, scale,
                        edge_want.data() + b * heads * d);
    }
    DeviceBuffer<int32_t> d_edge = ToDevice(edge_lens);
    const size_t edge_ws_bytes = cuda::MqaDecodeWorkspaceBytes(edge_batch, heads, d, max_kv);
    DeviceBuffer<unsigned char> d_edge_ws = Alloc<unsigned char>(edge_ws_bytes);
    CUDA_OK(cudaMemsetAsync(d_out.get(), 0xFF, d_out.bytes(), env.stream));  // NaNs
    CUDA_OK(cuda::MqaDecodeAttention(d_q.get(), edge_batch, heads, d, d_k.get(), d_v.get(), stride,
                                     d_edge.get(), max_kv, scale, d_out.get(), d_edge_ws.get(),
                                     edge_ws_bytes, env.stream));
    const std::vector<float> edge_got = ToHost(d_out.get(), edge_want.size());
    env.report->Exact("decode attention kv_len 0 / < 0: finite", "5 seqs", NonFinite(edge_got));
    env.report->Check("decode attention kv_len 0, >max, <0 vs cpu", "5 seqs, max kv 300",
                      RelL2(edge_got, edge_want), kTensorCoreBound);
  }

  // Bandwidth: uniform batches, KV several times the L2.
  struct Shape {
    int64_t batch;
    int64_t kv;
  };
  for (const Shape& s : {Shape{64, 4096}, Shape{128, 2048}, Shape{16, 16384}}) {
    DeviceBuffer<float> t_q = Alloc<float>(s.batch * heads * d);
    DeviceBuffer<float> t_k = Alloc<float>(s.batch * s.kv * d);
    DeviceBuffer<float> t_v = Alloc<float>(s.batch * s.kv * d);
    DeviceBuffer<float> t_out = Alloc<float>(s.batch * heads * d);
    const std::vector<int32_t> t_lens_host(s.batch, static_cast<int32_t>(s.kv));
    DeviceBuffer<int32_t> t_lens = ToDevice(t_lens_host);
    CUDA_OK(cudaMemsetAsync(t_q.get(), 0, t_q.bytes(), env.stream));
    // Small random-ish values via the weight generator (no host copy).
    CUDA_OK(cuda::GenerateWeights(WeightKind::kEmbedding, 1, 1, 0, s.batch * s.kv * d, t_k.get(),
                                  env.stream));
    CUDA_OK(cuda::GenerateWeights(WeightKind::kEmbedding, 2, 1, 0, s.batch * s.kv * d, t_v.get(),
                                  env.stream));
    CUDA_OK(cuda::GenerateWeights(WeightKind::kEmbedding, 3, 1, 0, s.batch * heads * d, t_q.get(),
                                  env.stream));
    const size_t t_ws_bytes = cuda::MqaDecodeWorkspaceBytes(s.batch, heads, d, s.kv);
    DeviceBuffer<unsigned char> t_ws = Alloc<unsigned char>(t_ws_bytes);
    const double ms = TimeMs(env.stream, 20, [&] {
      CUDA_OK(cuda::MqaDecodeAttention(t_q.get(), s.batch, heads, d, t_k.get(), t_v.get(), s.kv,
                                       t_lens.get(), s.kv, scale, t_out.get(), t_ws.get(),
                                       t_ws_bytes, env.stream));
    });
    // Counted: K and V once, Q and the output (the split partials are extra
    // traffic of the algorithm, not counted).
    const double bytes = 2.0 * s.batch * s.kv * d * 4 + 2.0 * s.batch * heads * d * 4;
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    env.report->Info("decode attention bandwidth",
                     Format("b=%.0f kv=%.0f", s.batch, s.kv) + " fp32 KV",
                     Format("%.2f GB KV", bytes / 1e9), Format("%.4f", ms),
                     Format("%.0f GB/s = %.1f%% HBM", gbs, 100.0 * gbs / kHbmGBs));
  }
}

// Host fp32 weights of a linear [out, in] and its bf16 twin on the device.
struct LinearWeights {
  std::vector<float> host;
  DeviceBuffer<uint16_t> device;
};

LinearWeights MakeLinear(const Env& env, const std::string& name, int64_t out, int64_t in) {
  const TensorSpec spec{name, WeightKind::kLinear, in};
  LinearWeights w;
  w.host.resize(out * in);
  FillTensor(spec, env.config.weight_seed, 0, out * in, w.host.data());
  w.device = Alloc<uint16_t>(out * in);
  CUDA_OK(
      cuda::FillTensorBf16(spec, env.config.weight_seed, 0, out * in, w.device.get(), env.stream));
  return w;
}

void CheckLinearAndSwiGlu(const Env& env) {
  const int64_t hidden = env.config.hidden_size;
  const int64_t inter = env.config.shared_intermediate;
  const int64_t q_rank = env.config.q_rank;
  const cuda::GemmOptions tiled;
  const cuda::GemmOptions cublas{cuda::GemmBackend::kCublas, env.cublas};

  {  // q_proj-like linear, 128 tokens.
    const int64_t rows = 128;
    const LinearWeights w =
        MakeLinear(env, LayerTensorName(0, "self_attn.q_proj.weight"), q_rank, hidden);
    const std::vector<float> x = RandomNormal(rows * hidden, 30);
    std::vector<float> want(rows * q_rank);
    cpu::Linear(x.data(), rows, hidden, w.host.data(), q_rank, want.data());
    DeviceBuffer<float> d_x = ToDevice(x);
    DeviceBuffer<float> d_y = Alloc<float>(rows * q_rank);
    DeviceBuffer<float> d_y_ref = Alloc<float>(rows * q_rank);
    const size_t ws = cuda::LinearWorkspaceBytes(rows, hidden, q_rank);
    DeviceBuffer<unsigned char> d_ws = Alloc<unsigned char>(ws);
    CUDA_OK(cuda::Linear(d_x.get(), rows, hidden, w.device.get(), q_rank, d_y.get(), d_ws.get(), ws,
                         env.stream, tiled));
    CUDA_OK(cuda::Linear(d_x.get(), rows, hidden, w.device.get(), q_rank, d_y_ref.get(), d_ws.get(),
                         ws, env.stream, cublas));
    const std::vector<float> got = ToHost(d_y.get(), want.size());
    const std::vector<float> ref = ToHost(d_y_ref.get(), want.size());
    env.report->Check("linear bf16 tiled vs cpu", "128 x 7168 -> 2048", RelL2(got, want),
                      kTensorCoreBound);
    env.report->Check("linear bf16 tiled vs cublas", "128 x 7168 -> 2048", RelL2(got, ref), 1e-5);
  }

  {  // Shared-expert-sized SwiGLU, 64 tokens.
    const int64_t rows = 64;
    const LinearWeights gate =
        MakeLinear(env, LayerTensorName(1, "moe.share_expert.gate_proj.weight"), inter, hidden);
    const LinearWeights up =
        MakeLinear(env, LayerTensorName(1, "moe.share_expert.up_proj.weight"), inter, hidden);
    const LinearWeights down =
        MakeLinear(env, LayerTensorName(1, "moe.share_expert.down_proj.weight"), hidden, inter);
    const std::vector<float> x = RandomNormal(rows * hidden, 31);
    std::vector<float> want(rows * hidden);
    std::vector<float> scratch(cpu::SwiGluScratchFloats(rows, inter));
    cpu::SwiGlu(x.data(), rows, hidden, gate.host.data(), up.host.data(), down.host.data(), inter,
                scratch.data(), want.data());
    DeviceBuffer<float> d_x = ToDevice(x);
    DeviceBuffer<float> d_y = Alloc<float>(rows * hidden);
    DeviceBuffer<float> d_y_ref = Alloc<float>(rows * hidden);
    const size_t ws = cuda::SwiGluWorkspaceBytes(rows, hidden, inter);
    DeviceBuffer<unsigned char> d_ws = Alloc<unsigned char>(ws);
    auto run = [&](const cuda::GemmOptions& options, float* y) {
      CUDA_OK(cuda::SwiGlu(d_x.get(), rows, hidden, gate.device.get(), up.device.get(),
                           down.device.get(), inter, d_ws.get(), ws, y, env.stream, options));
    };
    run(tiled, d_y.get());
    run(cublas, d_y_ref.get());
    const std::vector<float> got = ToHost(d_y.get(), want.size());
    const std::vector<float> ref = ToHost(d_y_ref.get(), want.size());
    const double flops = 2.0 * rows * 3 * hidden * inter;
    const double ms = TimeMs(env.stream, 10, [&] { run(tiled, d_y.get()); });
    const double ms_ref = TimeMs(env.stream, 10, [&] { run(cublas, d_y_ref.get()); });
    env.report->Check("swiglu bf16 tiled vs cpu", "64 x 7168, inter 5120", RelL2(got, want),
                      kTensorCoreBound, Format("%.4f", ms),
                      Format("%.1f TFLOP/s", flops / (ms * 1e-3) / 1e12));
    env.report->Check("swiglu bf16 cublas vs cpu", "64 x 7168, inter 5120", RelL2(ref, want),
                      kTensorCoreBound, Format("%.4f", ms_ref),
                      Format("%.1f TFLOP/s", flops / (ms_ref * 1e-3) / 1e12));
    env.report->Check("swiglu tiled vs cublas", "64 x 7168, inter 5120", RelL2(got, ref), 1e-3);
  }

  {  // A compute-bound GEMM: dense-FFN gate shape, 4096 tokens. Timing only.
    const int64_t rows = 4096;
    const int64_t out = env.config.dense_intermediate;
    DeviceBuffer<uint16_t> w = Alloc<uint16_t>(out * hidden);
    CUDA_OK(cuda::FillTensorBf16(
        {LayerTensorName(0, "mlp.gate_proj.weight"), WeightKind::kLinear, hidden},
        env.config.weight_seed, 0, out * hidden, w.get(), env.stream));
    DeviceBuffer<float> x = Alloc<float>(rows * hidden);
    CUDA_OK(
        cuda::GenerateWeights(WeightKind::kEmbedding, 5, 1, 0, rows * hidden, x.get(), env.stream));
    DeviceBuffer<float> y = Alloc<float>(rows * out);
    const size_t ws = cuda::LinearWorkspaceBytes(rows, hidden, out);
    DeviceBuffer<unsigned char> d_ws = Alloc<unsigned char>(ws);
    const double flops = 2.0 * rows * hidden * out;
    for (const auto* options : {&tiled, &cublas}) {
      const double ms = TimeMs(env.stream, 10, [&] {
        CUDA_OK(cuda::Linear(x.get(), rows, hidden, w.get(), out, y.get(), d_ws.get(), ws,
                             env.stream, *options));
      });
      env.report->Info(options == &tiled ? "gemm bf16 tiled (timing)" : "gemm bf16 cublas (timing)",
                       "4096 x 7168 -> 18432", "incl. fp32->bf16 of x", Format("%.4f", ms),
                       Format("%.1f TFLOP/s", flops / (ms * 1e-3) / 1e12));
    }
  }
}

void CheckExperts(const Env& env) {
  const ModelConfig& c = env.config;
  const int64_t hidden = c.hidden_size;
  const int64_t inter = c.expert_intermediate;
  const int64_t experts = c.num_experts;
  const int k = c.top_k;
  const int64_t matrix = inter * hidden;
  const TensorSpec gate_spec{LayerTensorName(1, "moe.gate_proj.weight"), WeightKind::kLinear,
                             hidden};
  const TensorSpec up_spec{LayerTensorName(1, "moe.up_proj.weight"), WeightKind::kLinear, hidden};
  const TensorSpec down_spec{LayerTensorName(1, "moe.down_proj.weight"), WeightKind::kLinear,
                             inter};
  // All 48 experts on the device as bf16 (3 x 3.5 GB), generated in place.
  DeviceBuffer<uint16_t> w_gate = Alloc<uint16_t>(experts * matrix);
  DeviceBuffer<uint16_t> w_up = Alloc<uint16_t>(experts * matrix);
  DeviceBuffer<uint16_t> w_down = Alloc<uint16_t>(experts * matrix);
  CUDA_OK(cuda::FillTensorBf16(gate_spec, c.weight_seed, 0, experts * matrix, w_gate.get(),
                               env.stream));
  CUDA_OK(
      cuda::FillTensorBf16(up_spec, c.weight_seed, 0, experts * matrix, w_up.get(), env.stream));
  CUDA_OK(cuda::FillTensorBf16(down_spec, c.weight_seed, 0, experts * matrix, w_down.get(),
                               env.stream));
  std::vector<int32_t> identity(experts);
  for (int64_t e = 0; e < experts; ++e) identity[e] = static_cast<int32_t>(e);
  DeviceBuffer<int32_t> d_slots = ToDevice(identity);
  const cuda::GemmOptions tiled;
  const cuda::GemmOptions cublas{cuda::GemmBackend::kCublas, env.cublas};

  // The FFN side's input: dequantised FP8 of a random y, routed by the CPU.
  auto make_inputs = [&](int64_t tokens, uint64_t seed, std::vector<float>* x,
                         std::vector<int32_t>* ids, std::vector<float>* weights) {
    const std::vector<float> y = RandomNormal(tokens * hidden, seed);
    std::vector<uint8_t> codes(tokens * hidden);
    std::vector<float> scales(tokens * hidden / c.fp8_group);
    cpu::QuantizeFp8PerGroup(y.data(), tokens, hidden, c.fp8_group, codes.data(), scales.data());
    x->resize(tokens * hidden);
    cpu::DequantizeFp8PerGroup(codes.data(), scales.data(), tokens, hidden, c.fp8_group, x->data());
    const std::vector<float> logits = RandomNormal(tokens * experts, seed + 1, 2.0f);
    ids->resize(tokens * k);
    weights->resize(tokens * k);
    cpu::RouterSoftmaxTopK(logits.data(), tokens, experts, k, ids->data(), weights->data());
  };

  {  // Correctness, 64 tokens, against the CPU kernel.
    const int64_t tokens = 64;
    std::vector<float> x;
    std::vector<int32_t> ids;
    std::vector<float> weights;
    make_inputs(tokens, 40, &x, &ids, &weights);
    const std::vector<float> y0 = RandomNormal(tokens * hidden, 42, 0.01f);
    // CPU: one expert per task (its own fp32 weights, slot 0, a zero y),
    // then the contributions are added in expert order, which is exactly
    // the order of the single-call CPU kernel: y0 + c_e1 + c_e2 + ...
    std::vector<std::vector<float>> contribution(experts);
    const int threads =
        static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1u, 16u));
    std::vector<std::thread> pool;
    for (int w = 0; w < threads; ++w) {
      pool.emplace_back([&, w] {
        std::vector<float> g(matrix), u(matrix), d(matrix);
        std::vector<float> scratch(cpu::GroupedExpertScratchFloats(tokens, hidden, inter));
        for (int64_t e = w; e < experts; e += threads) {
          std::vector<int32_t> to_slot(experts, -1);
          to_slot[e] = 0;
          bool used = false;
          for (int32_t id : ids) used |= id == e;
          if (!used) continue;
          FillTensor(gate_spec, c.weight_seed, e * matrix, matrix, g.data());
          FillTensor(up_spec, c.weight_seed, e * matrix, matrix, u.data());
          FillTensor(down_spec, c.weight_seed, e * matrix, matrix, d.data());
          contribution[e].assign(tokens * hidden, 0.0f);
          cpu::GroupedExpertSwiGlu(x.data(), tokens, hidden, ids.data(), weights.data(), k,
                                   to_slot.data(), experts, 1, g.data(), u.data(), d.data(), inter,
                                   scratch.data(), contribution[e].data());
        }
      });
    }
    for (std::thread& t : pool) t.join();
    std::vector<float> want = y0;
    for (int64_t e = 0; e < experts; ++e) {
      if (contribution[e].empty()) continue;
      cpu::AddInPlace(contribution[e].data(), tokens * hidden, want.data());
    }

    DeviceBuffer<float> d_x = ToDevice(x);
    DeviceBuffer<int32_t> d_ids = ToDevice(ids);
    DeviceBuffer<float> d_w = ToDevice(weights);
    DeviceBuffer<float> d_y = ToDevice(y0);
    DeviceBuffer<float> d_y_ref = ToDevice(y0);
    const size_t ws = cuda::GroupedExpertWorkspaceBytes(tokens, k, hidden, inter, experts);
    DeviceBuffer<unsigned char> d_ws = Alloc<unsigned char>(ws);
    CUDA_OK(cuda::GroupedExpertSwiGlu(d_x.get(), tokens, hidden, d_ids.get(), d_w.get(), k,
                                      d_slots.get(), experts, experts, w_gate.get(), w_up.get(),
                                      w_down.get(), inter, d_ws.get(), ws, d_y.get(), env.stream,
                                      tiled));
    CUDA_OK(cuda::GroupedExpertSwiGlu(d_x.get(), tokens, hidden, d_ids.get(), d_w.get(), k,
                                      d_slots.get(), experts, experts, w_gate.get(), w_up.get(),
                                      w_down.get(), inter, d_ws.get(), ws, d_y_ref.get(),
                                      env.stream, cublas));
    // Compare the FFN contributions (y - y0), not y, so y0 cannot hide errors.
    auto delta = [&](const std::vector<float>& y) {
      std::vector<float> out(y.size());
      for (size_t i = 0; i < y.size(); ++i) out[i] = y[i] - y0[i];
      return out;
    };
    const std::vector<float> got = delta(ToHost(d_y.get(), y0.size()));
    const std::vector<float> ref = delta(ToHost(d_y_ref.get(), y0.size()));
    const std::vector<float> cpu_delta = delta(want);
    const std::string shape = "64 tok, 48 x 5120, top-3";
    env.report->Check("experts tiled vs cpu", shape, RelL2(got, cpu_delta), kTensorCoreBound);
    env.report->Check("experts cublas vs cpu", shape, RelL2(ref, cpu_delta), kTensorCoreBound);
    env.report->Check("experts tiled vs cublas", shape, RelL2(got, ref), 1e-3);
  }

  for (const int64_t tokens : {int64_t{128}, int64_t{2048}}) {  // Timing.
    std::vector<float> x;
    std::vector<int32_t> ids;
    std::vector<float> weights;
    make_inputs(tokens, 50 + tokens, &x, &ids, &weights);
    DeviceBuffer<float> d_x = ToDevice(x);
    DeviceBuffer<int32_t> d_ids = ToDevice(ids);
    DeviceBuffer<float> d_w = ToDevice(weights);
    DeviceBuffer<float> d_y = Alloc<float>(tokens * hidden);
    CUDA_OK(cudaMemsetAsync(d_y.get(), 0, d_y.bytes(), env.stream));
    const size_t ws = cuda::GroupedExpertWorkspaceBytes(tokens, k, hidden, inter, experts);
    DeviceBuffer<unsigned char> d_ws = Alloc<unsigned char>(ws);
    std::vector<char> used(experts, 0);
    for (int32_t id : ids) used[id] = 1;
    const double used_experts = static_cast<double>(std::count(used.begin(), used.end(), 1));
    const double flops = 2.0 * tokens * k * 3 * hidden * inter;
    const double weight_bytes = used_experts * 3 * matrix * 2;
    for (const auto* options : {&tiled, &cublas}) {
      const double ms = TimeMs(env.stream, 5, [&] {
        CUDA_OK(cuda::GroupedExpertSwiGlu(d_x.get(), tokens, hidden, d_ids.get(), d_w.get(), k,
                                          d_slots.get(), experts, experts, w_gate.get(), w_up.get(),
                                          w_down.get(), inter, d_ws.get(), ws, d_y.get(),
                                          env.stream, *options));
      });
      env.report->Info(
          options == &tiled ? "experts tiled (timing)" : "experts cublas (timing, 1 sync)",
          std::to_string(tokens) + " tok, 48 x 5120, top-3",
          Format("%.0f experts used", used_experts), Format("%.3f", ms),
          Format("%.1f TFLOP/s, %.0f GB/s weights", flops / (ms * 1e-3) / 1e12,
                 weight_bytes / (ms * 1e-3) / 1e9));
    }
  }
}

int Main() {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("model_gpu_tests: no CUDA device (%s), skipping\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
    return 77;
  }
  cudaDeviceProp properties{};
  CUDA_OK(cudaGetDeviceProperties(&properties, 0));
  std::printf(
      "device: %s, %d SMs, %.1f GiB, cc %d.%d\n", properties.name, properties.multiProcessorCount,
      properties.totalGlobalMem / (1024.0 * 1024.0 * 1024.0), properties.major, properties.minor);

  std::string error;
  const std::optional<ModelConfig> config = LoadModelConfig("full", BundledConfigDir(), &error);
  if (!config) {
    std::fprintf(stderr, "cannot load the full-width config: %s\n", error.c_str());
    return 1;
  }
  cuda::Stream stream;
  CUDA_OK(stream.status());
  cuda::CublasHandle cublas;
  if (cublas.status() != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cublasCreate failed: %d\n", static_cast<int>(cublas.status()));
    return 1;
  }
  Report report;
  Env env{*config, stream.get(), cublas.get(), &report};

  const std::vector<std::pair<const char*, void (*)(const Env&)>> checks = {
      {"weights", CheckWeights},
      {"rmsnorm", CheckRmsNorm},
      {"rope", CheckRope},
      {"router", CheckRouter},
      {"fp8", CheckFp8},
      {"bf16", CheckBf16},
      {"silu", CheckSiluMul},
      {"engine kernels", CheckEngineKernels},
      {"prefill attention", CheckPrefillAttention},
      {"decode attention", CheckDecodeAttention},
      {"linear/swiglu", CheckLinearAndSwiGlu},
      {"experts", CheckExperts},
  };
  for (const auto& [name, check] : checks) {
    std::printf("running %s ...\n", name);
    std::fflush(stdout);
    try {
      check(env);
    } catch (const std::exception& e) {
      report.Error(name, e.what());
      // A sticky error (e.g. an illegal address) poisons the context: the
      // remaining checks would only repeat it.
      if (cudaDeviceSynchronize() != cudaSuccess) break;
    }
  }
  report.Print();
  const bool passed = report.AllPassed();
  std::printf("\nmodel_gpu_tests: %s\n", passed ? "PASSED" : "FAILED");
  return passed ? 0 : 1;
}

}  // namespace
}  // namespace afd

int main() {
  try {
    return afd::Main();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "model_gpu_tests: %s\n", e.what());
    return 1;
  }
}
