#include "src/tools/planner/ratio.h"

#include <algorithm>
#include <cmath>

#include "src/tools/planner/workload.h"

namespace stepmesh::planner {

namespace {

// Each regime's name in the report's prose and, short, in its tables and JSON.
struct RegimeNames {
  Regime regime;
  const char* name;
  const char* short_name;
};
constexpr RegimeNames kRegimeNames[] = {{Regime::kAttention, "attention-bound (I)", "A"},
                                        {Regime::kCommunication, "communication-bound (II)", "C"},
                                        {Regime::kFfn, "FFN-bound (III)", "F"},
                                        {Regime::kPipelineDepth, "pipeline-depth-bound", "depth"},
                                        {Regime::kFfnLink, "FFN-link-bound (dead zone)", "link"}};

const RegimeNames* NamesOf(Regime r) {
  for (const RegimeNames& row : kRegimeNames) {
    if (row.regime == r) return &row;
  }
  return nullptr;
}

}  // namespace

const char* RegimeName(Regime r) {
  const RegimeNames* names = NamesOf(r);
  return names != nullptr ? names->name : "?";
}

const char* RegimeShortName(Regime r) {
  const RegimeNames* names = NamesOf(r);
  return names != nullptr ? names->short_name : "?";
}

SeedSolution SolveSeed(const Coefficients& c, const Workload& w) {
  SeedSolution s;
  s.kv_tokens = MeanKvTokens(w);
  s.t_a = c.attention.At(s.kv_tokens);
  s.t_c = CommTime(c, w);
  s.beta_f = c.ffn.beta / w.ffn_instances;
  s.alpha_f_b = c.ffn.alpha * w.batch;
  s.r_a = (s.t_a - s.beta_f) / s.alpha_f_b;
  s.r_c = (s.t_c - s.beta_f) / s.alpha_f_b;
  s.r_peak = std::sqrt(s.beta_f / s.alpha_f_b);
  s.r_star = std::max({s.r_a, s.r_c, s.r_peak});
  s.regime = s.r_star == s.r_a   ? Regime::kAttention
             : s.r_star == s.r_c ? Regime::kCommunication
                                 : Regime::kFfn;
  return s;
}

std::vector<CycleTerm> CycleTerms(const Coefficients& c, const Workload& w, const WireModel& wire,
                                  bool full) {
  const double t_a = c.attention.At(MeanKvTokens(w));
  const double t_c = CommTime(c, w);
  const double y = w.ffn_instances;
  std::vector<CycleTerm> terms = {
      {Regime::kAttention, 0.0, t_a},
      {Regime::kCommunication, 0.0, t_c},
      {Regime::kFfn, c.ffn.alpha * w.batch, c.ffn.beta / y},
  };
  if (!full) return terms;
  // The FFN link (when modelled): every FFN instance receives every
  // attention instance's rows (the FFN is split by experts, tokens are
  // broadcast) and returns a partial for each: r*y*B rows each way.
  double link_in = 0, link_out = 0;  // per unit of r
  if (wire.ffn_link_gbps > 0) {
    const double us_per_byte = 8.0 / (wire.ffn_link_gbps * 1e3);
    link_in = y * w.batch * wire.a2f_bytes_per_row * us_per_byte;
    link_out = y * w.batch * wire.f2a_bytes_per_row * us_per_byte;
    terms.push_back({Regime::kFfnLink, std::max(link_in, link_out), 0.0});  // full duplex
  }
  if (w.micro_batches > 0) {
    // One micro-batch's round trip is A, A2F, [link in], F, [link out], F2A
    // in sequence; with m of them in flight an attention instance finishes
    // at most m per round trip.
    const double m = w.micro_batches;
    terms.push_back({Regime::kPipelineDepth, (c.ffn.alpha * w.batch + link_in + link_out) / m,
                     (t_a + (1.0 + c.a2f_fraction) * t_c + c.ffn.beta / y) / m});
  }
  return terms;
}

double CycleTime(const std::vector<CycleTerm>& terms, double r, Regime* binding) {
  double tau = -1;
  for (const CycleTerm& t : terms) {
    const double v = t.At(r);
    if (v > tau) {
      tau = v;
      if (binding != nullptr) *binding = t.regime;
    }
  }
  return tau;
}

double ThroughputPerInstance(const std::vector<CycleTerm>& terms, const Workload& w, double r) {
  if (r <= 0) return 0;
  const double tau = CycleTime(terms, r);
  if (tau <= 0) return 0;
  return r * w.batch / ((r + 1.0) * w.layers * tau) * 1e6;
}

Optimum Optimize(const std::vector<CycleTerm>& terms, const Workload& w) {
  // On a segment where term i binds, f = r*B/((r+1)*(a*r + b)) has
  // f' ∝ b - a*r^2: it rises up to sqrt(b/a) and falls after (rises forever
  // when a = 0). So the maximum is a segment's sqrt(b/a) or a corner.
  struct Candidate {
    double r;
    const CycleTerm* term;  // the term whose stationary point it is, or null for a corner
  };
  std::vector<Candidate> candidates;
  for (const CycleTerm& t : terms) {
    if (t.slope > 0 && t.intercept > 0)
      candidates.push_back({std::sqrt(t.intercept / t.slope), &t});
  }
  for (size_t i = 0; i < terms.size(); ++i) {
    for (size_t j = i + 1; j < terms.size(); ++j) {
      const double ds = terms[i].slope - terms[j].slope;
      if (ds == 0) continue;
      const double r = (terms[j].intercept - terms[i].intercept) / ds;
      if (r > 0) candidates.push_back({r, nullptr});
    }
  }
  Optimum best;
  for (const Candidate& c : candidates) {
    const double f = ThroughputPerInstance(terms, w, c.r);
    if (f > best.throughput) {
      best.r = c.r;
      best.throughput = f;
      // A corner belongs to the regime on its left: that regime's
      // throughput rises all the way to the corner.
      Regime binding = Regime::kFfn;
      if (c.term != nullptr)
        binding = c.term->regime;
      else
        CycleTime(terms, c.r * (1.0 - 1e-9), &binding);
      best.regime = binding;
    }
  }
  return best;
}

double LinkBoundFrom(const std::vector<CycleTerm>& terms) {
  const CycleTerm* ffn = nullptr;
  const CycleTerm* link = nullptr;
  for (const CycleTerm& t : terms) {
    if (t.regime == Regime::kFfn) ffn = &t;
    if (t.regime == Regime::kFfnLink) link = &t;
  }
  if (ffn == nullptr || link == nullptr || link->slope <= ffn->slope) return 0;
  return (ffn->intercept - link->intercept) / (link->slope - ffn->slope);
}

}  // namespace stepmesh::planner
