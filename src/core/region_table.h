#pragma once
// Bookkeeping of registered memory ranges, so that a remotely writable range
// can never alias another registration (two peers' writes, or a write and a
// push in flight, would otherwise corrupt each other silently).

#include <cstddef>
#include <cstdint>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace stepmesh::core {

class RegionTable {
 public:
  // Adds [base, base + bytes). Refuses an overlap that involves a writable range.
  absl::Status Add(const void* base, size_t bytes, bool remote_writable, uint64_t key) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(base);
    const uintptr_t end = begin + bytes;
    if (end < begin) return absl::InvalidArgumentError("tensor wraps the address space");
    for (const auto& [other_begin, range] : ranges_) {
      if (other_begin >= end || range.end <= begin) continue;
      if (remote_writable || range.writable) {
        return absl::InvalidArgumentError(absl::StrCat("tensor for key ", key,
                                                       " overlaps the tensor of key ", range.key,
                                                       " and one of them receives remote writes"));
      }
    }
    ranges_.emplace(begin, Range{end, remote_writable, key});
    return absl::OkStatus();
  }

  void Remove(const void* base, uint64_t key) {
    auto [first, last] = ranges_.equal_range(reinterpret_cast<uintptr_t>(base));
    for (auto it = first; it != last; ++it) {
      if (it->second.key == key) {
        ranges_.erase(it);
        return;
      }
    }
  }

 private:
  struct Range {
    uintptr_t end;
    bool writable;
    uint64_t key;
  };
  std::multimap<uintptr_t, Range> ranges_;  // registration is rare: a linear scan is fine
};

}  // namespace stepmesh::core
