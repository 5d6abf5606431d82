#pragma once
// Reading one JSON object of a planner input file (plan.cc, autoscale.cc):
// every member read is remembered, so a misspelt key is an error naming it
// instead of a silently ignored setting.

#include <cmath>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "src/tools/planner/json.h"
#include "stepmesh/status.h"

namespace stepmesh::planner {

// Reads the members of one JSON object, remembering which were read so that
// a misspelt key is an error instead of a silently ignored setting.
class ObjectReader {
 public:
  ObjectReader(const Json* obj, std::string path) : obj_(obj), path_(std::move(path)) {}

  absl::Status CheckIsObject() const {
    if (obj_ == nullptr || obj_->is_object()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(path_, " must be an object, not ", JsonTypeName(obj_->type())));
  }
  bool present() const { return obj_ != nullptr; }
  std::string Path(absl::string_view key) const {
    return path_.empty() ? std::string(key) : absl::StrCat(path_, ".", key);
  }
  const Json* Get(absl::string_view key) {
    if (obj_ == nullptr) return nullptr;
    read_.insert(std::string(key));
    return obj_->Find(key);
  }
  // A number in [lo, hi]; `fallback` when absent.
  absl::Status Number(absl::string_view key, double lo, double hi, double* out,
                      bool required = false) {
    const Json* v = Get(key);
    if (v == nullptr) {
      if (required) return absl::InvalidArgumentError(absl::StrCat(Path(key), " is missing"));
      return absl::OkStatus();
    }
    if (!v->is_number()) {
      return absl::InvalidArgumentError(
          absl::StrCat(Path(key), " must be a number, not ", JsonTypeName(v->type())));
    }
    if (!(v->number() >= lo && v->number() <= hi)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s = %.10g is outside [%.10g, %.10g]", Path(key), v->number(), lo, hi));
    }
    *out = v->number();
    return absl::OkStatus();
  }
  absl::Status Int(absl::string_view key, int lo, int hi, int* out, bool required = false) {
    double d = *out;
    STEPMESH_RETURN_IF_ERROR(Number(key, lo, hi, &d, required));
    if (d != std::floor(d)) {
      return absl::InvalidArgumentError(absl::StrCat(Path(key), " must be an integer, not ", d));
    }
    *out = static_cast<int>(d);
    return absl::OkStatus();
  }
  absl::Status String(absl::string_view key, std::string* out) {
    const Json* v = Get(key);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(Path(key), " must be a string, not ", JsonTypeName(v->type())));
    }
    *out = v->string();
    return absl::OkStatus();
  }
  absl::Status CheckAllRead() const {
    if (obj_ == nullptr) return absl::OkStatus();
    std::vector<std::string> unknown;
    for (const auto& [k, v] : obj_->object()) {
      if (!read_.count(k)) unknown.push_back(Path(k));
    }
    if (unknown.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("unknown key(s): ", absl::StrJoin(unknown, ", ")));
  }

 private:
  const Json* obj_;
  std::string path_;
  std::set<std::string> read_;
};

}  // namespace stepmesh::planner
