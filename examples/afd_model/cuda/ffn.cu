// FFN side of afd_model_cuda: bf16 GEMMs (hand-written grouped WMMA kernel
// or cuBLAS), dense SwiGLU and the routed experts grouped by expert.
//
// Routed experts, as on the CPU, are "bucket, then one GEMM per expert":
//   1. route:   one block builds, on the device, the packed row order (the
//               (token, pick) pairs of slot 0 in token order, then slot 1,
//               ...), the per-slot offsets, and a table of 64-row tiles, each
//               tagged with its slot;
//   2. gather:  x rows -> bf16 packed A;
//   3. GEMM 1:  [gate | up] = A W_{gate|up}^T, fp32 (one launch, all slots);
//   4. act:     bf16(silu(gate) * up);
//   5. GEMM 2:  per-pair expert outputs = act W_down^T, fp32;
//   6. combine: y[t] += w * out in increasing slot order (no atomics, so the
//               result is deterministic and in the CPU's order).
// The grouped GEMM reads the tile table, so nothing waits for the host.

#include <cuda_bf16.h>
#include <mma.h>

#include <vector>

#include "examples/afd_model/cuda/cuda_kernels.h"
#include "examples/afd_model/cuda/internal.cuh"
#include "examples/afd_model/kernels/codec.h"

namespace afd::cuda {
namespace {

using internal::CpAsync16;
using internal::CpAsyncCommit;
using internal::CpAsyncWait;

using internal::ElementwiseBlocks;
using internal::kElementwiseThreads;
using internal::LaunchStatus;
namespace wmma = nvcuda::wmma;

// ---------------------------------------------------------------- GEMM

// 64 x 128 block tile, 32-deep K steps, 3 cp.async stages; 8 warps in a
// 2 x 4 grid, each owning 32 x 32 of C (2 x 2 WMMA 16x16x16 bf16 tiles).
// A straightforward tensor-core kernel: no wgmma/TMA (those need sm_90a
// and far more code), which is fine for decode-sized expert batches that
// are bound by streaming the weights.
constexpr int kBm = 64;
constexpr int kBn = 128;
constexpr int kBk = 32;
constexpr int kStages = 3;
constexpr int kGemmThreads = 256;
constexpr int kSmemLd = kBk + 8;  // bf16; +16 bytes per row against bank conflicts
constexpr int kCLd = kBn + 4;     // fp32 epilogue staging
constexpr size_t kStageElements = static_cast<size_t>(kBm + kBn) * kSmemLd;
constexpr size_t kGemmSmemBytes = std::max(kStages * kStageElements * sizeof(__nv_bfloat16),
                                           static_cast<size_t>(kBm) * kCLd * sizeof(float));
static_assert(kGemmSmemBytes <= 48 * 1024, "fits the default smem limit");

struct GemmParams {
  const uint16_t* a = nullptr;  // packed rows, bf16, [rows, k]
  // B rows n < n_split come from b0, the others from b1 (row n - n_split);
  // group g's matrices start at g * b_group_stride elements.
  const uint16_t* b0 = nullptr;
  const uint16_t* b1 = nullptr;
  int64_t n_split = 0;
  int64_t b_group_stride = 0;
  float* c = nullptr;  // [rows, ldc] fp32
  int64_t ldc = 0;
  int64_t n = 0;
  int64_t k = 0;
  // Grouped schedule (device). When tile_group is null there is one group
  // of `rows` rows and m-tile i starts at row 64 i.
  const int32_t* tile_group = nullptr;
  const int32_t* tile_row0 = nullptr;
  const int32_t* group_offsets = nullptr;  // [groups + 1]
  const int32_t* num_tiles = nullptr;
  int64_t rows = 0;
};

// Grid (m-tiles, n-tiles). Requires k % 8 == 0 (16-byte rows chunks).
__global__ void __launch_bounds__(kGemmThreads) GroupedGemmBf16Kernel(GemmParams p) {
  int64_t group = 0;
  int64_t row0 = static_cast<int64_t>(blockIdx.x) * kBm;
  int64_t row_end = p.rows;
  if (p.tile_group != nullptr) {
    if (static_cast<int>(blockIdx.x) >= *p.num_tiles) return;
    group = p.tile_group[blockIdx.x];
    row0 = p.tile_row0[blockIdx.x];
    row_end = p.group_offsets[group + 1];
  }
  if (row0 >= row_end) return;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBn;

  extern __shared__ __align__(128) unsigned char gemm_smem[];
  auto* stages = reinterpret_cast<__nv_bfloat16*>(gemm_smem);

  // This thread's copy assignments: one 16-byte A chunk, two B chunks
  // (rows of 32 bf16 = 4 chunks).
  const int a_row = threadIdx.x / 4;
  const int a_chunk = threadIdx.x % 4;
  const bool a_valid = row0 + a_row < row_end;
  const uint16_t* a_src = p.a + (a_valid ? (row0 + a_row) * p.k : 0);
  const uint16_t* b_src[2];
  bool b_valid[2];
  int b_row[2];
  for (int i = 0; i < 2; ++i) {
    b_row[i] = (threadIdx.x + i * kGemmThreads) / 4;
    const int64_t n = n0 + b_row[i];
    b_valid[i] = n < p.n;
    const uint16_t* base = p.b0;
    int64_t matrix_row = n;
    if (n >= p.n_split) {
      base = p.b1;
      matrix_row = n - p.n_split;
    }
    b_src[i] = b_valid[i] ? base + group * p.b_group_stride + matrix_row * p.k : p.b0;
  }
  const int64_t k_tiles = (p.k + kBk - 1) / kBk;
  auto load_stage = [&](int64_t kt, int stage) {
    __nv_bfloat16* a_s = stages + stage * kStageElements;
    __nv_bfloat16* b_s = a_s + kBm * kSmemLd;
    const int64_t k_col = kt * kBk + a_chunk * 8;
    const bool k_ok = k_col < p.k;
    CpAsync16(a_s + a_row * kSmemLd + a_chunk * 8, a_valid && k_ok ? a_src + k_col : p.a,
              a_valid && k_ok);
    for (int i = 0; i < 2; ++i) {
      const bool ok = b_valid[i] && k_ok;
      CpAsync16(b_s + b_row[i] * kSmemLd + a_chunk * 8, ok ? b_src[i] + k_col : p.b0, ok);
    }
  };

  const int warp = threadIdx.x / 32;
  const int warp_m = warp / 4;  // 0..1: rows 32 warp_m
  const int warp_n = warp % 4;  // 0..3: columns 32 warp_n
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  }

  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    CpAsyncCommit();
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();  // stage kt landed for everyone; stage kt-1 is free
    const int64_t prefetch = kt + kStages - 1;
    if (prefetch < k_tiles) load_stage(prefetch, static_cast<int>(prefetch % kStages));
    CpAsyncCommit();
    const __nv_bfloat16* a_s = stages + (kt % kStages) * kStageElements;
    const __nv_bfloat16* b_s = a_s + kBm * kSmemLd;
#pragma unroll
    for (int kk = 0; kk < kBk; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        wmma::load_matrix_sync(a[i], a_s + (warp_m * 32 + i * 16) * kSmemLd + kk, kSmemLd);
        // B is [n][k] row-major = the K x N operand in column-major order.
        wmma::load_matrix_sync(b[i], b_s + (warp_n * 32 + i * 16) * kSmemLd + kk, kSmemLd);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
      }
    }
  }
  CpAsyncWait<0>();
  __syncthreads();  // the pipeline buffers become the C staging tile

  auto* c_s = reinterpret_cast<float*>(gemm_smem);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(c_s + (warp_m * 32 + i * 16) * kCLd + warp_n * 32 + j * 16, acc[i][j],
                              kCLd, wmma::mem_row_major);
    }
  }
  __syncthreads();
  // Partial tiles (rows past the group, columns past n) are not written.
  for (int e = threadIdx.x; e < kBm * kBn; e += kGemmThreads) {
    const int r = e / kBn;
    const int col = e % kBn;
    if (row0 + r < row_end && n0 + col < p.n) {
      p.c[(row0 + r) * p.ldc + n0 + col] = c_s[r * kCLd + col];
    }
  }
}

cudaError_t LaunchTiledGemm(const GemmParams& p, int64_t max_m_tiles, cudaStream_t stream) {
  if (p.k % 8 != 0) return cudaErrorInvalidValue;
  const int64_t n_tiles = (p.n + kBn - 1) / kBn;
  if (max_m_tiles <= 0 || n_tiles <= 0) return cudaSuccess;
  if (max_m_tiles > 0x7FFFFFFF || n_tiles > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned int>(max_m_tiles), static_cast<unsigned int>(n_tiles));
  GroupedGemmBf16Kernel<<<grid, kGemmThreads, kGemmSmemBytes, stream>>>(p);
  return LaunchStatus();
}

// The tiled GEMM of one weight pair over `rows` packed rows: c[rows, n] =
// a[rows, k] x [b0; b1]^T with B rows n < n_split from b0 (b1 null: all of
// them), ldc = n.
GemmParams DenseGemm(const uint16_t* a, const uint16_t* b0, const uint16_t* b1, int64_t n_split,
                     int64_t n, int64_t k, float* c, int64_t rows) {
  GemmParams p;
  p.a = a;
  p.b0 = b0;
  p.b1 = b1;
  p.n_split = n_split;
  p.c = c;
  p.ldc = n;
  p.n = n;
  p.k = k;
  p.rows = rows;
  return p;
}

// cuBLAS (options.backend kCublas) on `stream`: INVALID_VALUE without a
// handle, UNKNOWN when cuBLAS refuses the stream.
cudaError_t BindCublas(const GemmOptions& options, cudaStream_t stream) {
  if (options.cublas == nullptr) return cudaErrorInvalidValue;
  if (cublasSetStream(options.cublas, stream) != CUBLAS_STATUS_SUCCESS) return cudaErrorUnknown;
  return cudaSuccess;
}

// C[rows, m] (row-major, ldc) = A[rows, k] W^T with W [m, k], bf16 in, fp32
// out, through cuBLAS's column-major view: C^T = W^T' A^T'.
cudaError_t CublasGemm(cublasHandle_t handle, const uint16_t* w, int64_t m, int64_t k,
                       const uint16_t* a, int64_t rows, float* c, int64_t ldc) {
  const float alpha = 1.0f;
  const float beta = 0.0f;
  const cublasStatus_t status =
      cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(m), static_cast<int>(rows),
                   static_cast<int>(k), &alpha, w, CUDA_R_16BF, static_cast<int>(k), a, CUDA_R_16BF,
                   static_cast<int>(k), &beta, c, CUDA_R_32F, static_cast<int>(ldc),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  // The model lib has no status type of its own; any cuBLAS failure maps to
  // one CUDA code (the cuBLAS code is lost, the tests print the call site).
  return status == CUBLAS_STATUS_SUCCESS ? cudaSuccess : cudaErrorUnknown;
}

// ---------------------------------------------------------------- FFN glue

__global__ void ToBf16RowsKernel(const float* __restrict__ x, int64_t count,
                                 uint16_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = EncodeBf16(x[i]);
  }
}

// act[r, i] = bf16(silu(gate_up[r, i]) * gate_up[r, inter + i]) for the
// first *live_rows rows (all `rows` when live_rows is null).
__global__ void SiluMulToBf16Kernel(const float* __restrict__ gate_up, int64_t rows, int64_t inter,
                                    const int32_t* __restrict__ live_rows,
                                    uint16_t* __restrict__ act) {
  const int64_t live = live_rows != nullptr ? *live_rows : rows;
  const int64_t count = live * inter;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter;
    const int64_t c = i - r * inter;
    const float g = gate_up[r * 2 * inter + c];
    const float u = gate_up[r * 2 * inter + inter + c];
    act[i] = EncodeBf16(__fmul_rn(g / (1.0f + expf(-g)), u));
  }
}

constexpr int kRouteThreads = 1024;
constexpr int kMaxSlots = 1024;

__device__ __forceinline__ int SlotOfPair(const int32_t* topk_ids, const int32_t* expert_to_slot,
                                          int64_t num_experts, int64_t pair) {
  const int32_t expert = topk_ids[pair];
  if (expert < 0 || expert >= num_experts) return -1;
  return expert_to_slot[expert];
}

// One block. Warp w handles slots w, w + 32, ...; a warp walks the pairs 32
// at a time and ranks its matches with a ballot, so rows within a slot keep
// the token order (the CPU's order) without any sort.
__global__ void __launch_bounds__(kRouteThreads)
    RouteKernel(const int32_t* __restrict__ topk_ids, int64_t pairs,
                const int32_t* __restrict__ expert_to_slot, int64_t num_experts, int slots,
                int32_t* slot_offsets, int32_t* num_tiles, int32_t* row_of_pair,
                int32_t* pair_of_row, int32_t* tile_group, int32_t* tile_row0) {
  __shared__ int32_t counts[kMaxSlots];
  __shared__ int32_t offsets[kMaxSlots + 1];
  __shared__ int32_t tile_offsets[kMaxSlots + 1];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  constexpr int kWarps = kRouteThreads / 32;
  for (int64_t i = threadIdx.x; i < pairs; i += kRouteThreads) row_of_pair[i] = -1;
  for (int s = warp; s < slots; s += kWarps) {
    int count = 0;
    for (int64_t base = 0; base < pairs; base += 32) {
      const int64_t pair = base + lane;
      const bool match =
          pair < pairs && SlotOfPair(topk_ids, expert_to_slot, num_experts, pair) == s;
      count += __popc(__ballot_sync(0xFFFFFFFFu, match));
    }
    if (lane == 0) counts[s] = count;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    tile_offsets[0] = 0;
    for (int s = 0; s < slots; ++s) {
      offsets[s + 1] = offsets[s] + counts[s];
      tile_offsets[s + 1] = tile_offsets[s] + (counts[s] + kBm - 1) / kBm;
    }
    *num_tiles = tile_offsets[slots];
  }
  __syncthreads();
  for (int s = threadIdx.x; s <= slots; s += kRouteThreads) slot_offsets[s] = offsets[s];
  const unsigned int lanes_below = (1u << lane) - 1u;
  for (int s = warp; s < slots; s += kWarps) {
    int next_row = offsets[s];
    for (int64_t base = 0; base < pairs; base += 32) {
      const int64_t pair = base + lane;
      const bool match =
          pair < pairs && SlotOfPair(topk_ids, expert_to_slot, num_experts, pair) == s;
      const unsigned int ballot = __ballot_sync(0xFFFFFFFFu, match);
      if (match) {
        const int row = next_row + __popc(ballot & lanes_below);
        pair_of_row[row] = static_cast<int32_t>(pair);
        row_of_pair[pair] = row;
      }
      next_row += __popc(ballot);
    }
    for (int t = tile_offsets[s] + lane; t < tile_offsets[s + 1]; t += 32) {
      tile_group[t] = s;
      tile_row0[t] = offsets[s] + (t - tile_offsets[s]) * kBm;
    }
  }
}

// Packed row r = bf16(x[token of pair_of_row[r]]), for the live rows.
__global__ void GatherBf16Kernel(const float* __restrict__ x, int64_t hidden, int k,
                                 const int32_t* __restrict__ pair_of_row,
                                 const int32_t* __restrict__ live_rows, uint16_t* __restrict__ a) {
  const int64_t row = blockIdx.x;
  if (row >= *live_rows) return;
  const float* src = x + static_cast<int64_t>(pair_of_row[row] / k) * hidden;
  uint16_t* dst = a + row * hidden;
  for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = EncodeBf16(src[c]);
}

constexpr int kMaxTopK = 16;

// y[t] += w_j * out[row_j] over the token's owned picks in increasing slot
// order (a stable insertion sort of <= k entries; ties keep pick order, as
// the CPU's per-slot token lists do).
__global__ void CombineKernel(const float* __restrict__ expert_out, int64_t hidden, int k,
                              const int32_t* __restrict__ topk_ids,
                              const float* __restrict__ topk_weights,
                              const int32_t* __restrict__ expert_to_slot, int64_t num_experts,
                              const int32_t* __restrict__ row_of_pair, float* __restrict__ y) {
  const int64_t t = blockIdx.x;
  int slot[kMaxTopK];
  int row[kMaxTopK];
  float weight[kMaxTopK];
  int n = 0;
  for (int j = 0; j < k; ++j) {
    const int64_t pair = t * k + j;
    const int r = row_of_pair[pair];
    if (r < 0) continue;
    const int s = SlotOfPair(topk_ids, expert_to_slot, num_experts, pair);
    int i = n++;
    while (i > 0 && slot[i - 1] > s) {
      slot[i] = slot[i - 1];
      row[i] = row[i - 1];
      weight[i] = weight[i - 1];
      --i;
    }
    slot[i] = s;
    row[i] = r;
    weight[i] = topk_weights[pair];
  }
  if (n == 0) return;
  float* out = y + t * hidden;
  for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
    float acc = out[c];
    for (int i = 0; i < n; ++i) {
      acc = __fadd_rn(acc, __fmul_rn(weight[i], expert_out[row[i] * hidden + c]));
    }
    out[c] = acc;
  }
}

// ---------------------------------------------------------------- workspace

// Carves 256-byte aligned sections out of one caller-provided buffer.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<unsigned char*>(base)) {}
  template <typename T>
  T* Take(int64_t count) {
    T* section = reinterpret_cast<T*>(base_ == nullptr ? nullptr : base_ + used_);
    used_ += (static_cast<size_t>(count) * sizeof(T) + 255) / 256 * 256;
    return section;
  }
  size_t used() const { return used_; }

 private:
  unsigned char* base_;
  size_t used_ = 0;
};

struct DenseScratch {
  uint16_t* a = nullptr;     // [rows, hidden] bf16
  float* gate_up = nullptr;  // [rows, 2 inter]
  uint16_t* act = nullptr;   // [rows, inter] bf16
};

DenseScratch CarveDense(Carver& carver, int64_t rows, int64_t hidden, int64_t inter) {
  DenseScratch s;
  s.a = carver.Take<uint16_t>(rows * hidden);
  s.gate_up = carver.Take<float>(rows * 2 * inter);
  s.act = carver.Take<uint16_t>(rows * inter);
  return s;
}

struct ExpertScratch {
  int32_t* slot_offsets = nullptr;
  int32_t* num_tiles = nullptr;
  int32_t* row_of_pair = nullptr;
  int32_t* pair_of_row = nullptr;
  int32_t* tile_group = nullptr;
  int32_t* tile_row0 = nullptr;
  DenseScratch dense;           // rows = pairs
  float* expert_out = nullptr;  // [pairs, hidden]
  int64_t max_tiles = 0;
};

ExpertScratch CarveExperts(Carver& carver, int64_t tokens, int k, int64_t hidden, int64_t inter,
                           int64_t slots) {
  ExpertScratch s;
  const int64_t pairs = tokens * k;
  s.max_tiles = (pairs + kBm - 1) / kBm + slots;
  s.slot_offsets = carver.Take<int32_t>(slots + 1);
  s.num_tiles = carver.Take<int32_t>(1);
  s.row_of_pair = carver.Take<int32_t>(pairs);
  s.pair_of_row = carver.Take<int32_t>(pairs);
  s.tile_group = carver.Take<int32_t>(s.max_tiles);
  s.tile_row0 = carver.Take<int32_t>(s.max_tiles);
  s.dense = CarveDense(carver, pairs, hidden, inter);
  s.expert_out = carver.Take<float>(pairs * hidden);
  return s;
}

#define AFD_RETURN_IF_ERROR(expr)                       \
  do {                                                  \
    const cudaError_t afd_status_ = (expr);             \
    if (afd_status_ != cudaSuccess) return afd_status_; \
  } while (0)

}  // namespace

size_t LinearWorkspaceBytes(int64_t rows, int64_t in, int64_t /*out*/) {
  Carver carver(nullptr);
  carver.Take<uint16_t>(rows * in);
  return carver.used();
}

cudaError_t Linear(const float* x, int64_t rows, int64_t in, const uint16_t* w, int64_t out,
                   float* y, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                   const GemmOptions& options) {
  if (rows <= 0) return cudaSuccess;
  if (workspace_bytes < LinearWorkspaceBytes(rows, in, out)) return cudaErrorInvalidValue;
  Carver carver(workspace);
  uint16_t* a = carver.Take<uint16_t>(rows * in);
  ToBf16RowsKernel<<<ElementwiseBlocks(rows * in), kElementwiseThreads, 0, stream>>>(x, rows * in,
                                                                                     a);
  AFD_RETURN_IF_ERROR(LaunchStatus());
  if (options.backend == GemmBackend::kCublas) {
    AFD_RETURN_IF_ERROR(BindCublas(options, stream));
    return CublasGemm(options.cublas, w, out, in, a, rows, y, out);
  }
  return LaunchTiledGemm(DenseGemm(a, w, nullptr, out, out, in, y, rows), (rows + kBm - 1) / kBm,
                         stream);
}

size_t SwiGluWorkspaceBytes(int64_t rows, int64_t hidden, int64_t inter) {
  Carver carver(nullptr);
  CarveDense(carver, rows, hidden, inter);
  return carver.used();
}

cudaError_t SwiGlu(const float* x, int64_t rows, int64_t hidden, const uint16_t* w_gate,
                   const uint16_t* w_up, const uint16_t* w_down, int64_t inter, void* workspace,
                   size_t workspace_bytes, float* y, cudaStream_t stream,
                   const GemmOptions& options) {
  if (rows <= 0) return cudaSuccess;
  if (workspace_bytes < SwiGluWorkspaceBytes(rows, hidden, inter)) {
    return cudaErrorInvalidValue;
  }
  Carver carver(workspace);
  const DenseScratch s = CarveDense(carver, rows, hidden, inter);
  ToBf16RowsKernel<<<ElementwiseBlocks(rows * hidden), kElementwiseThreads, 0, stream>>>(
      x, rows * hidden, s.a);
  AFD_RETURN_IF_ERROR(LaunchStatus());
  const bool cublas = options.backend == GemmBackend::kCublas;
  if (cublas) {
    AFD_RETURN_IF_ERROR(BindCublas(options, stream));
    AFD_RETURN_IF_ERROR(
        CublasGemm(options.cublas, w_gate, inter, hidden, s.a, rows, s.gate_up, 2 * inter));
    AFD_RETURN_IF_ERROR(
        CublasGemm(options.cublas, w_up, inter, hidden, s.a, rows, s.gate_up + inter, 2 * inter));
  } else {
    AFD_RETURN_IF_ERROR(
        LaunchTiledGemm(DenseGemm(s.a, w_gate, w_up, inter, 2 * inter, hidden, s.gate_up, rows),
                        (rows + kBm - 1) / kBm, stream));
  }
  SiluMulToBf16Kernel<<<ElementwiseBlocks(rows * inter), kElementwiseThreads, 0, stream>>>(
      s.gate_up, rows, inter, nullptr, s.act);
  AFD_RETURN_IF_ERROR(LaunchStatus());
  if (cublas) {
    return CublasGemm(options.cublas, w_down, hidden, inter, s.act, rows, y, hidden);
  }
  return LaunchTiledGemm(DenseGemm(s.act, w_down, nullptr, hidden, hidden, inter, y, rows),
                         (rows + kBm - 1) / kBm, stream);
}

size_t GroupedExpertWorkspaceBytes(int64_t tokens, int k, int64_t hidden, int64_t inter,
                                   int64_t slots) {
  Carver carver(nullptr);
  CarveExperts(carver, tokens, k, hidden, inter, slots);
  return carver.used();
}

cudaError_t GroupedExpertSwiGlu(const float* x, int64_t tokens, int64_t hidden,
                                const int32_t* topk_ids, const float* topk_weights, int k,
                                const int32_t* expert_to_slot, int64_t num_experts, int64_t slots,
                                const uint16_t* w_gate, const uint16_t* w_up,
                                const uint16_t* w_down, int64_t inter, void* workspace,
                                size_t workspace_bytes, float* y, cudaStream_t stream,
                                const GemmOptions& options) {
  if (tokens <= 0 || slots <= 0) return cudaSuccess;
  if (k <= 0 || k > kMaxTopK || slots > kMaxSlots || tokens * k > 0x7FFFFFFF ||
      workspace == nullptr ||
      workspace_bytes < GroupedExpertWorkspaceBytes(tokens, k, hidden, inter, slots)) {
    return cudaErrorInvalidValue;
  }
  Carver carver(workspace);
  const ExpertScratch s = CarveExperts(carver, tokens, k, hidden, inter, slots);
  const int64_t pairs = tokens * k;
  const int64_t expert_matrix = inter * hidden;

  RouteKernel<<<1, kRouteThreads, 0, stream>>>(
      topk_ids, pairs, expert_to_slot, num_experts, static_cast<int>(slots), s.slot_offsets,
      s.num_tiles, s.row_of_pair, s.pair_of_row, s.tile_group, s.tile_row0);
  AFD_RETURN_IF_ERROR(LaunchStatus());
  // live rows = slot_offsets[slots], the number of owned pairs.
  const int32_t* live_rows = s.slot_offsets + slots;
  GatherBf16Kernel<<<static_cast<unsigned int>(pairs), kElementwiseThreads, 0, stream>>>(
      x, hidden, k, s.pair_of_row, live_rows, s.dense.a);
  AFD_RETURN_IF_ERROR(LaunchStatus());

  if (options.backend == GemmBackend::kCublas) {
    AFD_RETURN_IF_ERROR(BindCublas(options, stream));
    // cuBLAS takes the per-expert sizes on the host: one sync.
    std::vector<int32_t> offsets(slots + 1);
    AFD_RETURN_IF_ERROR(cudaMemcpyAsync(offsets.data(), s.slot_offsets,
                                        sizeof(int32_t) * (slots + 1), cudaMemcpyDeviceToHost,
                                        stream));
    AFD_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    for (int64_t slot = 0; slot < slots; ++slot) {
      const int64_t rows = offsets[slot + 1] - offsets[slot];
      if (rows == 0) continue;
      const uint16_t* a = s.dense.a + offsets[slot] * hidden;
      float* gate_up = s.dense.gate_up + offsets[slot] * 2 * inter;
      AFD_RETURN_IF_ERROR(CublasGemm(options.cublas, w_gate + slot * expert_matrix, inter, hidden,
                                     a, rows, gate_up, 2 * inter));
      AFD_RETURN_IF_ERROR(CublasGemm(options.cublas, w_up + slot * expert_matrix, inter, hidden, a,
                                     rows, gate_up + inter, 2 * inter));
    }
    SiluMulToBf16Kernel<<<ElementwiseBlocks(pairs * inter), kElementwiseThreads, 0, stream>>>(
        s.dense.gate_up, pairs, inter, live_rows, s.dense.act);
    AFD_RETURN_IF_ERROR(LaunchStatus());
    for (int64_t slot = 0; slot < slots; ++slot) {
      const int64_t rows = offsets[slot + 1] - offsets[slot];
      if (rows == 0) continue;
      AFD_RETURN_IF_ERROR(CublasGemm(options.cublas, w_down + slot * expert_matrix, hidden, inter,
                                     s.dense.act + offsets[slot] * inter, rows,
                                     s.expert_out + offsets[slot] * hidden, hidden));
    }
  } else {
    // Each expert slot is a group: its weights at slot * expert_matrix, its
    // rows scheduled on the device (tile_group, tile_row0).
    auto grouped = [&](GemmParams p) {
      p.rows = 0;
      p.b_group_stride = expert_matrix;
      p.tile_group = s.tile_group;
      p.tile_row0 = s.tile_row0;
      p.group_offsets = s.slot_offsets;
      p.num_tiles = s.num_tiles;
      return LaunchTiledGemm(p, s.max_tiles, stream);
    };
    AFD_RETURN_IF_ERROR(
        grouped(DenseGemm(s.dense.a, w_gate, w_up, inter, 2 * inter, hidden, s.dense.gate_up, 0)));
    SiluMulToBf16Kernel<<<ElementwiseBlocks(pairs * inter), kElementwiseThreads, 0, stream>>>(
        s.dense.gate_up, pairs, inter, live_rows, s.dense.act);
    AFD_RETURN_IF_ERROR(LaunchStatus());
    AFD_RETURN_IF_ERROR(
        grouped(DenseGemm(s.dense.act, w_down, nullptr, hidden, hidden, inter, s.expert_out, 0)));
  }
  CombineKernel<<<static_cast<unsigned int>(tokens), kElementwiseThreads, 0, stream>>>(
      s.expert_out, hidden, k, topk_ids, topk_weights, expert_to_slot, num_experts, s.row_of_pair,
      y);
  return LaunchStatus();
}

}  // namespace afd::cuda
