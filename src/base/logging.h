#pragma once
// A small logging facade (Abseil 20220623 has no absl/log). Lines go to stderr
// prefixed with level, time and the caller's tag; the threshold is set by the
// application (MeshOptions / STEPMESH_LOG_LEVEL), default WARNING.

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace stepmesh::base {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetLogThreshold(LogLevel level);
bool LogEnabled(LogLevel level);
void LogLine(LogLevel level, absl::string_view file, int line, absl::string_view message);

}  // namespace stepmesh::base

#define STEPMESH_LOG(level, ...)                                                       \
  do {                                                                                 \
    if (::stepmesh::base::LogEnabled(::stepmesh::base::LogLevel::level)) {             \
      ::stepmesh::base::LogLine(::stepmesh::base::LogLevel::level, __FILE__, __LINE__, \
                                ::absl::StrCat(__VA_ARGS__));                          \
    }                                                                                  \
  } while (0)
