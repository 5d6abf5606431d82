#include "src/tools/planner/prometheus_text.h"

#include <cmath>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace stepmesh::planner {
namespace {

bool NameChar(char c, bool first) {
  return absl::ascii_isalpha(c) || c == '_' || c == ':' || (!first && absl::ascii_isdigit(c));
}

absl::Status LineError(int line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("metrics line ", line, ": ", what));
}

bool ParseValue(absl::string_view s, double* out) {
  if (s == "+Inf" || s == "Inf") {
    *out = std::numeric_limits<double>::infinity();
    return true;
  }
  if (s == "-Inf") {
    *out = -std::numeric_limits<double>::infinity();
    return true;
  }
  if (s == "NaN") {
    *out = std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  return absl::SimpleAtod(s, out);
}

}  // namespace

const std::string* PromSample::Label(absl::string_view key) const {
  for (const auto& [k, v] : labels) {
    if (k == key) return &v;
  }
  return nullptr;
}

absl::StatusOr<std::vector<PromSample>> ParsePrometheusText(absl::string_view text) {
  std::vector<PromSample> out;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    PromSample s;
    size_t i = 0;
    while (i < line.size() && NameChar(line[i], i == 0)) ++i;
    if (i == 0) return LineError(number, "expected a metric name");
    s.name = std::string(line.substr(0, i));
    if (i < line.size() && line[i] == '{') {
      ++i;
      for (;;) {
        while (i < line.size() && line[i] == ' ') ++i;
        if (i < line.size() && line[i] == '}') {
          ++i;
          break;
        }
        const size_t key_begin = i;
        while (i < line.size() && NameChar(line[i], i == key_begin)) ++i;
        if (i == key_begin || i + 1 >= line.size() || line[i] != '=' || line[i + 1] != '"') {
          return LineError(number, absl::StrCat(s.name, ": expected label=\"value\""));
        }
        std::string key(line.substr(key_begin, i - key_begin));
        i += 2;
        std::string value;
        bool closed = false;
        while (i < line.size()) {
          const char c = line[i++];
          if (c == '"') {
            closed = true;
            break;
          }
          if (c == '\\' && i < line.size()) {
            const char e = line[i++];
            value.push_back(e == 'n' ? '\n' : e);
          } else {
            value.push_back(c);
          }
        }
        if (!closed) return LineError(number, absl::StrCat(s.name, ": unterminated label value"));
        s.labels.emplace_back(std::move(key), std::move(value));
        while (i < line.size() && line[i] == ' ') ++i;
        if (i < line.size() && line[i] == ',') ++i;
      }
    }
    const std::vector<absl::string_view> rest =
        absl::StrSplit(line.substr(i), ' ', absl::SkipWhitespace());
    if (rest.empty() || rest.size() > 2) {
      return LineError(number, absl::StrCat(s.name, ": expected a value (and a timestamp)"));
    }
    if (!ParseValue(rest[0], &s.value)) {
      return LineError(number, absl::StrCat(s.name, ": bad value \"", rest[0], "\""));
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace stepmesh::planner
