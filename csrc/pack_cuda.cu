// CUDA kernel of pack / unpack: one launch copies (and casts, and scales) any number of tensors to or
// from a flat buffer, driven by a small device table (see launch.h, copy_table).
#include <cuda_runtime.h>

#include "kernel_utils.cuh"
#include "launch.h"

namespace mfsdp {
namespace cuda {
namespace {

using namespace detail;

template <class In, class Out>
__global__ void __launch_bounds__(kThreads)
    copy_table_kernel(const int64_t* __restrict__ table, int64_t n, int64_t total, int64_t chunk, int64_t nchunks,
                      float scale, bool use_scale) {
  using IR = typename In::raw;
  using OR = typename Out::raw;
  const int64_t* vstart = table;
  const int64_t* srcs = table + n + 1;
  const int64_t* dsts = table + 2 * n + 1;
  int64_t hint = 0;  // entries before it end at or before this block's next chunk
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    int64_t b0, b1;
    chunk_bounds(c, chunk, total, b0, b1);
    int64_t i = hint + block_first_end_gt(vstart + hint + 1, 1, n - hint, b0);
    int64_t p = b0;
    while (p < b1 && i < n) {
      const int64_t s = vstart[i];
      const int64_t e = vstart[i + 1];
      if (e <= p) {
        ++i;
        continue;
      }
      const int64_t q = e < b1 ? e : b1;
      const int64_t off = p - s;
      OR* dst = reinterpret_cast<OR*>(dsts[i]) + off;
      const IR* src = reinterpret_cast<const IR*>(srcs[i]);
      if (src == nullptr) {
        ZeroOp<Out> op{dst};
        run_range(op, q - p);
      } else {
        CopyOp<In, Out> op{src + off, dst, scale, use_scale};
        run_range(op, q - p);
      }
      p = q;
    }
    hint = i < n ? i : n;
  }
}

template <class In, class Out>
int launch_copy_table(const int64_t* table, int64_t n, int64_t total, float scale, bool use_scale,
                      cudaStream_t stream) {
  auto kernel = copy_table_kernel<In, Out>;
  const Grid g = make_grid(reinterpret_cast<const void*>(kernel), total);
  kernel<<<g.blocks, kThreads, 0, stream>>>(table, n, total, g.chunk, g.nchunks, scale, use_scale);
  return last_error();
}

template <class In>
int dispatch_out(const int64_t* table, int64_t n, int64_t total, DType out, float scale, bool use_scale,
                 cudaStream_t stream) {
  switch (out) {
    case kF32: return launch_copy_table<In, F32T>(table, n, total, scale, use_scale, stream);
    case kBF16: return launch_copy_table<In, BF16T>(table, n, total, scale, use_scale, stream);
    case kF16: return launch_copy_table<In, F16T>(table, n, total, scale, use_scale, stream);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace

int copy_table(const int64_t* table, int64_t n, int64_t total, DType in, DType out, float scale, bool use_scale,
               void* stream) {
  if (total <= 0 || n <= 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (in) {
    case kF32: return dispatch_out<F32T>(table, n, total, out, scale, use_scale, s);
    case kBF16: return dispatch_out<BF16T>(table, n, total, out, scale, use_scale, s);
    case kF16: return dispatch_out<F16T>(table, n, total, out, scale, use_scale, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

const char* error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

int stream_is_capturing(void* stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return st != cudaStreamCaptureStatusNone ? 1 : 0;
}

int binary_version() {
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(copy_table_kernel<F32T, F32T>)) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return attr.binaryVersion;
}

}  // namespace cuda
}  // namespace mfsdp
