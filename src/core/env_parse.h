#pragma once
// How a variable's value becomes a MeshOptions field (src/core/env_table.cc).
// Each parser says what is wrong with a value; FromEnv prefixes NAME='value'.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "stepmesh/option_table.h"
#include "stepmesh/options.h"

namespace stepmesh::core {

absl::StatusOr<int> ParseInt(absl::string_view value);
absl::StatusOr<bool> ParseBool(absl::string_view value);
// absl syntax ("250ms", "30s") or a bare number of milliseconds.
absl::StatusOr<absl::Duration> ParseDuration(absl::string_view value);

// A value of an enumeration: one of `accepted`, else an error listing them.
absl::Status CheckOneOf(absl::string_view value, std::initializer_list<absl::string_view> accepted);

// A field set from its variable by the field's type (option_table.inc's
// Generic rows); `check` refuses a string outside its OneOf names here, so
// the error names the variable.
absl::Status ParseInto(absl::string_view v, int& field, const OptionCheck& check);
absl::Status ParseInto(absl::string_view v, int64_t& field, const OptionCheck& check);
absl::Status ParseInto(absl::string_view v, bool& field, const OptionCheck& check);
absl::Status ParseInto(absl::string_view v, std::string& field, const OptionCheck& check);
absl::Status ParseInto(absl::string_view v, absl::Duration& field, const OptionCheck& check);
absl::Status ParseInto(absl::string_view v, Role& field, const OptionCheck& check);
absl::Status ParseInto(absl::string_view v, PollMode& field, const OptionCheck& check);
absl::Status ParseInto(absl::string_view v, GpuDirect& field, const OptionCheck& check);
absl::Status ParseInto(absl::string_view v, AuthMode& field, const OptionCheck& check);

// An InfiniBand P_Key, `0x8001` or decimal (Pkey rows).
absl::Status ParsePkeyInto(absl::string_view v, int& field);
// `2,3`, or `auto` (hwloc: sets threads.auto_pin instead) (Cores rows).
absl::Status ParseCoresInto(absl::string_view v, std::vector<int>& cores, MeshOptions& o);

}  // namespace stepmesh::core
