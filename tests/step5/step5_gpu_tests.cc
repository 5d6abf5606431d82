// step5_gpu_tests: the Step-5 CUDA kernels (indexer scores, top-k block
// selection, sparse decode attention) against their CPU twins, at
// Step-5-Preview's full widths (64 q heads in 4 KV groups of head_dim 192,
// 16 indexer heads over a 256-wide proxy, 8-token blocks, budget 512) with
// contexts past the budget (up to 8192 tokens, so selection drops history)
// and at tiny-step5's widths, then a timing table. Exits 0 when every check
// passes, 1 otherwise, 77 (ctest: skipped) without a GPU.
//
// Bounds: scores bit-identical (the kernel adds in the CPU's order without
// FMA), selections identical, attention rel L2 <= 1e-5 per token (online
// softmax and expf vs three passes and std::exp).

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "examples/afd_model/cuda/cuda_raii.h"
#include "examples/afd_model/kernels/codec.h"
#include "examples/afd_model/step5/cuda/step5_cuda.h"
#include "examples/afd_model/step5/step5_kernels.h"
#include "examples/afd_model/weights.h"

namespace afd::step5 {
namespace {

using afd::cuda::DeviceBuffer;

bool g_ok = true;

#define CUDA_OK(expr)                                                      \
  do {                                                                     \
    const cudaError_t status_ = (expr);                                    \
    if (status_ != cudaSuccess) {                                          \
      std::fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(status_));                           \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

// Cheap deterministic normal-ish values (sum of 4 uniforms), fast enough for
// hundreds of millions of cache entries.
void Fill(std::vector<float>* v, uint64_t seed, float scale) {
  for (size_t i = 0; i < v->size(); ++i) {
    const uint64_t z = SplitMix64(seed * 0x100000001B3ull + i);
    float sum = 0.0f;
    for (int j = 0; j < 4; ++j) sum += static_cast<float>((z >> (16 * j)) & 0xFFFF) / 65535.0f;
    (*v)[i] = (sum - 2.0f) * 1.7f * scale;
  }
}

template <typename T>
DeviceBuffer<T> Upload(const std::vector<T>& host) {
  DeviceBuffer<T> buffer(host.size());
  CUDA_OK(buffer.status());
  CUDA_OK(cudaMemcpy(buffer.get(), host.data(), buffer.bytes(), cudaMemcpyHostToDevice));
  return buffer;
}

template <typename T>
std::vector<T> Download(const DeviceBuffer<T>& buffer) {
  std::vector<T> host(buffer.size());
  CUDA_OK(cudaMemcpy(host.data(), buffer.get(), buffer.bytes(), cudaMemcpyDeviceToHost));
  return host;
}

// Runs f over [0, n) on every hardware thread.
template <typename F>
void ParallelFor(int64_t n, F f) {
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([=] {
      for (int64_t i = w; i < n; i += threads) f(i);
    });
  }
  for (auto& t : pool) t.join();
}

template <typename F>
double MedianMs(F launch, int reps = 20) {
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  std::vector<double> times;
  launch();
  CUDA_OK(cudaDeviceSynchronize());
  for (int i = 0; i < reps; ++i) {
    CUDA_OK(cudaEventRecord(start));
    launch();
    CUDA_OK(cudaEventRecord(stop));
    CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void Row(const std::string& name, const std::string& error, const std::string& bound, bool pass,
         double ms, const std::string& rate) {
  std::printf("%-44s %-22s %-10s %-5s %9.4f  %s\n", name.c_str(), error.c_str(), bound.c_str(),
              pass ? "ok" : "FAIL", ms, rate.c_str());
  if (!pass) g_ok = false;
}

struct Shape {
  std::string name;
  int64_t heads, groups, d, index_heads, p, b, k;
  int64_t sequences, max_len;
  std::vector<int32_t> positions;  // one decode token per entry, sequences round robin
};

void RunShape(const Shape& s) {
  const int64_t n = static_cast<int64_t>(s.positions.size());
  const int64_t hpg_index = s.index_heads / s.groups;
  const int64_t max_blocks = s.max_len / s.b;
  const int64_t kv_row = s.groups * s.d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.d));
  std::vector<int32_t> sequence(n);
  for (int64_t t = 0; t < n; ++t) sequence[t] = static_cast<int32_t>(t % s.sequences);

  // Inputs: E4M3 queries and summaries (some summary rows duplicated or
  // zeroed so scores tie exactly, the tie rule's case), signed head weights,
  // random K/V caches and queries.
  std::vector<float> qf(n * s.index_heads * s.p), cf(s.sequences * max_blocks * s.p);
  std::vector<float> w(n * s.index_heads);
  Fill(&qf, 1, 1.0f);
  Fill(&cf, 2, 0.5f);
  Fill(&w, 3, 0.5f);
  std::vector<uint8_t> qc(qf.size()), cc(cf.size());
  cpu::CastFp8E4m3(qf.data(), static_cast<int64_t>(qf.size()), qc.data());
  cpu::CastFp8E4m3(cf.data(), static_cast<int64_t>(cf.size()), cc.data());
  for (int64_t r = 0; r < s.sequences * max_blocks; r += 5) {
    if (r % 10 == 0) {
      std::fill_n(cc.begin() + r * s.p, s.p, uint8_t{0});
    } else {
      std::copy_n(cc.begin() + (r - 5) * s.p, s.p, cc.begin() + r * s.p);
    }
  }
  std::vector<float> q(n * s.heads * s.d), kc(s.sequences * s.max_len * kv_row),
      vc(s.sequences * s.max_len * kv_row);
  Fill(&q, 4, 1.0f);
  Fill(&kc, 5, 1.0f);
  Fill(&vc, 6, 1.0f);

  // CPU.
  std::vector<float> cpu_scores(n * s.groups * max_blocks, 0.0f);
  std::vector<int32_t> cpu_selected(n * s.groups * s.k, -1);
  std::vector<int64_t> cpu_count(n * s.groups, 0);
  std::vector<float> cpu_out(n * s.heads * s.d);
  ParallelFor(n, [&](int64_t t) {
    const int64_t history = s.positions[t] / s.b;
    std::vector<float> scratch((s.index_heads + 1) * s.p);
    std::vector<float> rows(s.groups * history);
    cpu::IndexerScores(qc.data() + t * s.index_heads * s.p, w.data() + t * s.index_heads, s.groups,
                       hpg_index, s.p, cc.data() + sequence[t] * max_blocks * s.p, history,
                       scratch.data(), rows.data());
    std::vector<int32_t> order(std::max<int64_t>(history, 1));
    for (int64_t g = 0; g < s.groups; ++g) {
      std::copy_n(rows.begin() + g * history, history,
                  cpu_scores.begin() + (t * s.groups + g) * max_blocks);
      cpu_count[t * s.groups + g] =
          cpu::SelectTopKBlocks(rows.data() + g * history, history, s.k, order.data(),
                                cpu_selected.data() + (t * s.groups + g) * s.k);
    }
    std::vector<float> attention_scratch((s.k + 1) * s.b);
    cpu::SparseBlockAttention(q.data() + t * s.heads * s.d, s.heads, s.groups, s.d,
                              kc.data() + sequence[t] * s.max_len * kv_row,
                              vc.data() + sequence[t] * s.max_len * kv_row, s.positions[t], s.b,
                              cpu_selected.data() + t * s.groups * s.k,
                              cpu_count.data() + t * s.groups, s.k, scale, attention_scratch.data(),
                              cpu_out.data() + t * s.heads * s.d);
  });

  // GPU.
  auto d_qc = Upload(qc);
  auto d_w = Upload(w);
  auto d_cc = Upload(cc);
  auto d_seq = Upload(sequence);
  auto d_pos = Upload(s.positions);
  auto d_q = Upload(q);
  auto d_k = Upload(kc);
  auto d_v = Upload(vc);
  DeviceBuffer<float> d_scores(cpu_scores.size());
  DeviceBuffer<int32_t> d_selected(cpu_selected.size());
  DeviceBuffer<int32_t> d_count(cpu_count.size());
  DeviceBuffer<float> d_out(cpu_out.size());
  CUDA_OK(cudaMemset(d_scores.get(), 0, d_scores.bytes()));
  auto scores_launch = [&] {
    CUDA_OK(cuda::IndexerScores(d_qc.get(), d_w.get(), d_seq.get(), d_pos.get(), n, s.groups,
                                hpg_index, s.p, s.b, d_cc.get(), max_blocks, d_scores.get(),
                                nullptr));
  };
  auto select_launch = [&] {
    CUDA_OK(cuda::SelectTopKBlocks(d_scores.get(), d_pos.get(), n, s.groups, max_blocks, s.b, s.k,
                                   d_selected.get(), d_count.get(), nullptr));
  };
  auto attention_launch = [&] {
    CUDA_OK(cuda::SparseDecodeAttention(d_q.get(), n, s.heads, s.groups, s.d, d_k.get(), d_v.get(),
                                        s.max_len, d_seq.get(), d_pos.get(), s.b, d_selected.get(),
                                        d_count.get(), s.k, scale, d_out.get(), nullptr));
  };
  scores_launch();
  select_launch();
  attention_launch();
  CUDA_OK(cudaDeviceSynchronize());
  const auto gpu_scores = Download(d_scores);
  const auto gpu_selected = Download(d_selected);
  const auto gpu_count = Download(d_count);
  const auto gpu_out = Download(d_out);

  int64_t score_mismatch = 0, entries = 0, history_total = 0, attended_total = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t history = s.positions[t] / s.b;
    for (int64_t g = 0; g < s.groups; ++g) {
      for (int64_t r = 0; r < history; ++r) {
        const size_t i = (t * s.groups + g) * max_blocks + r;
        score_mismatch += std::memcmp(&gpu_scores[i], &cpu_scores[i], sizeof(float)) != 0;
        ++entries;
      }
      history_total += history;
      attended_total += cpu_count[t * s.groups + g];
    }
  }
  int64_t selection_mismatch = 0;
  for (int64_t i = 0; i < n * s.groups; ++i) {
    selection_mismatch += gpu_count[i] != cpu_count[i];
    for (int64_t j = 0; j < s.k; ++j) {
      selection_mismatch += gpu_selected[i * s.k + j] != cpu_selected[i * s.k + j];
    }
  }
  double worst = 0.0;
  for (int64_t t = 0; t < n; ++t) {
    double diff = 0.0, norm = 0.0;
    for (int64_t i = t * s.heads * s.d; i < (t + 1) * s.heads * s.d; ++i) {
      diff += std::pow(double{gpu_out[i]} - cpu_out[i], 2);
      norm += double{cpu_out[i]} * cpu_out[i];
    }
    worst = std::max(worst, std::sqrt(diff / norm));
  }

  const double scores_ms = MedianMs(scores_launch);
  const double select_ms = MedianMs(select_launch);
  const double attention_ms = MedianMs(attention_launch);
  // Bytes the kernels must read: summaries of the history (+ queries), the
  // score rows, and the selected positions' K and V of each group.
  int64_t positions_read = 0;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t g = 0; g < s.groups; ++g) {
      positions_read += cpu_count[t * s.groups + g] * s.b + (s.positions[t] % s.b) + 1;
    }
  }
  const double summary_bytes = static_cast<double>(entries / s.groups) * s.p;
  const double attention_bytes = static_cast<double>(positions_read) * s.d * 4 * 2;
  char buffer[128];
  std::printf("-- %s: %lld decode tokens, %lld history blocks attended of %lld (%.2f)\n",
              s.name.c_str(), static_cast<long long>(n), static_cast<long long>(attended_total),
              static_cast<long long>(history_total),
              static_cast<double>(attended_total) / std::max<int64_t>(history_total, 1));
  std::snprintf(buffer, sizeof(buffer), "%lld/%lld differ", static_cast<long long>(score_mismatch),
                static_cast<long long>(entries));
  std::string rate =
      std::to_string(static_cast<int>(summary_bytes / scores_ms / 1e6)) + " GB/s of summaries";
  Row(s.name + " IndexerScores", buffer, "bitwise", score_mismatch == 0, scores_ms, rate);
  std::snprintf(buffer, sizeof(buffer), "%lld differ", static_cast<long long>(selection_mismatch));
  Row(s.name + " SelectTopKBlocks", buffer, "exact", selection_mismatch == 0, select_ms, "");
  std::snprintf(buffer, sizeof(buffer), "rel L2 %.2e", worst);
  rate = std::to_string(static_cast<int>(attention_bytes / attention_ms / 1e6)) + " GB/s K/V (" +
         std::to_string(static_cast<int>(attention_bytes / attention_ms / 1e6 / 48)) +
         "% of 4.8 TB/s)";
  Row(s.name + " SparseDecodeAttention", buffer, "1e-5", worst <= 1e-5, attention_ms, rate);
}

int Main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("step5_gpu_tests: no CUDA device, skipped\n");
    return 77;
  }
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("step5_gpu_tests on %s\n", prop.name);
  std::printf("%-44s %-22s %-10s %-5s %9s  %s\n", "kernel", "error", "bound", "pass", "GPU ms",
              "throughput");

  // tiny-step5 widths: budget 4 blocks, contexts to 128.
  Shape tiny{"tiny", 16, 4, 48, 16, 64, 8, 4, 4, 128, {}};
  for (int32_t pos : {0, 7, 8, 31, 39, 40, 100, 127}) tiny.positions.push_back(pos);
  RunShape(tiny);

  // Full width: 128 decode tokens (the paper's per-GPU micro-batch) over 16
  // sequences of up to 8192 tokens; budget 512 blocks = 4096 tokens, so the
  // longer contexts drop history, the shorter ones are dense.
  Shape full{"full", 64, 4, 192, 16, 256, 8, 512, 16, 8192, {}};
  for (int i = 0; i < 128; ++i) {
    const int32_t lengths[] = {8191, 8000, 6000, 4103, 4104, 4105, 4095, 2048,
                               1000, 513,  64,   9,    8,    7,    1,    0};
    full.positions.push_back(std::max(0, lengths[i % 16] - 16 * (i / 16)));
  }
  RunShape(full);
  std::printf("step5_gpu_tests: %s\n", g_ok ? "PASS" : "FAIL");
  return g_ok ? 0 : 1;
}

}  // namespace
}  // namespace afd::step5

int main() { return afd::step5::Main(); }
