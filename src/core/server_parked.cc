// ServerLogic's parked pushes: pushes that arrived before their key (or pull
// key) was registered here, set aside by the receive thread until the
// registration or their deadline (src/core/server_logic.h).

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/base/logging.h"
#include "src/core/chrome_trace.h"
#include "src/core/mesh.h"
#include "src/core/server_logic.h"
#include "stepmesh/status.h"

namespace stepmesh::core {

namespace {

// What a worker may keep parked on one server (pushes whose key, or pull key,
// is not registered there yet): frames and payload bytes. Beyond either, its
// next such push is refused at once.
constexpr size_t kMaxParkedPerWorker = 16;
constexpr size_t kMaxParkedBytesPerWorker = size_t{64} << 20;
// How often the receive thread looks at parked pushes when nothing else
// happened (their deadlines, their senders' losses).
constexpr absl::Duration kParkedCheck = absl::Milliseconds(10);

}  // namespace

absl::Status ServerLogic::Park(int w, const FrameHeader& h, Destination& out, PushNote& note) {
  if (parked_[w].size() >= kMaxParkedPerWorker ||
      parked_bytes_[w] + h.payload_bytes > kMaxParkedBytesPerWorker) {
    return absl::NotFoundError(absl::StrCat(MissingRegistration(w, h), " (", parked_[w].size(),
                                            " of worker ", w, "'s pushes, ", parked_bytes_[w],
                                            " bytes, already wait for registrations here)"));
  }
  note.park.reset(h.payload_bytes > 0 ? new std::byte[h.payload_bytes] : nullptr);
  note.parking = true;
  out = Destination{note.park.get(), h.payload_bytes, 0};
  return absl::OkStatus();
}

absl::Duration ServerLogic::ParkWait() const { return options_.timeout / 2; }

void ServerLogic::AfterPoll() {
  if (parked_total_ == 0) return;
  const absl::Time now = absl::Now();
  if (!registered_.exchange(false, std::memory_order_acq_rel) && now < next_parked_check_) {
    return;
  }
  next_parked_check_ = now + kParkedCheck;
  for (int w = 0; w < options_.num_workers; ++w) {
    std::deque<ParkedPush>& queue = parked_[w];
    const uint32_t epoch = rejoins_.epoch(w);
    for (size_t i = 0; i < queue.size();) {
      ParkedPush& p = queue[i];
      if (lost_.lost(w) || p.epoch != epoch) {  // its sender is gone: nothing is owed
        if (p.reg != nullptr) p.reg->busy[w].store(false);
        Unpark(w, i);
        continue;
      }
      RecvRegistration* reg = p.reg;
      Destination out;
      absl::Status status;
      bool keep = false;
      {
        base::ReaderMutexLock lock(&reg_mu_);
        auto it = recv_regs_.find(p.header.key);
        if (reg != nullptr) {
          if (PullRegistered(p.header, *reg, w)) {
            // Delivered as it is: its payload is in its slot.
          } else if (now >= p.deadline) {
            status = ParkTimedOut(w, p.header);
          } else {
            keep = true;
          }
        } else if (it != recv_regs_.end() && PullRegistered(p.header)) {
          PushNote note;  // not notes_[w]: a frame of `w` may be half-received
          note.worker = w;
          status = Admit(w, p.header, *it->second, out, note);
          reg = std::exchange(note.reg, nullptr);
          if (std::exchange(note.duplicate, false)) {
            Unpark(w, i);
            continue;
          }
        } else if (now >= p.deadline) {
          status = ParkTimedOut(w, p.header);
        } else {
          keep = true;
        }
      }
      if (keep) {
        ++i;
        continue;
      }
      if (status.ok() && p.reg == nullptr && p.header.payload_bytes > 0) {
        std::memcpy(out.data, p.payload.get(), p.header.payload_bytes);
      }
      const FrameHeader h = p.header;
      Unpark(w, i);
      Deliver(node_.PeerId(w), w, h, reg, std::move(status));
    }
  }
}

absl::Status ServerLogic::ParkTimedOut(int w, const FrameHeader& h) const {
  return absl::NotFoundError(absl::StrCat(MissingRegistration(w, h), " (waited ",
                                          absl::FormatDuration(ParkWait()),
                                          " for its registration)"));
}

void ServerLogic::Unpark(int w, size_t i) {
  if (parked_[w][i].reg == nullptr) parked_bytes_[w] -= parked_[w][i].header.payload_bytes;
  parked_[w].erase(parked_[w].begin() + static_cast<std::ptrdiff_t>(i));
  if (--parked_total_ == 0) parked_any_.store(false, std::memory_order_release);
}

}  // namespace stepmesh::core
