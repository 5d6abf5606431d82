#pragma once
// Growing the fixed rings the transports queue frames in (a peer's frames
// waiting for its socket or its credits, the frames kept until a peer
// acknowledges them): a ring grows only while a peer is slow, so steady
// state never allocates.

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace stepmesh::base {

// Moves the `count` entries of `ring` that start at `head` (circularly) into
// a ring twice the size -- at least `initial`, at most `max` --, oldest at
// index 0, and sets `head` to 0.
template <typename T>
void GrowRing(std::vector<T>& ring, size_t& head, size_t count, size_t initial, size_t max) {
  std::vector<T> bigger(std::min(max, std::max<size_t>(ring.size() * 2, initial)));
  for (size_t i = 0; i < count; ++i) bigger[i] = std::move(ring[(head + i) % ring.size()]);
  ring = std::move(bigger);
  head = 0;
}

}  // namespace stepmesh::base
