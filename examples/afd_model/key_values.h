#pragma once
// The `key = value` model config files (configs/*.cfg) of both example
// models: one parser, typed reads that collect every missing key and keep the
// first malformed value, and the layer-list syntax of `moe_layers_enum`.

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace afd {

class KeyValues {
 public:
  // Lines are `key = value`; `#` starts a comment; blank lines are skipped.
  // False with `*error` naming the line when a line has no `=`.
  bool Parse(std::string_view text, std::string* error);

  // The value under `key`, or null after recording `key` as missing.
  const std::string* Find(const char* key);

  // Typed reads: a missing key is recorded (see Problem), a malformed value
  // records "bad <kind> for <key>" (the first one wins); `*field` is changed
  // only by a good value.
  template <typename T>
  void Int(const char* key, T* field) {
    int64_t parsed = 0;
    if (ReadInt(key, &parsed)) *field = static_cast<T>(parsed);
  }
  void Unsigned(const char* key, uint64_t* field);
  void Float(const char* key, float* field);
  void Bool(const char* key, bool* field);

  // "missing keys: a, b" when keys were missing, else the first bad value,
  // else empty.
  std::string Problem() const;

 private:
  bool ReadInt(const char* key, int64_t* value);
  void Bad(const char* key, const char* kind);

  std::map<std::string, std::string, std::less<>> values_;
  std::string missing_;
  std::string bad_;
};

// `moe_layers_enum`: layer ids and inclusive ranges "a-b", comma separated;
// sets `(*flags)[l]` for each listed layer of `num_layers`. False with
// `*error` naming the entry that is malformed or out of range.
bool ParseLayerList(std::string_view text, int num_layers, std::vector<bool>* flags,
                    std::string* error);

}  // namespace afd
