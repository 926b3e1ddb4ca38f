// run_kernel: the one call with which the host glue (cast.cpp, pack.cpp) runs a kernel. It picks the launcher
// of the tensors' device (launch.h): the CPU kernel, or the CUDA kernel on the current stream of the device,
// and turns a launch error into an exception naming the function.
#pragma once

#include <ATen/ATen.h>

#include <cstring>
#include <initializer_list>
#include <utility>

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

// A kernel's table too large for its parameters, to like's device through pinned memory: `parts` (host pointer,
// bytes) back to back, each a whole number of int64 words. copy_ records the copy on the host allocator, so the
// pinned block is not reused before the copy ran; the returned tensor keeps the device copy alive until the
// kernel is queued. Not under CUDA graph capture (the table is uploaded on every call): `what` names the limit.
inline at::Tensor upload_table(std::initializer_list<std::pair<const void*, size_t>> parts, const at::Tensor& like,
                               const char* fn, const char* what) {
  c10::cuda::CUDAGuard guard(like.device());
  TORCH_CHECK_VALUE(!cuda_stream_is_capturing(like), "mfsdp_ext.", fn, " of ", what,
                    " cannot be captured in a CUDA graph: its table is uploaded on every call");
  size_t bytes = 0;
  for (const auto& part : parts) bytes += part.second;
  const auto words = static_cast<int64_t>(bytes / sizeof(int64_t));
  at::Tensor host = at::empty({words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  auto* h = static_cast<char*>(host.data_ptr());
  for (const auto& part : parts) {
    std::memcpy(h, part.first, part.second);
    h += part.second;
  }
  at::Tensor dev = at::empty({words}, at::TensorOptions().dtype(at::kLong).device(like.device()));
  dev.copy_(host, /*non_blocking=*/true);
  return dev;
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
