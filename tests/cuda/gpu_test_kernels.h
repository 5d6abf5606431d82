#pragma once
// Test-only kernels for cuda_gpu_tests (gpu_test_kernels.cu).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace stepmesh::testing {

// One thread stores to an unmapped address: a sticky cudaErrorIllegalAddress.
cudaError_t LaunchFaultKernel(cudaStream_t stream);

// out[i] = in[i] + 1 for `count` words (a model kernel reading arrived data).
cudaError_t LaunchAddOneKernel(cudaStream_t stream, const uint32_t* in, uint32_t* out,
                               size_t count);
// Its host stub, for PreloadCudaKernels.
const void* AddOneKernelSymbol();

}  // namespace stepmesh::testing
