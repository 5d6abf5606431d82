#pragma once
// The workload an attention instance serves, as Prometheus text appended to
// its stepmesh Stats() on --metrics-port (docs/metrics.md). stepmesh_plan
// --watch reads it (docs/planning.md, "--watch and autoscale"): the mean
// context per request and the batch are what the A/F-ratio model needs, and
// the mesh's own counters do not carry them.
//
//   afd_workload_requests{role="worker",rank="a"}           gauge: requests in flight
//   afd_workload_context_tokens{role="worker",rank="a"}     gauge: KV tokens they attend over,
//   summed afd_workload_micro_batches{role="worker",rank="a"}      gauge: micro-batches they are
//   split into afd_workload_decode_tokens_total{role="worker",rank="a"} counter: tokens decoded so
//   far

#include <cstdint>
#include <mutex>
#include <string>

namespace afd::example {

class WorkloadMetrics {
 public:
  // Called by the decode loop (once per step); the four values are read
  // together, never half of one update.
  void Observe(int64_t requests, int64_t context_tokens, int micro_batches, int64_t decode_tokens);
  // The series above, labelled with the instance's rank.
  std::string PrometheusText(int rank) const;

 private:
  mutable std::mutex mu_;
  int64_t requests_ = 0;
  int64_t context_tokens_ = 0;
  int64_t micro_batches_ = 0;
  int64_t decode_tokens_ = 0;
};

}  // namespace afd::example
