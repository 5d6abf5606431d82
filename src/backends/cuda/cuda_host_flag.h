#pragma once
// The CUDA backend's memory and host flags (whole here: the flag's loads,
// stores and wait notes are on the hot path of every stream wait).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "src/backends/cuda/cuda_device_context.h"
#include "stepmesh/backend.h"

namespace stepmesh::cuda {

class CudaMemory final : public Memory {
 public:
  CudaMemory(std::shared_ptr<DeviceContext> context, void* data, size_t bytes, MemoryKind kind)
      : context_(std::move(context)), data_(data), bytes_(bytes), kind_(kind) {}
  ~CudaMemory() override { context_->Release(data_, kind_ == MemoryKind::kDevice); }
  void* data() const override { return data_; }
  size_t bytes() const override { return bytes_; }
  Device device() const override {
    return kind_ == MemoryKind::kDevice ? Device::Cuda(context_->device()) : Device::Cpu();
  }

 private:
  const std::shared_ptr<DeviceContext> context_;
  void* const data_;
  const size_t bytes_;
  const MemoryKind kind_;
};

// A 32-bit word of mapped pinned memory: the host stores/loads it directly,
// streams reach it through its device alias. It remembers the highest value
// any stream was told to wait for, so that it can release those waits (a
// stream waiting on freed memory waits forever, and so does everything that
// synchronises with it, cudaFree included).
class CudaHostFlag final : public HostFlag {
 public:
  CudaHostFlag(std::shared_ptr<DeviceContext> context, uint32_t* host, uint32_t* device)
      : context_(std::move(context)), host_(host), device_(device) {
    context_->AddFlag(this);
  }
  ~CudaHostFlag() override {
    ReleaseWaiters();
    context_->RemoveFlag(this);
    context_->Release(host_, /*device=*/false);  // other flags' waits may still be pending
  }
  // A stream may be waiting on this flag: a plain wait not yet reached, or
  // next-waits, whose targets live on the device (assumed pending).
  bool MayHaveWaiter() const {
    const uint64_t waited = waited_.load(std::memory_order_acquire);
    return ((waited & kHasWait) != 0 && !Reached(Load(), static_cast<uint32_t>(waited))) ||
           next_waits_.load(std::memory_order_acquire);
  }
  void Store(uint32_t value) override {
    std::atomic_ref<uint32_t>(*host_).store(value, std::memory_order_release);
  }
  uint32_t Load() const override { return LoadAcquire(host_); }

  // Moves the flag to the highest value waited for, if it is not there yet;
  // next-waits (WaitHostFlagNext) target the cursor plus one when they run,
  // which is within 2^30 of this counter.
  void ReleaseWaiters() override {
    const uint64_t waited = waited_.load(std::memory_order_acquire);
    if ((waited & kHasWait) != 0 && !Reached(Load(), static_cast<uint32_t>(waited))) {
      Store(static_cast<uint32_t>(waited));
    }
    if (next_waits_.load(std::memory_order_acquire)) Store(Load() + (1u << 30));
  }
  void NoteNextWait() { next_waits_.store(true, std::memory_order_release); }
  // Called before a wait for `value` is enqueued.
  void NoteWait(uint32_t value) {
    uint64_t seen = waited_.load(std::memory_order_relaxed);
    for (;;) {
      if ((seen & kHasWait) != 0 && Reached(static_cast<uint32_t>(seen), value)) return;
      if (waited_.compare_exchange_weak(seen, kHasWait | value, std::memory_order_acq_rel)) return;
    }
  }
  uint32_t* device_word() const { return device_; }

 private:
  static constexpr uint64_t kHasWait = uint64_t{1} << 32;

  const std::shared_ptr<DeviceContext> context_;
  uint32_t* const host_;
  uint32_t* const device_;
  std::atomic<uint64_t> waited_{0};
  std::atomic<bool> next_waits_{false};
};

}  // namespace stepmesh::cuda
