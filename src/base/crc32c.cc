#include "src/base/crc32c.h"

#include <cstring>

namespace stepmesh::base {
namespace {

struct Crc32cTable {
  uint32_t entries[256];
  constexpr Crc32cTable() : entries() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0x82F63B78u ^ (c >> 1) : c >> 1;
      entries[i] = c;
    }
  }
};
constexpr Crc32cTable kCrcTable;

uint32_t Crc32cPortable(const uint8_t* p, size_t bytes, uint32_t crc) {
  for (size_t i = 0; i < bytes; ++i) crc = kCrcTable.entries[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// SSE4.2 has CRC32C in hardware: ~20x faster than the table on a 100-byte header.
__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(const uint8_t* p, size_t bytes,
                                                       uint32_t crc) {
  uint64_t c = crc;
  for (; bytes >= 8; bytes -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; bytes > 0; --bytes, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return c32;
}
const bool kHaveSse42 = __builtin_cpu_supports("sse4.2");
#endif

}  // namespace

uint32_t Crc32c(const void* data, size_t bytes, uint32_t seed) {
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  if (kHaveSse42) return ~Crc32cSse42(p, bytes, ~seed);
#endif
  return ~Crc32cPortable(p, bytes, ~seed);
}

}  // namespace stepmesh::base
