#include "src/core/env_parse.h"

#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace stepmesh::core {
namespace {

// `field` = the parsed value; unchanged when the parser refused it.
template <typename T>
absl::Status Assign(T& field, absl::StatusOr<T> parsed) {
  if (!parsed.ok()) return parsed.status();
  field = *std::move(parsed);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int> ParseInt(absl::string_view value) {
  int out = 0;
  if (!absl::SimpleAtoi(value, &out)) return absl::InvalidArgumentError("not an integer");
  return out;
}

absl::StatusOr<bool> ParseBool(absl::string_view value) {
  bool out = false;
  if (!absl::SimpleAtob(value, &out)) {
    return absl::InvalidArgumentError("not a boolean (want true, false, yes, no, 1 or 0)");
  }
  return out;
}

absl::StatusOr<absl::Duration> ParseDuration(absl::string_view value) {
  absl::Duration d;
  if (absl::ParseDuration(value, &d)) return d;
  int64_t ms = 0;
  if (absl::SimpleAtoi(value, &ms)) return absl::Milliseconds(ms);
  return absl::InvalidArgumentError("not a duration (want 250ms, 2s, ... or milliseconds)");
}

absl::Status CheckOneOf(absl::string_view value,
                        std::initializer_list<absl::string_view> accepted) {
  if (absl::c_linear_search(accepted, value)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("not one of ", absl::StrJoin(accepted, ", ")));
}

absl::Status ParseInto(absl::string_view v, int& field, const OptionCheck&) {
  return Assign(field, ParseInt(v));
}

absl::Status ParseInto(absl::string_view v, int64_t& field, const OptionCheck&) {
  if (!absl::SimpleAtoi(v, &field)) return absl::InvalidArgumentError("not an integer");
  return absl::OkStatus();
}

absl::Status ParseInto(absl::string_view v, bool& field, const OptionCheck&) {
  return Assign(field, ParseBool(v));
}

absl::Status ParseInto(absl::string_view v, std::string& field, const OptionCheck& check) {
  if (check.kind == OptionCheck::Kind::kOneOf) {
    // An unknown name is refused here, naming the variable, not later.
    const std::vector<absl::string_view> accepted = absl::StrSplit(check.values, '|');
    if (!absl::c_linear_search(accepted, v)) {
      return absl::InvalidArgumentError(absl::StrCat("not one of ", absl::StrJoin(accepted, ", ")));
    }
  }
  field = std::string(v);
  return absl::OkStatus();
}

absl::Status ParseInto(absl::string_view v, absl::Duration& field, const OptionCheck&) {
  return Assign(field, ParseDuration(v));
}

absl::Status ParseInto(absl::string_view v, Role& field, const OptionCheck&) {
  return Assign(field, ParseRole(v));
}

absl::Status ParseInto(absl::string_view v, PollMode& field, const OptionCheck&) {
  return Assign(field, ParsePollMode(v));
}

absl::Status ParseInto(absl::string_view v, GpuDirect& field, const OptionCheck&) {
  return Assign(field, ParseGpuDirect(v));
}

absl::Status ParseInto(absl::string_view v, AuthMode& field, const OptionCheck&) {
  return Assign(field, ParseAuthMode(v));
}

absl::Status ParsePkeyInto(absl::string_view v, int& field) {
  uint32_t key = 0;
  const bool hex = absl::StartsWithIgnoreCase(v, "0x");
  if (!(hex ? absl::SimpleHexAtoi(v.substr(2), &key) : absl::SimpleAtoi(v, &key)) || key > 0xFFFF) {
    return absl::InvalidArgumentError("not a 16-bit P_Key (want 0x8001 or 32769)");
  }
  field = static_cast<int>(key);
  return absl::OkStatus();
}

absl::Status ParseCoresInto(absl::string_view v, std::vector<int>& cores, MeshOptions& o) {
  if (v == "auto") {
    o.threads.auto_pin = true;
    return absl::OkStatus();
  }
  std::vector<int> parsed;
  for (absl::string_view part : absl::StrSplit(v, ',', absl::SkipEmpty())) {
    int core = 0;
    if (!absl::SimpleAtoi(part, &core) || core < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", part, "' is not a core number (want 2,3 or auto)"));
    }
    parsed.push_back(core);
  }
  cores = std::move(parsed);
  return absl::OkStatus();
}

}  // namespace stepmesh::core
