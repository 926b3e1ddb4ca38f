#include "capture_info.h"

#ifdef MFSDP_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace mfsdp {

uint64_t current_capture_id(int64_t device) {
#ifdef MFSDP_WITH_CUDA
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  if (cudaStreamGetCaptureInfo(stream, &status, &id) != cudaSuccess) {
    (void)cudaGetLastError();  // a failed query leaves no sticky error behind
    return 0;
  }
  return status == cudaStreamCaptureStatusActive ? static_cast<uint64_t>(id) : 0;
#else
  (void)device;
  return 0;
#endif
}

}  // namespace mfsdp
