#pragma once
// Reports of events a remote peer can cause at will (garbage on a socket, a
// flood of connections): each is worth a warning, but a peer must not be able
// to fill the log. A RateLimiter lets `burst` reports through per `period` and
// counts the rest, so the next report can say how many were suppressed.

#include <cstdint>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "src/base/logging.h"

namespace stepmesh::base {

class RateLimiter {
 public:
  RateLimiter(int burst, absl::Duration period) : burst_(burst), period_(period) {}

  // True when this event may be reported; then `*suppressed` is the number of
  // events refused since the previous report.
  bool Allow(uint64_t* suppressed) {
    const absl::Time now = absl::Now();
    std::lock_guard<std::mutex> lock(mu_);
    if (now - window_start_ >= period_) {
      window_start_ = now;
      used_ = 0;
    }
    if (used_ >= burst_) {
      ++suppressed_;
      return false;
    }
    ++used_;
    *suppressed = suppressed_;
    suppressed_ = 0;
    return true;
  }

 private:
  const int burst_;
  const absl::Duration period_;
  std::mutex mu_;
  absl::Time window_start_ = absl::InfinitePast();
  int used_ = 0;
  uint64_t suppressed_ = 0;
};

}  // namespace stepmesh::base

// Logs like STEPMESH_LOG when `limiter` allows it, noting how many similar
// lines it held back since the last one.
#define STEPMESH_LOG_LIMITED(limiter, level, ...)                                              \
  do {                                                                                         \
    uint64_t stepmesh_suppressed_ = 0;                                                         \
    if (::stepmesh::base::LogEnabled(::stepmesh::base::LogLevel::level) &&                     \
        (limiter).Allow(&stepmesh_suppressed_)) {                                              \
      ::stepmesh::base::LogLine(                                                               \
          ::stepmesh::base::LogLevel::level, __FILE__, __LINE__,                               \
          ::absl::StrCat(__VA_ARGS__, stepmesh_suppressed_ == 0                                \
                                          ? std::string()                                      \
                                          : ::absl::StrCat(" (", stepmesh_suppressed_,         \
                                                           " similar messages suppressed)"))); \
    }                                                                                          \
  } while (0)
