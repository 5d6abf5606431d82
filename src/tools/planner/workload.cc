#include "src/tools/planner/workload.h"

#include <cmath>

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

double MeanKvTokens(const Workload& w) {
  if (!w.context.sparse) return w.batch * (w.mu_p + w.mu_d);
  // Midpoint quadrature in probability space over P and over the stationary
  // geometric decode index (both are independent of each other).
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
  double sum = 0;
  for (int k = 0; k < kI; ++k) {
    const double i = static_cast<double>(GeometricFromUniform(p, (k + 0.5) / kI));
    for (double pf : prefills) sum += w.context.EffectiveTokens(pf + i);
  }
  return w.batch * sum / (static_cast<double>(kI) * prefills.size());
}

}  // namespace stepmesh::planner
