#include "examples/afd_model/workload_metrics.h"

#include "absl/strings/str_cat.h"

namespace afd::example {

void WorkloadMetrics::Observe(int64_t requests, int64_t context_tokens, int micro_batches,
                              int64_t decode_tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  requests_ = requests;
  context_tokens_ = context_tokens;
  micro_batches_ = micro_batches;
  decode_tokens_ = decode_tokens;
}

std::string WorkloadMetrics::PrometheusText(int rank) const {
  int64_t v[4];
  {
    std::lock_guard<std::mutex> lock(mu_);
    v[0] = requests_;
    v[1] = context_tokens_;
    v[2] = micro_batches_;
    v[3] = decode_tokens_;
  }
  struct Series {
    const char* name;
    const char* type;
    const char* help;
  };
  static constexpr Series kSeries[4] = {
      {"afd_workload_requests", "gauge", "Requests in flight on this attention instance."},
      {"afd_workload_context_tokens", "gauge",
       "KV tokens the requests in flight attend over, summed."},
      {"afd_workload_micro_batches", "gauge", "Micro-batches the requests are split into."},
      {"afd_workload_decode_tokens_total", "counter", "Tokens decoded so far."},
  };
  const std::string labels = absl::StrCat("{role=\"worker\",rank=\"", rank, "\"}");
  std::string out;
  for (int i = 0; i < 4; ++i) {
    absl::StrAppend(&out, "# HELP ", kSeries[i].name, " ", kSeries[i].help, "\n# TYPE ",
                    kSeries[i].name, " ", kSeries[i].type, "\n", kSeries[i].name, labels, " ", v[i],
                    "\n");
  }
  return out;
}

}  // namespace afd::example
