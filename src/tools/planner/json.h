#pragma once
// A small JSON reader for the planner's inputs: plan files, stepmesh_perf
// --json output and the AFD example's Chrome trace. Values are parsed into a
// tree; objects keep their key order. Errors name the line and column.
//
// Why not a library: the repository's only JSON needs are these few readers
// (everything else writes JSON by hand), and Debian 12's JSON packages would
// be a new dependency for every machine that builds stepmesh.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace stepmesh::planner {

class Json {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

  // Parses one JSON document (RFC 8259; nesting deeper than 200 is refused).
  static absl::StatusOr<Json> Parse(absl::string_view text);

  Json() = default;
  static Json Number(double v);
  static Json String(std::string v);
  // `base` with `patch` laid over it: objects merge key by key (recursively),
  // anything else in the patch replaces the base's value.
  static Json Merge(const Json& base, const Json& patch);

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_number() const { return type_ == Type::kNumber; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }
  bool is_bool() const { return type_ == Type::kBool; }

  double number() const { return number_; }
  bool boolean() const { return boolean_; }
  const std::string& string() const { return string_; }
  const std::vector<Json>& array() const { return array_; }
  const std::vector<std::pair<std::string, Json>>& object() const { return object_; }

  // The member `key` of an object; nullptr when absent or not an object.
  const Json* Find(absl::string_view key) const;

 private:
  friend class JsonParser;
  Type type_ = Type::kNull;
  bool boolean_ = false;
  double number_ = 0.0;
  std::string string_;
  std::vector<Json> array_;
  std::vector<std::pair<std::string, Json>> object_;
};

const char* JsonTypeName(Json::Type type);

}  // namespace stepmesh::planner
