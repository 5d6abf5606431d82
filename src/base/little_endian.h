#pragma once
// The one little-endian codec of every wire format (frames, control messages,
// the data-connection handshake, RDMA bootstrap messages). Explicit byte
// order, never a struct cast, so peers never depend on layout or host order;
// compilers turn the byte loops into single loads and stores on x86.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace stepmesh::base {

template <typename T>
void StoreLittleEndian(void* out, T value) {
  static_assert(std::is_integral_v<T> || std::is_enum_v<T>);
  auto* p = static_cast<std::byte*>(out);
  const uint64_t v = static_cast<uint64_t>(value);
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFF);
}

template <typename T>
T LoadLittleEndian(const void* in) {
  static_assert(std::is_integral_v<T> || std::is_enum_v<T>);
  const auto* p = static_cast<const std::byte*>(in);
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return static_cast<T>(v);
}

// Appends `value` to a growing message.
template <typename T>
void AppendLittleEndian(std::string& out, T value) {
  char bytes[sizeof(T)];
  StoreLittleEndian(bytes, value);
  out.append(bytes, sizeof(T));
}

// Writes fields one after another into a buffer the caller sized.
class ByteWriter {
 public:
  explicit ByteWriter(std::byte* out) : begin_(out), p_(out) {}
  template <typename T>
  void Put(T value) {
    StoreLittleEndian(p_, value);
    p_ += sizeof(T);
  }
  void Bytes(const void* data, size_t n) {
    std::memcpy(p_, data, n);
    p_ += n;
  }
  size_t size() const { return static_cast<size_t>(p_ - begin_); }

 private:
  std::byte* begin_;
  std::byte* p_;
};

// Reads fields one after another from untrusted bytes: every read is bounds
// checked and a short one fails (returns false) without reading.
class ByteReader {
 public:
  ByteReader(const void* in, size_t n) : p_(static_cast<const std::byte*>(in)), end_(p_ + n) {}
  template <typename T>
  bool Get(T& value) {
    if (remaining() < sizeof(T)) return false;
    value = LoadLittleEndian<T>(p_);
    p_ += sizeof(T);
    return true;
  }
  bool Bytes(void* data, size_t n) {
    if (remaining() < n) return false;
    std::memcpy(data, p_, n);
    p_ += n;
    return true;
  }
  // The next `n` bytes without copying them; nullptr when fewer remain.
  const std::byte* Take(size_t n) {
    if (remaining() < n) return nullptr;
    const std::byte* at = p_;
    p_ += n;
    return at;
  }
  size_t remaining() const { return static_cast<size_t>(end_ - p_); }
  bool done() const { return p_ == end_; }

 private:
  const std::byte* p_;
  const std::byte* end_;
};

}  // namespace stepmesh::base
