#pragma once
// The `key = value` model config files (configs/*.cfg) of both example
// models: one parser, typed reads that collect every missing key and keep the
// first malformed value, and the layer-list syntax of `moe_layers_enum`.

#include <cstdint>
#include <map>
#include <optional>
#include <span>
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

// A bundled config: the name a flag gives and its file in the config
// directory.
struct BundledConfig {
  std::string_view name;
  std::string_view file;
};

// True when `name` is one of `bundled`.
bool IsBundledConfig(std::span<const BundledConfig> bundled, std::string_view name);

// The file `name_or_path` stands for: `config_dir`/file of the bundled config
// of that name, else `name_or_path` itself.
std::string ConfigPath(std::span<const BundledConfig> bundled, const std::string& name_or_path,
                       const std::string& config_dir);

// The whole text of `path`; false with `*error` (if non-null) "cannot open
// PATH".
bool ReadConfigText(const std::string& path, std::string* text, std::string* error);

// Reads `path` and parses it with `parse`; on failure nullopt and `*error`
// (if non-null) says why, naming the file.
template <typename Config>
std::optional<Config> LoadConfigFile(const std::string& path, std::string* error,
                                     std::optional<Config> (*parse)(std::string_view,
                                                                    std::string*)) {
  std::string text;
  if (!ReadConfigText(path, &text, error)) return std::nullopt;
  std::string parse_error;
  std::optional<Config> config = parse(text, &parse_error);
  if (!config && error != nullptr) *error = path + ": " + parse_error;
  return config;
}

}  // namespace afd
