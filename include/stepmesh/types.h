#pragma once
// Names shared by the worker and the server APIs.

#include <cstddef>
#include <cstdint>

namespace stepmesh {

class Event;

using Key = uint64_t;
inline constexpr size_t kWholeTensor = ~size_t{0};

struct SendOptions {
  // The send waits (on the send thread) until this event completes; it must
  // live until then. Pending longer than MeshOptions::timeout, or failing
  // (a device fault), it fails the request.
  Event* ready = nullptr;
};

}  // namespace stepmesh
