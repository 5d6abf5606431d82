#pragma once
// Names shared by the worker and the server APIs.

#include <cstddef>
#include <cstdint>
#include <optional>

namespace stepmesh {

class Event;

using Key = uint64_t;
inline constexpr size_t kWholeTensor = ~size_t{0};

struct SendOptions {
  // The send waits (on the send thread) until this event completes; it must
  // live until then. Pending longer than MeshOptions::timeout, or failing
  // (a device fault), it fails the request.
  Event* ready = nullptr;
  // The micro-batch stage this request belongs to: servers batch requests of
  // the same stage together, whatever their push keys (the workers of one
  // stage may push different keys). Unset: the request's first push key names
  // its batch. Stages and first-push-key groups share Batch::group's space, so
  // a mesh uses one way or the other.
  std::optional<uint32_t> stage;
};

}  // namespace stepmesh
