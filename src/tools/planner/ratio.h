#pragma once
// The optimal attention/FFN ratio.
//
// The seed's closed form (arXiv 2601.21351, Theorem 4.4). With r attention
// instances per FFN, the pipeline's cycle per layer and micro-batch is
//   tau(r) = max{ t_A, t_C, t_F(r) },  t_F(r) = alpha_F*r*B + beta_F
// and the throughput per instance is f(r) = r*B / ((r+1) * tau(r)).
//   r_A    = (t_A - beta_F) / (alpha_F*B)   attention-bound below it (I)
//   r_C    = (t_C - beta_F) / (alpha_F*B)   communication-bound below it (II)
//   r_peak = sqrt(beta_F / (alpha_F*B))     argmax of the FFN-bound f (III)
//   r*     = max{ r_A, r_C, r_peak }
// With y FFN instances that split the FFN, each takes t_F/y: in terms of
// r = x/y that is alpha_F*r*B + beta_F/y, so beta_F becomes beta_F/y.
//
// The full model adds two more lower bounds on tau (docs/planning.md):
//   link   r*y*B*bytes / bandwidth            the FFN instance's scale-out link
//                                             (the "dead zone" of arXiv 2602.09721)
//   depth  (t_A + (1+a2f)*t_C + t_F(r) + link in + link out) / m
//                                             only m micro-batches in flight
// Every bound is a line in r, so tau is their upper envelope and f's maximum
// sits at a corner of the envelope or at sqrt(intercept/slope) of one of its
// segments; Optimize evaluates exactly those candidates.

#include <vector>

#include "src/tools/planner/plan.h"

namespace stepmesh::planner {

enum class Regime { kAttention, kCommunication, kFfn, kPipelineDepth, kFfnLink };
const char* RegimeName(Regime r);
// "A", "C", "F", "depth" or "link": the report's tables and its JSON.
const char* RegimeShortName(Regime r);

struct SeedSolution {
  double kv_tokens = 0;  // T-bar
  double t_a = 0;        // t_A(T-bar)
  double t_c = 0;        // t_C(B)
  double beta_f = 0;     // beta_F / y
  double alpha_f_b = 0;  // alpha_F * B
  double r_a = 0, r_c = 0, r_peak = 0, r_star = 0;
  Regime regime = Regime::kFfn;  // whose term is r*
};
SeedSolution SolveSeed(const Coefficients& c, const Workload& w);

// One lower bound on the cycle: tau_i(r) = slope*r + intercept.
struct CycleTerm {
  Regime regime;
  double slope = 0;
  double intercept = 0;
  double At(double r) const { return slope * r + intercept; }
};

// The seed's three terms, or (full) with the depth and link bounds when the
// workload and wire give them.
std::vector<CycleTerm> CycleTerms(const Coefficients& c, const Workload& w, const WireModel& wire,
                                  bool full);

// tau(r) and which term binds.
double CycleTime(const std::vector<CycleTerm>& terms, double r, Regime* binding = nullptr);

// Tokens per second per instance (attention and FFN instances alike) at
// ratio r: r*B / ((r+1) * L * tau(r)).
double ThroughputPerInstance(const std::vector<CycleTerm>& terms, const Workload& w, double r);

struct Optimum {
  double r = 0;
  Regime regime = Regime::kFfn;  // the term binding just right of r
  double throughput = 0;         // per instance, tokens/s
};
Optimum Optimize(const std::vector<CycleTerm>& terms, const Workload& w);

// The ratio where the FFN link becomes the FFN's bound instead of its
// compute (0 when the link is never the bound or not modelled).
double LinkBoundFrom(const std::vector<CycleTerm>& terms);

}  // namespace stepmesh::planner
