#include "src/tools/planner/json.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace stepmesh::planner {

Json Json::Number(double v) {
  Json j;
  j.type_ = Type::kNumber;
  j.number_ = v;
  return j;
}

Json Json::String(std::string v) {
  Json j;
  j.type_ = Type::kString;
  j.string_ = std::move(v);
  return j;
}

Json Json::Merge(const Json& base, const Json& patch) {
  if (!base.is_object() || !patch.is_object()) return patch;
  Json out = base;
  for (const auto& [key, value] : patch.object_) {
    auto it = std::find_if(out.object_.begin(), out.object_.end(),
                           [&](const auto& kv) { return kv.first == key; });
    if (it == out.object_.end())
      out.object_.emplace_back(key, value);
    else
      it->second = Merge(it->second, value);
  }
  return out;
}

const Json* Json::Find(absl::string_view key) const {
  if (type_ != Type::kObject) return nullptr;
  for (const auto& [k, v] : object_) {
    if (k == key) return &v;
  }
  return nullptr;
}

const char* JsonTypeName(Json::Type type) {
  // What the errors call each type, in the enum's order.
  static constexpr std::pair<Json::Type, const char*> kNames[] = {
      {Json::Type::kNull, "null"},       {Json::Type::kBool, "a boolean"},
      {Json::Type::kNumber, "a number"}, {Json::Type::kString, "a string"},
      {Json::Type::kArray, "an array"},  {Json::Type::kObject, "an object"}};
  for (const auto& [t, name] : kNames) {
    if (t == type) return name;
  }
  return "?";
}

// Recursive descent over the text; every error carries line:column.
class JsonParser {
 public:
  explicit JsonParser(absl::string_view text) : text_(text) {}

  absl::StatusOr<Json> Document() {
    Json value;
    if (absl::Status s = Value(&value, 0); !s.ok()) return s;
    SkipSpace();
    if (pos_ != text_.size()) return Error("trailing characters after the JSON value");
    return value;
  }

 private:
  static constexpr int kMaxDepth = 200;

  absl::Status Error(absl::string_view what) const {
    int line = 1, column = 1;
    for (size_t i = 0; i < pos_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("JSON line ", line, " column ", column, ": ", what));
  }

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool Literal(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  absl::Status Value(Json* out, int depth) {
    if (depth > kMaxDepth) return Error("nesting deeper than 200");
    SkipSpace();
    if (pos_ >= text_.size()) return Error("unexpected end of input, expected a value");
    const char c = text_[pos_];
    if (c == '{') return Object(out, depth);
    if (c == '[') return Array(out, depth);
    if (c == '"') {
      out->type_ = Json::Type::kString;
      return String(&out->string_);
    }
    if (c == '-' || (c >= '0' && c <= '9')) return Number(out);
    if (Literal("true")) {
      out->type_ = Json::Type::kBool;
      out->boolean_ = true;
      return absl::OkStatus();
    }
    if (Literal("false")) {
      out->type_ = Json::Type::kBool;
      out->boolean_ = false;
      return absl::OkStatus();
    }
    if (Literal("null")) {
      out->type_ = Json::Type::kNull;
      return absl::OkStatus();
    }
    return Error(absl::StrCat("unexpected character '", std::string(1, c), "'"));
  }

  // Skips white space, then `c` if it comes next: whether it did.
  bool Take(char c) {
    SkipSpace();
    if (pos_ >= text_.size() || text_[pos_] != c) return false;
    ++pos_;
    return true;
  }

  absl::Status Object(Json* out, int depth) {
    out->type_ = Json::Type::kObject;
    ++pos_;  // '{'
    if (Take('}')) return absl::OkStatus();
    for (;;) {
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != '"') return Error("expected a quoted object key");
      std::string key;
      if (absl::Status s = String(&key); !s.ok()) return s;
      if (!Take(':')) return Error("expected ':' after an object key");
      Json value;
      if (absl::Status s = Value(&value, depth + 1); !s.ok()) return s;
      out->object_.emplace_back(std::move(key), std::move(value));
      if (Take(',')) continue;
      if (Take('}')) return absl::OkStatus();
      return Error("expected ',' or '}' in an object");
    }
  }

  absl::Status Array(Json* out, int depth) {
    out->type_ = Json::Type::kArray;
    ++pos_;  // '['
    if (Take(']')) return absl::OkStatus();
    for (;;) {
      Json value;
      if (absl::Status s = Value(&value, depth + 1); !s.ok()) return s;
      out->array_.push_back(std::move(value));
      if (Take(',')) continue;
      if (Take(']')) return absl::OkStatus();
      return Error("expected ',' or ']' in an array");
    }
  }

  absl::Status Number(Json* out) {
    const size_t start = pos_;
    if (text_[pos_] == '-') ++pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      return pos_ - from;
    };
    const size_t int_start = pos_;
    if (digits() == 0) return Error("a number needs digits");
    if (text_[int_start] == '0' && pos_ - int_start > 1)
      return Error("a number has a leading zero");
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      if (digits() == 0) return Error("a number needs digits after '.'");
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (digits() == 0) return Error("a number needs digits in its exponent");
    }
    double v = 0.0;
    const auto [end, ec] = std::from_chars(text_.data() + start, text_.data() + pos_, v);
    if (ec != std::errc() || end != text_.data() + pos_ || !std::isfinite(v)) {
      pos_ = start;
      return Error("number out of range");
    }
    out->type_ = Json::Type::kNumber;
    out->number_ = v;
    return absl::OkStatus();
  }

  static void AppendUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  absl::Status Hex4(uint32_t* out) {
    if (pos_ + 4 > text_.size()) return Error("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= c - '0';
      else if (c >= 'a' && c <= 'f')
        v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        v |= c - 'A' + 10;
      else
        return Error("bad hex digit in a \\u escape");
    }
    *out = v;
    return absl::OkStatus();
  }

  absl::Status String(std::string* out) {
    ++pos_;  // '"'
    for (;;) {
      if (pos_ >= text_.size()) return Error("unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return absl::OkStatus();
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in a string");
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= text_.size()) return Error("unterminated escape");
      const char e = text_[pos_++];
      if (e == 'u') {
        if (absl::Status s = CodePoint(out); !s.ok()) return s;
        continue;
      }
      // The single-character escapes (RFC 8259 section 7): escape, then what it means.
      static constexpr std::string_view kEscaped = "\"\\/bfnrt";
      static constexpr std::string_view kMeaning = "\"\\/\b\f\n\r\t";
      const size_t at = kEscaped.find(e);
      if (at == std::string_view::npos) {
        return Error(absl::StrCat("bad escape '\\", std::string(1, e), "'"));
      }
      out->push_back(kMeaning[at]);
    }
  }

  // After "\\u": four hex digits, or a surrogate pair of two such escapes,
  // appended as UTF-8.
  absl::Status CodePoint(std::string* out) {
    uint32_t cp = 0;
    if (absl::Status s = Hex4(&cp); !s.ok()) return s;
    if (cp >= 0xD800 && cp < 0xDC00) {
      uint32_t low = 0;
      if (!Literal("\\u")) return Error("a high surrogate must be followed by \\u");
      if (absl::Status s = Hex4(&low); !s.ok()) return s;
      if (low < 0xDC00 || low >= 0xE000) return Error("bad low surrogate");
      cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
    } else if (cp >= 0xDC00 && cp < 0xE000) {
      return Error("unpaired low surrogate");
    }
    AppendUtf8(cp, out);
    return absl::OkStatus();
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

absl::StatusOr<Json> Json::Parse(absl::string_view text) { return JsonParser(text).Document(); }

}  // namespace stepmesh::planner
