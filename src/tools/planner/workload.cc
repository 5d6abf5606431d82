#include "src/tools/planner/workload.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace stepmesh::planner {

uint64_t Rng::Derive(uint64_t seed, uint64_t a, uint64_t b) {
  Rng r(seed ^ (a * 0xD1B54A32D192ED03ull) ^ (b * 0x8CB92BA72F3D8DD7ull));
  r.Next();
  return r.Next();
}

double DrawPrefill(const Workload& w, Rng& rng) {
  switch (w.prefill) {
    case PrefillDistribution::kFixed:
      return w.mu_p;
    case PrefillDistribution::kUniform:
      return w.mu_p * (0.5 + rng.Uniform());
    case PrefillDistribution::kExponential:
      return -w.mu_p * std::log1p(-rng.Uniform());
  }
  return w.mu_p;
}

namespace {

// A geometric count on {0, 1, ...} with P(n) = p(1-p)^n, from u in [0, 1).
int64_t GeometricFromUniform(double p, double u) {
  if (p >= 1.0) return 0;
  return static_cast<int64_t>(std::floor(std::log1p(-u) / std::log1p(-p)));
}

}  // namespace

SlotBatch::SlotBatch(const Workload& workload, int slots, uint64_t seed, bool stationary)
    : workload_(workload), rng_(seed), slots_(slots) {
  const double p = workload_.EndProbability();
  for (Slot& s : slots_) {
    s.prefill = DrawPrefill(workload_, rng_);
    if (stationary) s.decoded = GeometricFromUniform(p, rng_.Uniform());
  }
  Recount();
}

void SlotBatch::Recount() {
  double t = 0;
  for (const Slot& s : slots_) {
    t += workload_.context.EffectiveTokens(s.prefill + static_cast<double>(s.decoded));
  }
  kv_tokens_ = t;
}

void SlotBatch::FinishStep(double now, std::vector<Completion>* ended) {
  const double p = workload_.EndProbability();
  for (Slot& s : slots_) {
    ++s.produced;
    if (rng_.Uniform() < p) {
      if (ended != nullptr) ended->push_back({s.started_at, s.produced});
      s = Slot{};
      s.prefill = DrawPrefill(workload_, rng_);
      s.started_at = now;
    } else {
      ++s.decoded;
    }
  }
  Recount();
}

namespace {

// Midpoint quadrature in probability space over P and over the stationary
// geometric decode index (independent of each other): E[g] and E[g^2] for
// one slot.
std::pair<double, double> SlotMoments(const Workload& w) {
  std::vector<double> prefills;
  constexpr int kP = 64;
  switch (w.prefill) {
    case PrefillDistribution::kFixed:
      prefills.push_back(w.mu_p);
      break;
    case PrefillDistribution::kUniform:
      for (int k = 0; k < kP; ++k) prefills.push_back(w.mu_p * (0.5 + (k + 0.5) / kP));
      break;
    case PrefillDistribution::kExponential:
      for (int k = 0; k < kP; ++k) prefills.push_back(-w.mu_p * std::log1p(-(k + 0.5) / kP));
      break;
  }
  constexpr int kI = 2048;
  const double p = w.EndProbability();
  double sum = 0, sum2 = 0;
  for (int k = 0; k < kI; ++k) {
    const double i = static_cast<double>(GeometricFromUniform(p, (k + 0.5) / kI));
    for (double pf : prefills) {
      const double g = w.context.EffectiveTokens(pf + i);
      sum += g;
      sum2 += g * g;
    }
  }
  const double n = static_cast<double>(kI) * prefills.size();
  return {sum / n, sum2 / n};
}

}  // namespace

double MeanKvTokens(const Workload& w) {
  if (!w.context.sparse) return w.batch * (w.mu_p + w.mu_d);
  return w.batch * SlotMoments(w).first;
}

double KvTokensStdDev(const Workload& w) {
  double var = 0;
  if (!w.context.sparse) {
    // Var(P) + Var(i), i geometric on {0, 1, ...}: (1-p)/p^2.
    const double p = w.EndProbability();
    const double var_p = w.prefill == PrefillDistribution::kFixed     ? 0.0
                         : w.prefill == PrefillDistribution::kUniform ? w.mu_p * w.mu_p / 12
                                                                      : w.mu_p * w.mu_p;
    var = var_p + (1 - p) / (p * p);
  } else {
    const auto [m1, m2] = SlotMoments(w);
    var = std::max(0.0, m2 - m1 * m1);
  }
  return std::sqrt(w.batch * var);
}

double ExpectedMaxOfNormals(int n) {
  if (n <= 1) return 0;
  // E[max] = integral of z * n * phi(z) * Phi(z)^(n-1) dz.
  const double dz = 1e-3;
  double sum = 0;
  for (double z = -9; z < 9; z += dz) {
    const double phi = std::exp(-0.5 * z * z) / std::sqrt(2 * M_PI);
    const double cdf = 0.5 * std::erfc(-z / std::sqrt(2.0));
    sum += z * n * phi * std::pow(cdf, n - 1) * dz;
  }
  return sum;
}

}  // namespace stepmesh::planner
