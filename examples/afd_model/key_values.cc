#include "examples/afd_model/key_values.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace afd {
namespace {

std::string_view Trim(std::string_view s) {
  const auto first = s.find_first_not_of(" \t\r");
  if (first == std::string_view::npos) return {};
  const auto last = s.find_last_not_of(" \t\r");
  return s.substr(first, last - first + 1);
}

// Whole-string integer (decimal, 0x hex or 0 octal, as strtoll base 0).
bool ParseInt(std::string_view text, int64_t* value) {
  const std::string owned(text);
  if (owned.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(owned.c_str(), &end, 0);
  if (errno != 0 || *end != '\0') return false;
  *value = parsed;
  return true;
}

}  // namespace

bool KeyValues::Parse(std::string_view text, std::string* error) {
  std::stringstream stream{std::string(text)};
  std::string line;
  int number = 0;
  while (std::getline(stream, line)) {
    ++number;
    std::string_view content = line;
    if (const auto hash = content.find('#'); hash != std::string_view::npos) {
      content = content.substr(0, hash);
    }
    content = Trim(content);
    if (content.empty()) continue;
    const auto equals = content.find('=');
    if (equals == std::string_view::npos) {
      *error = "line " + std::to_string(number) + ": expected key = value";
      return false;
    }
    values_[std::string(Trim(content.substr(0, equals)))] =
        std::string(Trim(content.substr(equals + 1)));
  }
  return true;
}

const std::string* KeyValues::Find(const char* key) {
  const auto it = values_.find(key);
  if (it != values_.end()) return &it->second;
  missing_ += std::string(missing_.empty() ? "" : ", ") + key;
  return nullptr;
}

bool KeyValues::ReadInt(const char* key, int64_t* value) {
  const std::string* text = Find(key);
  if (text == nullptr) return false;
  if (!ParseInt(*text, value)) {
    Bad(key, "integer");
    return false;
  }
  return true;
}

void KeyValues::Unsigned(const char* key, uint64_t* field) {
  const std::string* text = Find(key);
  if (text == nullptr) return;
  char* end = nullptr;
  errno = 0;
  const unsigned long long parsed = std::strtoull(text->c_str(), &end, 0);
  if (text->empty() || errno != 0 || *end != '\0') return Bad(key, "integer");
  *field = parsed;
}

void KeyValues::Float(const char* key, float* field) {
  const std::string* text = Find(key);
  if (text == nullptr) return;
  char* end = nullptr;
  const float parsed = std::strtof(text->c_str(), &end);
  if (text->empty() || *end != '\0' || !std::isfinite(parsed)) return Bad(key, "number");
  *field = parsed;
}

void KeyValues::Bool(const char* key, bool* field) {
  const std::string* text = Find(key);
  if (text == nullptr) return;
  if (*text == "1" || *text == "true") {
    *field = true;
  } else if (*text == "0" || *text == "false") {
    *field = false;
  } else {
    Bad(key, "boolean (0/1/true/false)");
  }
}

std::string KeyValues::Problem() const {
  if (!missing_.empty()) return "missing keys: " + missing_;
  return bad_;
}

void KeyValues::Bad(const char* key, const char* kind) {
  if (bad_.empty()) bad_ = std::string("bad ") + kind + " for " + key;
}

bool ParseLayerList(std::string_view text, int num_layers, std::vector<bool>* flags,
                    std::string* error) {
  flags->assign(num_layers, false);
  std::stringstream stream{std::string(text)};
  std::string item;
  while (std::getline(stream, item, ',')) {
    const std::string_view entry = Trim(item);
    if (entry.empty()) continue;
    int64_t first = 0;
    int64_t last = 0;
    const auto dash = entry.find('-');
    const bool ok = dash == std::string_view::npos
                        ? ParseInt(entry, &first) && ParseInt(entry, &last)
                        : ParseInt(Trim(entry.substr(0, dash)), &first) &&
                              ParseInt(Trim(entry.substr(dash + 1)), &last);
    if (!ok) {
      *error = "moe_layers_enum: bad entry '" + std::string(entry) + "'";
      return false;
    }
    if (first < 0 || last >= num_layers || first > last) {
      *error = "moe_layers_enum: '" + std::string(entry) + "' is outside 0.." +
               std::to_string(num_layers - 1);
      return false;
    }
    for (int64_t l = first; l <= last; ++l) (*flags)[l] = true;
  }
  return true;
}

bool IsBundledConfig(std::span<const BundledConfig> bundled, std::string_view name) {
  for (const BundledConfig& b : bundled) {
    if (name == b.name) return true;
  }
  return false;
}

std::string ConfigPath(std::span<const BundledConfig> bundled, const std::string& name_or_path,
                       const std::string& config_dir) {
  for (const BundledConfig& b : bundled) {
    if (name_or_path == b.name) return config_dir + "/" + std::string(b.file);
  }
  return name_or_path;
}

bool ReadConfigText(const std::string& path, std::string* text, std::string* error) {
  std::ifstream file(path);
  if (!file) {
    if (error != nullptr) *error = "cannot open " + path;
    return false;
  }
  std::stringstream contents;
  contents << file.rdbuf();
  *text = contents.str();
  return true;
}

}  // namespace afd
