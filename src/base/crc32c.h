#pragma once
// CRC32C (Castagnoli), the checksum of frame headers and, optionally, of
// payloads (payload_checksum). Hardware-accelerated where SSE4.2 exists.

#include <cstddef>
#include <cstdint>

namespace stepmesh::base {

// `seed` chains: Crc32c(b, n2, Crc32c(a, n1)) is the CRC of a then b.
uint32_t Crc32c(const void* data, size_t bytes, uint32_t seed = 0);

}  // namespace stepmesh::base
