#include "src/base/logging.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>

#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace stepmesh::base {
namespace {
// The one piece of process-wide state: a threshold, not an object with a lifetime.
std::atomic<int> log_threshold{static_cast<int>(LogLevel::kWarning)};
constexpr const char* kLevelNames[] = {"D", "I", "W", "E"};
}  // namespace

void SetLogThreshold(LogLevel level) {
  log_threshold.store(static_cast<int>(level), std::memory_order_relaxed);
}

bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) >= log_threshold.load(std::memory_order_relaxed);
}

void LogLine(LogLevel level, absl::string_view file, int line, absl::string_view message) {
  const size_t slash = file.rfind('/');
  if (slash != absl::string_view::npos) file.remove_prefix(slash + 1);
  const std::string stamp = absl::FormatTime("%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone());
  // One fprintf per line so lines of different threads do not interleave.
  std::fprintf(stderr, "[stepmesh %s %s %d %.*s:%d] %.*s\n", kLevelNames[static_cast<int>(level)],
               stamp.c_str(), static_cast<int>(getpid()), static_cast<int>(file.size()),
               file.data(), line, static_cast<int>(message.size()), message.data());
}

}  // namespace stepmesh::base
