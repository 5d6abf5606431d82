#pragma once
// Launchers for the one-thread flag kernels (flag_kernels.cu). They are the
// graph-safe alternative to cuStreamWaitValue32/cuStreamWriteValue32: a kernel
// node captures like any other, a stream memory operation may not.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace stepmesh::cuda {

// Later work on `stream` waits until (int32_t)(*flag - value) >= 0. `flag` is
// the device address of mapped pinned host memory (or device memory).
cudaError_t LaunchWaitFlagKernel(cudaStream_t stream, const uint32_t* flag, uint32_t value);

// Stores `value` to `flag` after all earlier work on `stream`, as a
// system-scope release so the host sees the data written before it.
cudaError_t LaunchSignalFlagKernel(cudaStream_t stream, uint32_t* flag, uint32_t value);

// Later work waits until (int32_t)(*counter - (*cursor + 1)) >= 0; then the
// kernel advances *cursor to that target (see CudaApi::LaunchWaitNextFlagKernel).
cudaError_t LaunchWaitNextFlagKernel(cudaStream_t stream, const uint32_t* counter,
                                     uint32_t* cursor);

// Later work waits until *counter >= *target (int64, both read when the kernel
// runs: device addresses of mapped pinned host memory or device memory).
cudaError_t LaunchWaitCounterKernel(cudaStream_t stream, const int64_t* counter,
                                    const int64_t* target);

// *counter += 1 (an atomic add at system scope, after a release fence) when
// the stream gets there: a device-side "go" for a host trigger.
cudaError_t LaunchIncrementCounterKernel(cudaStream_t stream, int64_t* counter);

// Loads the kernels into the current context (see CudaApi::LoadFlagKernels).
cudaError_t LoadFlagKernels();

}  // namespace stepmesh::cuda
