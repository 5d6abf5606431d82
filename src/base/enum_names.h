// An enumeration's names as data: a table indexed by the enumeration's
// values, and the two lookups every named enumeration needs (value -> name
// for logs and messages, name -> value for configuration).

#ifndef STEPMESH_SRC_BASE_ENUM_NAMES_H_
#define STEPMESH_SRC_BASE_ENUM_NAMES_H_

#include <cstddef>
#include <string>
#include <type_traits>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace stepmesh::base {

// "a, b or c".
inline std::string JoinOr(absl::Span<const absl::string_view> names) {
  if (names.empty()) return "";
  if (names.size() == 1) return std::string(names[0]);
  return absl::StrCat(absl::StrJoin(names.first(names.size() - 1), ", "), " or ", names.back());
}

// names[i] names the value first + i (the values run without gaps); a value
// outside the table is `otherwise`.
template <typename Enum, typename Name, size_t N>
constexpr Name NameOf(const Name (&names)[N], Enum value, std::type_identity_t<Name> otherwise,
                      Enum first = Enum{}) {
  const auto i = static_cast<long long>(value) - static_cast<long long>(first);
  return i >= 0 && i < static_cast<long long>(N) ? names[i] : otherwise;
}

// The value named `name`; `what` names the enumeration in the error
// ("poll mode 'fast' (want spin, adaptive or blocking)").
template <typename Enum, size_t N>
absl::StatusOr<Enum> ParseName(const absl::string_view (&names)[N], absl::string_view what,
                               absl::string_view name, Enum first = Enum{}) {
  for (size_t i = 0; i < N; ++i) {
    if (names[i] == name) return static_cast<Enum>(static_cast<long long>(first) + i);
  }
  return absl::InvalidArgumentError(absl::StrCat(what, " '", name, "' (want ", JoinOr(names), ")"));
}

}  // namespace stepmesh::base

#endif  // STEPMESH_SRC_BASE_ENUM_NAMES_H_
