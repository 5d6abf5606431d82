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

class Stream {
 public:
  Stream() { status_ = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); }
  ~Stream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }
  cudaError_t status() const { return status_; }

 private:
  cudaStream_t stream_ = nullptr;
  cudaError_t status_ = cudaSuccess;
};

class Event {
 public:
  Event() { status_ = cudaEventCreate(&event_); }
  ~Event() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }
  cudaError_t status() const { return status_; }

 private:
  cudaEvent_t event_ = nullptr;
  cudaError_t status_ = cudaSuccess;
};

class CublasHandle {
 public:
  CublasHandle() { status_ = cublasCreate(&handle_); }
  ~CublasHandle() {
    if (handle_ != nullptr) cublasDestroy(handle_);
  }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return handle_; }
  cublasStatus_t status() const { return status_; }

 private:
  cublasHandle_t handle_ = nullptr;
  cublasStatus_t status_ = CUBLAS_STATUS_SUCCESS;
};

}  // namespace afd::cuda
