#pragma once
// The seed's decode workload (arXiv 2601.21351 §4): B slots under continuous
// batching. Each slot holds a request with prefill length P (mean mu_P, any
// distribution) and decode index i; after every decode step the request ends
// with probability p = 1/(1+mu_D) (so the decode length D is geometric with
// E[D] = mu_D) and a fresh request takes the slot at once:
//   i' = X*(i+1),  P' = X*P + (1-X)*P_new,  X ~ Bernoulli(1-p).
// The KV tokens of the batch are T = sum_b (P_b + i_b); the horizon average
// tends to B*(mu_P + mu_D) (the seed's Proposition 4.3).
//
// Used by the simulator and by the example's emulated compute, so both draw
// the same process.

#include <cstdint>
#include <vector>

#include "src/tools/planner/plan.h"

namespace stepmesh::planner {

// SplitMix64: a small counter-based generator with a fixed algorithm, so a
// seed gives the same draws with every standard library.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1).
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  // A seed for an independent stream (a slot batch of one micro-batch).
  static uint64_t Derive(uint64_t seed, uint64_t a, uint64_t b);

 private:
  uint64_t state_;
};

double DrawPrefill(const Workload& w, Rng& rng);

// B slots of one micro-batch of one attention instance.
class SlotBatch {
 public:
  // With `stationary` the slots start in the process's stationary state
  // (the decode index of a memoryless request is itself geometric), so no
  // warm-up is needed; otherwise every slot starts a fresh request (i = 0),
  // as the seed's E[T_k] recursion does.
  SlotBatch(const Workload& workload, int slots, uint64_t seed, bool stationary);

  // Effective KV tokens the next step attends over: sum_b g(P_b + i_b).
  double KvTokens() const { return kv_tokens_; }
  int slots() const { return static_cast<int>(slots_.size()); }

  struct Completion {
    double started_at;  // the time the request took its slot (-1: a start-up request)
    int64_t tokens;     // tokens it produced
  };
  // Every slot produced one token; ends requests with probability p and
  // refills their slots at time `now`. Appends the requests that ended.
  void FinishStep(double now, std::vector<Completion>* ended);

 private:
  struct Slot {
    double prefill = 0;
    int64_t decoded = 0;  // i: decode tokens already in the cache
    int64_t produced = 0;
    double started_at = -1;
  };
  void Recount();

  const Workload workload_;
  Rng rng_;
  std::vector<Slot> slots_;
  double kv_tokens_ = 0;
};

// E[g(P + i)] for one slot in the stationary state, times B: the seed's
// horizon-average token load T-bar (exactly B*(mu_P + mu_D) when dense; a
// numerical expectation over P and the geometric i when sparse).
double MeanKvTokens(const Workload& w);

// The standard deviation of one micro-batch's KV tokens in the stationary
// state: sqrt(B) times one slot's (slots are independent).
double KvTokensStdDev(const Workload& w);

// E[max of n independent standard normals] (0 for n = 1).
double ExpectedMaxOfNormals(int n);

}  // namespace stepmesh::planner
