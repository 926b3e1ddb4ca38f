// run_kernel: the one call with which the host glue (cast.cpp, pack.cpp) runs a kernel. It picks the launcher
// of the tensors' device (launch.h): the CPU kernel, or the CUDA kernel on the current stream of the device,
// and turns a launch error into an exception naming the function.
#pragma once

#include <ATen/ATen.h>

#include "launch.h"

#ifdef MFSDP_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace mfsdp {

#ifdef MFSDP_WITH_CUDA
inline void* cuda_stream(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// whether work on t's current stream is being captured into a CUDA graph
inline bool cuda_stream_is_capturing(const at::Tensor& t) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(cuda_stream(t)), &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return st != cudaStreamCaptureStatusNone;
}
#endif

// Runs the kernel that `p` names on `like`'s device (CPU or CUDA; the caller has checked it and returns
// early for meta tensors).
template <class Params>
void run_kernel(const at::Tensor& like, const char* fn, const Params& p) {
  if (like.is_cpu()) {
    cpu::launch(p, nullptr);  // the CPU kernels report no errors
    return;
  }
#ifdef MFSDP_WITH_CUDA
  c10::cuda::CUDAGuard guard(like.device());
  const int err = cuda::launch(p, cuda_stream(like));
  TORCH_CHECK(err == 0, "mfsdp_ext.", fn, ": CUDA kernel launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
#else
  (void)fn;
#endif
}

}  // namespace mfsdp
