#pragma once

// Lets the scalar helpers shared by the CPU reference and the CUDA kernels
// compile in both worlds: under nvcc they become __host__ __device__, in a
// plain C++ build the macro disappears.
#ifdef __CUDACC__
#define AFD_HOST_DEVICE __host__ __device__
#else
#define AFD_HOST_DEVICE
#endif
