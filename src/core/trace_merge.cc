// MergeChromeTraces: one Chrome trace of several participants' exports.
//
// The exports already share the scheduler's time axis and use distinct
// process ids, so merging is concatenating their "traceEvents" arrays. The
// inputs are scanned as JSON (not matched as our own text), so a file that
// went through another tool (pretty-printed, keys reordered) merges too.

#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "stepmesh/status.h"
#include "stepmesh/trace.h"

namespace stepmesh {
namespace {

// Finds the extent of JSON values without building them.
class Scanner {
 public:
  explicit Scanner(absl::string_view text) : text_(text) {}

  size_t pos() const { return pos_; }
  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' ||
                                   text_[pos_] == '\r' || text_[pos_] == '\t')) {
      ++pos_;
    }
  }
  bool AtEnd() {
    SkipSpace();
    return pos_ == text_.size();
  }
  bool Consume(char c) {
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  absl::Status Expect(char c) {
    if (Consume(c)) return absl::OkStatus();
    return Error(absl::StrCat("expected '", std::string(1, c), "'"));
  }
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(what, " at byte ", pos_));
  }

  // A string's contents (escapes left as written).
  absl::StatusOr<absl::string_view> String() {
    SkipSpace();
    if (pos_ >= text_.size() || text_[pos_] != '"') return Error("expected a string");
    const size_t start = ++pos_;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      if (text_[pos_] == '\\') ++pos_;
      if (static_cast<unsigned char>(text_[pos_]) < 0x20)
        return Error("control character in a string");
      ++pos_;
    }
    if (pos_ >= text_.size()) return Error("unterminated string");
    return text_.substr(start, pos_++ - start);
  }

  // Any value; returns its text. Nesting is bounded (hostile input).
  absl::StatusOr<absl::string_view> Value(int depth = 0) {
    if (depth > 64) return Error("nested deeper than 64");
    SkipSpace();
    const size_t start = pos_;
    if (pos_ >= text_.size()) return Error("expected a value");
    const char c = text_[pos_];
    if (c == '"') {
      if (absl::StatusOr<absl::string_view> s = String(); !s.ok()) return s.status();
    } else if (c == '{' || c == '[') {
      const char close = c == '{' ? '}' : ']';
      ++pos_;
      if (!Consume(close)) {
        do {
          if (c == '{') {
            if (absl::StatusOr<absl::string_view> k = String(); !k.ok()) return k.status();
            if (absl::Status s = Expect(':'); !s.ok()) return s;
          }
          if (absl::StatusOr<absl::string_view> v = Value(depth + 1); !v.ok()) return v.status();
        } while (Consume(','));
        if (absl::Status s = Expect(close); !s.ok()) return s;
      }
    } else {
      // A number or true/false/null.
      while (pos_ < text_.size() && (absl::ascii_isalnum(text_[pos_]) || text_[pos_] == '-' ||
                                     text_[pos_] == '+' || text_[pos_] == '.')) {
        ++pos_;
      }
      if (pos_ == start) return Error("expected a value");
    }
    return text_.substr(start, pos_ - start);
  }

 private:
  absl::string_view text_;
  size_t pos_ = 0;
};

// A JSON object or array, `text` whole: `open`, the items `read` scans one at
// a time (separated by ','), `close`; `what` names it in the error.
template <typename ReadItem>
absl::Status ScanList(absl::string_view text, char open, char close, absl::string_view what,
                      ReadItem read) {
  Scanner scan(text);
  if (absl::Status s = scan.Expect(open); !s.ok()) return s;
  if (!scan.Consume(close)) {
    do {
      if (absl::Status s = read(scan); !s.ok()) return s;
    } while (scan.Consume(','));
    if (absl::Status s = scan.Expect(close); !s.ok()) return s;
  }
  if (!scan.AtEnd()) return scan.Error(absl::StrCat("text after the ", what));
  return absl::OkStatus();
}

// The members of one JSON object, by key (the text of each value).
absl::StatusOr<std::vector<std::pair<absl::string_view, absl::string_view>>> Members(
    absl::string_view object) {
  std::vector<std::pair<absl::string_view, absl::string_view>> members;
  STEPMESH_RETURN_IF_ERROR(ScanList(object, '{', '}', "object", [&](Scanner& scan) {
    absl::StatusOr<absl::string_view> key = scan.String();
    if (!key.ok()) return key.status();
    if (absl::Status s = scan.Expect(':'); !s.ok()) return s;
    absl::StatusOr<absl::string_view> value = scan.Value();
    if (!value.ok()) return value.status();
    members.emplace_back(*key, *value);
    return absl::OkStatus();
  }));
  return members;
}

absl::StatusOr<std::vector<absl::string_view>> Elements(absl::string_view array) {
  std::vector<absl::string_view> elements;
  STEPMESH_RETURN_IF_ERROR(ScanList(array, '[', ']', "array", [&](Scanner& scan) {
    absl::StatusOr<absl::string_view> value = scan.Value();
    if (!value.ok()) return value.status();
    elements.push_back(*value);
    return absl::OkStatus();
  }));
  return elements;
}

absl::string_view Find(absl::Span<const std::pair<absl::string_view, absl::string_view>> members,
                       absl::string_view key) {
  for (const auto& [k, v] : members) {
    if (k == key) return v;
  }
  return {};
}

}  // namespace

absl::StatusOr<std::string> MergeChromeTraces(absl::Span<const std::string> traces) {
  if (traces.empty()) return absl::InvalidArgumentError("no traces to merge");
  std::string events;
  std::string participants;
  absl::flat_hash_map<std::string, size_t> seen;  // participant -> input index
  for (size_t i = 0; i < traces.size(); ++i) {
    const auto fail = [i](const absl::Status& s) {
      return absl::InvalidArgumentError(absl::StrCat("trace ", i, ": ", s.message()));
    };
    absl::StatusOr<std::vector<std::pair<absl::string_view, absl::string_view>>> top =
        Members(traces[i]);
    if (!top.ok()) return fail(top.status());
    const absl::string_view event_array = Find(*top, "traceEvents");
    if (event_array.empty()) return fail(absl::InvalidArgumentError("no \"traceEvents\" array"));
    absl::StatusOr<std::vector<absl::string_view>> list = Elements(event_array);
    if (!list.ok()) return fail(list.status());
    for (absl::string_view e : *list) absl::StrAppend(&events, events.empty() ? "" : ",\n", e);
    // Our exports name their participant; a merged file lists several.
    std::vector<absl::string_view> infos;
    const absl::string_view other = Find(*top, "otherData");
    if (!other.empty()) {
      absl::StatusOr<std::vector<std::pair<absl::string_view, absl::string_view>>> data =
          Members(other);
      if (!data.ok()) return fail(data.status());
      if (absl::string_view nested = Find(*data, "participants"); !nested.empty()) {
        absl::StatusOr<std::vector<absl::string_view>> each = Elements(nested);
        if (!each.ok()) return fail(each.status());
        infos = *each;
      } else if (!Find(*data, "participant").empty()) {
        infos.push_back(other);
      }
    }
    for (absl::string_view info : infos) {
      absl::StatusOr<std::vector<std::pair<absl::string_view, absl::string_view>>> data =
          Members(info);
      if (!data.ok()) return fail(data.status());
      const std::string name(Find(*data, "participant"));
      if (auto [it, added] = seen.emplace(name, i); !added) {
        return absl::InvalidArgumentError(absl::StrCat("participant ", name, " is in trace ",
                                                       it->second, " and trace ", i,
                                                       ": merge each process's trace once"));
      }
      absl::StrAppend(&participants, participants.empty() ? "" : ",\n", info);
    }
  }
  return absl::StrCat("{\"displayTimeUnit\":\"ns\",\n\"otherData\":{\"participants\":[\n",
                      participants, "]},\n\"traceEvents\":[\n", events, "\n]}\n");
}

}  // namespace stepmesh
