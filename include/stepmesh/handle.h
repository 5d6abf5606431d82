#pragma once
// Typed, generation-checked handles: a stale or foreign handle is an error,
// never a silent alias of a newer request.

#include <cstdint>

namespace stepmesh {

template <typename Tag>
class TypedHandle {
 public:
  constexpr TypedHandle() = default;
  constexpr TypedHandle(uint32_t index, uint32_t generation)
      : index_(index), generation_(generation) {}
  constexpr uint32_t index() const { return index_; }
  constexpr uint32_t generation() const { return generation_; }
  constexpr bool valid() const { return generation_ != 0; }  // generation 0 is never issued
  friend constexpr bool operator==(TypedHandle, TypedHandle) = default;

 private:
  uint32_t index_ = 0;
  uint32_t generation_ = 0;
};

struct RequestTag;
struct BatchTag;
using RequestHandle = TypedHandle<RequestTag>;  // an AFTensorWorker::PushPull
using BatchHandle = TypedHandle<BatchTag>;      // an AFTensorServer batch

}  // namespace stepmesh
