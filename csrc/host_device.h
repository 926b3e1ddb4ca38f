// MFSDP_HD marks the helpers that the CPU kernels (C++) and the CUDA kernels share.
#pragma once

#if defined(__CUDACC__)
#define MFSDP_HD __host__ __device__ __forceinline__
#else
#define MFSDP_HD inline
#endif
