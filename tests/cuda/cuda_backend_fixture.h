#pragma once
// A CUDA backend over a fresh strict FakeCudaApi, for the cuda_backend_tests
// files. The fake's violations are checked at the end, after the backend is
// gone (its destructor's calls count too).

#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/backends/cuda/cuda_backend.h"
#include "stepmesh/backend.h"
#include "tests/cuda/fake_cuda_api.h"

namespace stepmesh::cuda::testing {

inline std::string Joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& line : lines) absl::StrAppend(&out, "\n  ", line);
  return out;
}

inline CudaBackendOptions Modes(ReadyEventMode ready, StreamWaitMode wait = StreamWaitMode::kAuto) {
  CudaBackendOptions options;
  options.ready_event_mode = ready;
  options.stream_wait_mode = wait;
  return options;
}

// A device that can flush remote writes, and the options that ask for it.
inline std::shared_ptr<FakeCudaApi> FlushCapableDevice() {
  auto fake = std::make_shared<FakeCudaApi>(1);
  fake->set_attribute(cudaDevAttrCanFlushRemoteWrites, 1);
  return fake;
}
inline CudaBackendOptions FlushRemoteWrites() {
  CudaBackendOptions options;
  options.flush_remote_writes = true;
  return options;
}

struct BackendFixture {
  explicit BackendFixture(int devices = 1, CudaBackendOptions options = {}, int device = 0)
      : BackendFixture(std::make_shared<FakeCudaApi>(devices), device, options) {}
  BackendFixture(std::shared_ptr<FakeCudaApi> configured, int device,
                 CudaBackendOptions options = {})
      : fake(std::move(configured)) {
    auto created = CreateCudaBackend(fake, device, options);
    REQUIRE(created.ok());
    backend = std::move(*created);
  }
  ~BackendFixture() {
    backend.reset();
    INFO("calls a real driver would refuse or hang on:" << Joined(fake->violations()));
    CHECK(fake->violations().empty());
  }

  std::unique_ptr<Stream> NewStream() {
    auto stream = backend->CreateStream();
    REQUIRE(stream.ok());
    return std::move(*stream);
  }
  static cudaStream_t Native(Stream& stream) {
    auto handle = NativeCudaStream(stream);
    REQUIRE(handle.ok());
    return static_cast<cudaStream_t>(*handle);
  }
  static bool Ready(Event& event) {
    auto ready = event.Query();
    REQUIRE(ready.ok());
    return *ready;
  }

  std::shared_ptr<FakeCudaApi> fake;
  std::unique_ptr<Backend> backend;
};

}  // namespace stepmesh::cuda::testing
