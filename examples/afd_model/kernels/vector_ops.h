#pragma once

// Inner loops shared by the CPU kernels of both example models (Step-3's
// kernels/cpu_kernels.cc and Step-5's step5/step5_kernels.cc). Written for
// auto-vectorisation without -ffast-math: the summation order is fixed by the
// length alone, so results never depend on threads, batching or timing.

#include <cstdint>

namespace afd::cpu {

// Eight independent partial sums let -O2 keep a whole vector register busy;
// the fixed lane order keeps the result deterministic.
inline float Dot(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 8;
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) {
      lanes[lane] += a[i + lane] * b[i + lane];
    }
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
         ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])) + tail;
}

// acc[i] += alpha * x[i].
inline void Axpy(float alpha, const float* x, int64_t n, float* acc) {
  for (int64_t i = 0; i < n; ++i) acc[i] += alpha * x[i];
}

}  // namespace afd::cpu
