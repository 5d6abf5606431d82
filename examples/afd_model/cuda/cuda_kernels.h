#pragma once

// CUDA kernels of the Step-3 example model, mirroring kernels/cpu_kernels.h
// entry point by entry point (docs/model.md, "CUDA kernels").
//
// Conventions, on top of the CPU ones (row-major, [out, in] weights, int64_t
// sizes):
//  - Every pointer is a device pointer unless the comment says "host".
//  - Every function enqueues its work on `stream` and returns the launch
//    status (cudaGetLastError after the launch, or the first failing CUDA /
//    cuBLAS call). Nothing synchronises the stream except the cuBLAS expert
//    path, which needs the per-expert token counts on the host.
//  - Linear/expert weights are bf16 bit patterns (uint16_t). The generated
//    weights are bf16-exact (weights.h), so this loses nothing against the
//    CPU's fp32 copy; activations are rounded to bf16 at the GEMM input and
//    the products are accumulated in fp32 (docs/step3 §3.5: "bf16 GEMMs add
//    ~3e-3 relative noise").
//  - Codecs, routing and weight generation are bit-identical to the CPU.
//    Reductions (RMSNorm, attention) sum in a different order, so they match
//    to fp32 rounding, not bitwise.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/weights.h"

namespace afd::cuda {

// ---------------------------------------------------------------- basics

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * gamma. May run in place (y == x).
cudaError_t RmsNorm(const float* x, const float* gamma, int64_t rows, int64_t dim, float eps,
                    float* y, cudaStream_t stream);

// out[t] = table[ids[t]], rows of `hidden` floats.
cudaError_t EmbeddingLookup(const float* table, const int32_t* ids, int64_t tokens, int64_t hidden,
                            float* out, cudaStream_t stream);

// acc[i] += x[i].
cudaError_t AddInPlace(const float* x, int64_t count, float* acc, cudaStream_t stream);

// ---------------------------------------------------------------- weights

// Elements [first, first + count) of a generated tensor (weights.h), as fp32
// or as bf16 bit patterns (exact: every generated value is bf16-exact).
// `key` is TensorKey(name, seed), computed on the host.
cudaError_t GenerateWeights(WeightKind kind, uint64_t key, int64_t fan_in, int64_t first,
                            int64_t count, float* out, cudaStream_t stream);
cudaError_t GenerateWeightsBf16(WeightKind kind, uint64_t key, int64_t fan_in, int64_t first,
                                int64_t count, uint16_t* out, cudaStream_t stream);
// Same, by tensor spec (the key is hashed here, on the host).
cudaError_t FillTensor(const TensorSpec& spec, uint64_t seed, int64_t first, int64_t count,
                       float* out, cudaStream_t stream);
cudaError_t FillTensorBf16(const TensorSpec& spec, uint64_t seed, int64_t first, int64_t count,
                           uint16_t* out, cudaStream_t stream);

// ---------------------------------------------------------------- attention

// NeoX RoPE in place, x [tokens, heads, head_dim]; angles in double as on the
// CPU. head_dim must be even.
cudaError_t RopeNeoxInPlace(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                            const int32_t* positions, float theta, cudaStream_t stream);

// The CPU MqaAttention, one sequence, any causal pattern (prefill, or a
// single query). Plain fp32 (CUDA cores), one warp per (query, head) with an
// online softmax. head_dim must be 64, 128 or 256. A query that sees no row
// (negative position, kv_len 0) gets zeros, as on the CPU.
cudaError_t MqaAttention(const float* q, int64_t queries, int64_t heads, int64_t head_dim,
                         const float* k, const float* v, int64_t kv_len,
                         const int32_t* query_positions, float scale, float* out,
                         cudaStream_t stream);

// Batched MFA decode: one new query per sequence, attending to the whole
// cache of its sequence (query position kv_lens[b] - 1, i.e. the CPU
// MqaAttention with queries = 1 per sequence).
//   q       [batch, heads, head_dim]
//   k_cache, v_cache: sequence b's rows start at b * cache_stride_rows, each
//           row head_dim floats.
//   kv_lens [batch] (device), each in [1, max_kv_len]. Outside that range
//           a length is clamped to [0, max_kv_len] (the workspace holds no
//           more), and a sequence of length 0 gets zeros.
//   out     [batch, heads, head_dim]
// Flash-decoding: a block per (sequence, split of kMqaDecodeSplitTokens
// tokens) reads each K and V row once and computes all heads from it with
// TF32 tensor cores, then a second kernel merges the splits. heads <= 64,
// head_dim 64, 128 or 256.
inline constexpr int64_t kMqaDecodeSplitTokens = 256;
size_t MqaDecodeWorkspaceBytes(int64_t batch, int64_t heads, int64_t head_dim, int64_t max_kv_len);
cudaError_t MqaDecodeAttention(const float* q, int64_t batch, int64_t heads, int64_t head_dim,
                               const float* k_cache, const float* v_cache,
                               int64_t cache_stride_rows, const int32_t* kv_lens,
                               int64_t max_kv_len, float scale, float* out, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream);

// ---------------------------------------------------------------- FFN

// silu(gate) * up, elementwise. May run in place.
cudaError_t SiluMul(const float* gate, const float* up, int64_t count, float* out,
                    cudaStream_t stream);

// Router: softmax + top-k, ties to the lower id, exactly the CPU's
// arithmetic (same summation order; expf may differ from the host's exp in
// the last ulp). One thread per token. experts <= 1024.
cudaError_t RouterSoftmaxTopK(const float* logits, int64_t tokens, int64_t experts, int k,
                              int32_t* topk_ids, float* topk_weights, cudaStream_t stream);

// Which GEMM does the matrix work of the FFN kernels.
enum class GemmBackend {
  // Hand-written grouped bf16 GEMM (WMMA tensor cores, cp.async double
  // buffering); the token -> expert schedule stays on the device, so the
  // whole FFN is one stream of launches with no host sync (graph-capturable).
  kTiled,
  // cuBLAS (cublasGemmEx per expert, bf16 in, fp32 accumulate). Copies the
  // per-expert counts to the host and synchronises the stream once. The
  // timing reference.
  kCublas,
};

struct GemmOptions {
  GemmBackend backend = GemmBackend::kTiled;
  cublasHandle_t cublas = nullptr;  // required for kCublas; its stream is set
};

// y[rows, out] = x[rows, in] * w^T, x fp32 (rounded to bf16), w bf16.
size_t LinearWorkspaceBytes(int64_t rows, int64_t in, int64_t out);
cudaError_t Linear(const float* x, int64_t rows, int64_t in, const uint16_t* w, int64_t out,
                   float* y, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                   const GemmOptions& options = {});

// y[rows, hidden] (overwritten) = down(silu(x gate^T) * (x up^T)).
size_t SwiGluWorkspaceBytes(int64_t rows, int64_t hidden, int64_t inter);
cudaError_t SwiGlu(const float* x, int64_t rows, int64_t hidden, const uint16_t* w_gate,
                   const uint16_t* w_up, const uint16_t* w_down, int64_t inter, void* workspace,
                   size_t workspace_bytes, float* y, cudaStream_t stream,
                   const GemmOptions& options = {});

// Routed experts ACCUMULATED into y, as the CPU GroupedExpertSwiGlu: each
// token's expert terms are added in increasing slot order (deterministic, no
// atomics). w_gate, w_up [slots, inter, hidden]; w_down [slots, hidden,
// inter]; topk_ids/topk_weights/expert_to_slot on the device.
size_t GroupedExpertWorkspaceBytes(int64_t tokens, int k, int64_t hidden, int64_t inter,
                                   int64_t slots);
cudaError_t GroupedExpertSwiGlu(const float* x, int64_t tokens, int64_t hidden,
                                const int32_t* topk_ids, const float* topk_weights, int k,
                                const int32_t* expert_to_slot, int64_t num_experts, int64_t slots,
                                const uint16_t* w_gate, const uint16_t* w_up,
                                const uint16_t* w_down, int64_t inter, void* workspace,
                                size_t workspace_bytes, float* y, cudaStream_t stream,
                                const GemmOptions& options = {});

// ---------------------------------------------------------------- engine

// ids[r] = argmax of logits[r, :], ties to the lower index (the CPU's first
// maximum). One block per row.
cudaError_t ArgmaxRows(const float* logits, int64_t rows, int64_t cols, int32_t* ids,
                       cudaStream_t stream);

// dst[row_index[r] * width + c] = src[r * width + c] (the KV-cache append).
cudaError_t ScatterRows(const float* src, int64_t rows, int64_t width, const int32_t* row_index,
                        float* dst, cudaStream_t stream);

// ---------------------------------------------------------------- codecs

// Bit-identical to the CPU codecs (they share kernels/codec.h).
cudaError_t QuantizeFp8PerGroup(const float* x, int64_t tokens, int64_t hidden, int64_t group,
                                uint8_t* codes, float* scales, cudaStream_t stream);
cudaError_t DequantizeFp8PerGroup(const uint8_t* codes, const float* scales, int64_t tokens,
                                  int64_t hidden, int64_t group, float* x, cudaStream_t stream);
cudaError_t EncodeBf16Array(const float* x, int64_t count, uint16_t* out, cudaStream_t stream);
cudaError_t DecodeBf16Array(const uint16_t* x, int64_t count, float* out, cudaStream_t stream);
// `partials` is a DEVICE array of num_partials device pointers.
cudaError_t SumBf16Partials(const uint16_t* const* partials, int num_partials, int64_t count,
                            float* sum, cudaStream_t stream);

// Informational: counts the fp32 bit patterns in [first, first + count) on
// which cuda_fp8.h's saturating E4M3 conversion (NaN mapped to +0 first)
// disagrees with EncodeFp8E4m3; the first disagreeing pattern goes to
// *first_mismatch (0xFFFFFFFF if none). Both outputs are device pointers;
// the function resets them on `stream` before counting.
cudaError_t CompareCudaFp8Conversion(uint64_t first, uint64_t count, unsigned long long* mismatches,
                                     unsigned int* first_mismatch, cudaStream_t stream);

}  // namespace afd::cuda
