#pragma once
// What the two device engines (afd_engine_device_attention.cc,
// afd_engine_device_ffn.cc) share: weight specs, the arena their device
// allocations live in, and the KV cache format a run shape names.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/attention_side.h"
#include "examples/afd_model/model_weights.h"
#include "stepmesh/stepmesh.h"

namespace afd::example::device_engine {

using stepmesh::Memory;
using stepmesh::MemoryKind;

inline TensorSpec LinearSpec(std::string name, int64_t fan_in) {
  return {std::move(name), WeightKind::kLinear, fan_in};
}
inline TensorSpec GammaSpec(std::string name) {
  return {std::move(name), WeightKind::kNormGamma, 1};
}

// Owns device allocations; hands out typed pointers.
class Arena {
 public:
  explicit Arena(stepmesh::Backend& backend) : backend_(backend) {}
  template <typename T>
  absl::StatusOr<T*> Take(int64_t count, MemoryKind kind = MemoryKind::kDevice) {
    STEPMESH_ASSIGN_OR_RETURN(
        std::unique_ptr<Memory> m,
        backend_.Allocate(std::max<size_t>(sizeof(T) * static_cast<size_t>(count), 16), kind));
    T* p = static_cast<T*>(m->data());
    memory_.push_back(std::move(m));
    return p;
  }
  // Host data to a new device array (start-up only: a synchronous copy).
  template <typename T>
  absl::StatusOr<T*> Upload(const std::vector<T>& values) {
    STEPMESH_ASSIGN_OR_RETURN(T * p, Take<T>(static_cast<int64_t>(values.size())));
    if (!values.empty()) {
      STEPMESH_RETURN_IF_ERROR(backend_.Copy(p, values.data(), sizeof(T) * values.size()));
    }
    return p;
  }

 private:
  stepmesh::Backend& backend_;
  std::vector<std::unique_ptr<Memory>> memory_;
};

inline KvCacheFormat KvFormatOf(const RunShape& shape) {
  KvCacheFormat format = KvCacheFormat::kFp32;
  ParseKvCacheFormat(shape.kv_cache, &format);
  return format;
}

}  // namespace afd::example::device_engine
