#pragma once

// Small RAII owners for CUDA resources (device memory, streams, events,
// cuBLAS handles), so that a failing check anywhere in a test or a program
// cannot leak them. Constructors never throw: they record the CUDA status,
// which the owner reports through status().

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace afd::cuda {

// Typed device allocation of `count` elements (cudaMalloc, not managed
// memory: the H200 notes ask for plain allocations).
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count > 0) {
      status_ = cudaMalloc(reinterpret_cast<void**>(&data_), count * sizeof(T));
      if (status_ != cudaSuccess) {
        data_ = nullptr;
        count_ = 0;
      }
    }
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      if (data_ != nullptr) cudaFree(data_);
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
      status_ = other.status_;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  cudaError_t status() const { return status_; }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
  cudaError_t status_ = cudaSuccess;
};

// One CUDA or cuBLAS handle: made at construction by `create(&handle)`
// (status() says how that went), destroyed by `Destroy` unless null.
template <typename Handle, typename Status, Status kSuccess, auto Destroy>
class UniqueHandle {
 public:
  template <typename Create>
  explicit UniqueHandle(Create create) {
    status_ = create(&handle_);
  }
  ~UniqueHandle() {
    if (handle_ != nullptr) Destroy(handle_);
  }
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;
  Handle get() const { return handle_; }
  Status status() const { return status_; }

 private:
  Handle handle_ = nullptr;
  Status status_ = kSuccess;
};

// A non-blocking stream.
class Stream : public UniqueHandle<cudaStream_t, cudaError_t, cudaSuccess, &cudaStreamDestroy> {
 public:
  Stream()
      : UniqueHandle(
            [](cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamNonBlocking); }) {}
};

class Event : public UniqueHandle<cudaEvent_t, cudaError_t, cudaSuccess, &cudaEventDestroy> {
 public:
  Event() : UniqueHandle([](cudaEvent_t* e) { return cudaEventCreate(e); }) {}
};

class CublasHandle
    : public UniqueHandle<cublasHandle_t, cublasStatus_t, CUBLAS_STATUS_SUCCESS, &cublasDestroy> {
 public:
  CublasHandle() : UniqueHandle([](cublasHandle_t* h) { return cublasCreate(h); }) {}
};

}  // namespace afd::cuda
