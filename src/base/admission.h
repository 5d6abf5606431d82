#pragma once
// Admission of connections that have not proved who they are yet (the
// scheduler's joins, a data listener's handshakes): each costs a descriptor
// until its deadline, so their number is capped per source address and in
// total. A newcomer over a cap evicts the oldest waiting one: a flood of idle
// clients evicts itself, while a real peer's handshake (a round trip) is done
// long before it is the oldest.

#include <cstddef>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "src/base/net.h"

namespace stepmesh::base {

struct AdmissionCaps {
  size_t per_address;
  size_t total;
};

// The caps of a listener that expects `peers` to handshake with it, maybe all
// at once and from one address (every participant on one host, started
// together on a loaded machine): at least `floor`, and room for every
// expected peer plus floor.per_address strangers besides.
inline AdmissionCaps CapsForPeers(size_t peers, AdmissionCaps floor) {
  return {peers > floor.per_address ? peers : floor.per_address,
          peers + floor.per_address > floor.total ? peers + floor.per_address : floor.total};
}

// The waiting entry to drop before admitting one more from `address` (null
// when both caps leave room) and, through `*why`, the cap it exceeds.
// `waiting(e)` says whether entry `e` of `entries` (oldest first) still
// counts; `address_of(e)` is its PeerAddress.
template <typename Entries, typename Waiting, typename AddressOf>
auto OldestOverCap(Entries& entries, Waiting waiting, AddressOf address_of,
                   absl::string_view address, const AdmissionCaps& caps, std::string* why)
    -> decltype(&*entries.begin()) {
  const absl::string_view host = AddressHost(address);
  size_t total = 0, same = 0;
  decltype(&*entries.begin()) oldest = nullptr;
  decltype(&*entries.begin()) oldest_same = nullptr;
  for (auto& e : entries) {
    if (!waiting(e)) continue;
    ++total;
    if (oldest == nullptr) oldest = &e;
    if (AddressHost(address_of(e)) == host) {
      ++same;
      if (oldest_same == nullptr) oldest_same = &e;
    }
  }
  if (same >= caps.per_address) {
    *why = absl::StrCat("more than ", caps.per_address,
                        " unfinished handshakes from one address (the oldest is dropped)");
    return oldest_same;
  }
  if (total >= caps.total) {
    *why = absl::StrCat("more than ", caps.total,
                        " unfinished handshakes at once (the oldest is dropped)");
    return oldest;
  }
  return nullptr;
}

}  // namespace stepmesh::base
