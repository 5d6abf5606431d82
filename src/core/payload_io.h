#pragma once
// How a registered tensor meets the transport, and the per-payload work on it:
// staging through pinned host memory where the transport cannot reach the
// tensor, flushing NIC writes into device memory, and the optional end-to-end
// payload checksum. Stateless beyond its backend and options: every thread
// that moves payloads (send and receive) uses the same one.

#include <cstddef>

#include "absl/status/status.h"
#include "src/core/frame.h"
#include "src/core/transport.h"
#include "stepmesh/backend.h"

namespace stepmesh::core {

// A registered tensor as the transport sees it: in place (`wire` is the
// tensor), or staged through a pinned host copy the transport can reach.
struct WireTensor {
  RegionId region = 0;
  std::byte* wire = nullptr;
  bool staged = false;
  bool device_direct = false;  // device memory the NIC reads and writes (GPUDirect)
};

class PayloadIo {
 public:
  // `backend` must outlive this object.
  PayloadIo(Backend& backend, bool payload_checksum)
      : backend_(backend), payload_checksum_(payload_checksum) {}

  // Copies between a staged tensor and its wire copy (no-ops when not staged):
  // before a send, and after an arrival. Synchronous, on the calling thread.
  // After an arrival into device memory the NIC wrote directly, StageIn makes
  // those writes visible to the device's streams instead.
  absl::Status StageOut(const WireTensor& t, const void* tensor, size_t offset, size_t bytes) const;
  absl::Status StageIn(const WireTensor& t, void* tensor, size_t offset, size_t bytes) const;

  // options.payload_checksum: seals a data frame whose payload `src` (in `t`'s
  // wire memory) this host can read, and checks an arrival at `landed` against
  // a sealed frame. Device memory the NIC reads or writes directly is skipped.
  void Seal(FrameHeader& h, const WireTensor& t, const std::byte* src) const;
  absl::Status Check(const FrameHeader& h, const WireTensor& t, const std::byte* landed) const;

 private:
  Backend& backend_;
  const bool payload_checksum_;
};

}  // namespace stepmesh::core
