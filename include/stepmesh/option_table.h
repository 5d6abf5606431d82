#pragma once
// The MeshOptions fields as data: one OptionInfo per row of
// stepmesh/option_table.inc, in its order. The Python MeshOptions, the
// generated docs (docs/configuration.md) and the tests that hold the Python
// stubs and the docs to the C++ options iterate it.

#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "stepmesh/export.h"

namespace stepmesh {

// What MeshOptions::Validate() accepts for one field.
struct OptionCheck {
  enum class Kind : uint8_t {
    kAny,       // anything of the field's type (or checked with other fields)
    kRange,     // an integer in [lo, hi]
    kOneOf,     // one of `values` ("auto|on|off"; integers for an int field)
    kPositive,  // a duration > 0
  };
  Kind kind = Kind::kAny;
  int64_t lo = 0;
  int64_t hi = 0;
  absl::string_view values;

  static constexpr OptionCheck Any() { return {}; }
  static constexpr OptionCheck Range(int64_t lo, int64_t hi) { return {Kind::kRange, lo, hi, {}}; }
  static constexpr OptionCheck AtLeast(int64_t lo) {
    return Range(lo, std::numeric_limits<int64_t>::max());
  }
  static constexpr OptionCheck OneOf(absl::string_view values) {
    return {Kind::kOneOf, 0, 0, values};
  }
  static constexpr OptionCheck Positive() { return {Kind::kPositive, 0, 0, {}}; }

  // "1..4096", ">= 4096", "auto, on or off", "> 0"; "" for kAny.
  std::string Describe() const;
};

struct OptionInfo {
  absl::string_view name;      // the Python attribute ("rdma_port")
  absl::string_view member;    // the C++ field ("rdma.port")
  absl::string_view variable;  // the environment variable that sets it; "" when none
  OptionCheck check;
  absl::string_view default_value;  // markdown, as the docs show it
  absl::string_view meaning;        // markdown, one line
};

// Every row of stepmesh/option_table.inc, in table order.
STEPMESH_EXPORT absl::Span<const OptionInfo> OptionTable();

}  // namespace stepmesh
