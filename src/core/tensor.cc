#include "stepmesh/tensor.h"

#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "src/base/enum_names.h"

namespace stepmesh {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kUInt8:
    case DType::kFloat8E4M3:
      return 1;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt32:
    case DType::kFloat32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

namespace {

// DType's names from its first value, kUInt8 (1).
constexpr absl::string_view kDTypeNames[] = {"uint8",   "int32",    "int64",      "float32",
                                             "float16", "bfloat16", "float8_e4m3"};
static_assert(std::size(kDTypeNames) == static_cast<size_t>(DType::kFloat8E4M3));

}  // namespace

absl::string_view DTypeName(DType dtype) {
  return base::NameOf(kDTypeNames, dtype, "invalid", DType::kUInt8);
}

bool IsValidDType(uint8_t raw) {
  return raw >= static_cast<uint8_t>(DType::kUInt8) &&
         raw <= static_cast<uint8_t>(DType::kFloat8E4M3);
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  return base::ParseName(kDTypeNames, "dtype", name, DType::kUInt8);
}

std::string DeviceName(const Device& device) {
  return device.kind == DeviceKind::kCpu ? std::string("cpu") : absl::StrCat("cuda:", device.index);
}

Shape::Shape(std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) {
    if (rank_ == kMaxDims) break;  // Make() is the checked path; literals are ours
    dims_[rank_++] = d;
  }
}

absl::StatusOr<Shape> Shape::Make(const int64_t* dims, int rank) {
  if (rank < 0 || rank > kMaxDims) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " exceeds ", kMaxDims));
  }
  Shape shape;
  for (int i = 0; i < rank; ++i) {
    if (dims[i] < 0) return absl::InvalidArgumentError("negative dimension");
    shape.dims_[i] = dims[i];
  }
  shape.rank_ = rank;
  return shape;
}

int64_t Shape::elements() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

bool operator==(const Shape& a, const Shape& b) {
  if (a.rank_ != b.rank_) return false;
  for (int i = 0; i < a.rank_; ++i) {
    if (a.dims_[i] != b.dims_[i]) return false;
  }
  return true;
}

std::string Shape::ToString() const {
  return absl::StrCat("[", absl::StrJoin(dims_.begin(), dims_.begin() + rank_, ", "), "]");
}

TensorView BytesView(void* data, size_t bytes, Device device) {
  return TensorView{data, DType::kUInt8, Shape{static_cast<int64_t>(bytes)}, device};
}

}  // namespace stepmesh
