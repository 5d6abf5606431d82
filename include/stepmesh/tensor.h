#pragma once
// Tensor views: a typed, shaped window on memory the caller owns.

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "stepmesh/export.h"

namespace stepmesh {

// Wire-stable values: they travel in frames, so never renumber.
enum class DType : uint8_t {
  kUInt8 = 1,
  kInt32 = 2,
  kInt64 = 3,
  kFloat32 = 4,
  kFloat16 = 5,
  kBFloat16 = 6,
  kFloat8E4M3 = 7,
};

STEPMESH_EXPORT size_t DTypeSize(DType dtype);
STEPMESH_EXPORT absl::string_view DTypeName(DType dtype);
STEPMESH_EXPORT absl::StatusOr<DType> ParseDType(absl::string_view name);
STEPMESH_EXPORT bool IsValidDType(uint8_t raw);

enum class DeviceKind : uint8_t { kCpu = 0, kCuda = 1 };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;

  static Device Cpu() { return {DeviceKind::kCpu, 0}; }
  static Device Cuda(int index) { return {DeviceKind::kCuda, index}; }
  friend bool operator==(const Device&, const Device&) = default;
};
STEPMESH_EXPORT std::string DeviceName(const Device& device);

// Up to kMaxDims dimensions, stored inline so a view never allocates.
class STEPMESH_EXPORT Shape {
 public:
  static constexpr int kMaxDims = 8;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  static absl::StatusOr<Shape> Make(const int64_t* dims, int rank);

  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[i]; }
  int64_t elements() const;
  friend STEPMESH_EXPORT bool operator==(const Shape& a, const Shape& b);
  std::string ToString() const;

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int rank_ = 0;
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kUInt8;
  Shape shape;
  Device device;

  size_t bytes() const { return static_cast<size_t>(shape.elements()) * DTypeSize(dtype); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

// A view of `bytes` raw bytes (dtype uint8, rank 1).
STEPMESH_EXPORT TensorView BytesView(void* data, size_t bytes, Device device = Device::Cpu());

}  // namespace stepmesh
