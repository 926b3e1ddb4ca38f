// Launchers of the CUDA kernels (defined in pack_cuda.cu / cast_cuda.cu). Plain C++ signatures: raw pointers,
// sizes, dtype codes and the stream as void* (a cudaStream_t), so the torch glue (.cpp) and the CUDA
// sources (.cu) share no headers but this one and fp8_math.h. Each returns a cudaError_t as int
// (0 = success): the launch error checked right after the launch.
#pragma once

#include <cstdint>

#include "fp8_math.h"

namespace mfsdp {
namespace cuda {

// Copy table for pack / unpack (int64 words, device memory), n entries:
//   [0, n]          vstart: prefix sums of the entry lengths (vstart[0] = 0, vstart[n] = total)
//   [n+1, 2n+1)     src element pointers (0 = write zeros)
//   [2n+1, 3n+1)    dst element pointers
// Entry i maps virtual element v in [vstart[i], vstart[i+1]) to dst_i[v - vstart[i]] = cvt(src_i[...] * scale).
constexpr int64_t copy_table_words(int64_t n) { return 3 * n + 1; }

int copy_table(const int64_t* table, int64_t n, int64_t total, DType in, DType out, float scale,
               bool use_scale, void* stream);

// Tables of at most this many entries travel in the kernel's parameters (3.8 KB of the 4 KB limit).
constexpr int64_t kInlineTableEntries = 160;
// The same with the table in host memory (n <= kInlineTableEntries): no upload, no pinned buffer.
int copy_table_inline(const int64_t* host_table, int64_t n, int64_t total, DType in, DType out, float scale,
                      bool use_scale, void* stream);

// dst[i] = cvt(src[i]) for i < numel (fp32 / bf16 / fp16 / fp8 in and out; fp8 out saturates)
int cast(const void* src, DType in, void* dst, DType out, int64_t numel, void* stream);

// segments: int64 (n, 2) [start, end) on the device, sorted, non-overlapping, within [0, numel).
int segment_amax(const void* src, DType in, int64_t numel, const int64_t* segments, int64_t nseg,
                 float* amax, void* stream);

int fp8_cast(const void* src, DType in, int64_t numel, const int64_t* segments, int64_t nseg,
             const float* amax, float eps, void* dst, DType out, float* scale_inv, void* stream);

int fp8_dequantize(const void* src, DType in, int64_t numel, const int64_t* segments, int64_t nseg,
                   const float* scale_inv, void* dst, DType out, void* stream);

int grad_accumulate(void* main_grad, DType main_dtype, const void* reduced, DType red_dtype,
                    int64_t numel, float scale, bool accumulate, void* stream);

// FP8 quantizer of one tensor with per-tensor current scaling (quantize_cuda.cu). dst[i] = saturate(src[i] *
// scale) with scale = fp8_max / max(amax, eps) (1 for amax 0 / inf / NaN); scale_inv[0] = 1 / scale, amax[0] =
// max |src| (amax may be null). dst_t (may be null): the (cols, rows) transpose of dst seen as
// (numel / cols, cols). workspace: fp8_quantize_workspace_words() uint32 words on the device (two-pass).
// algo: kQuantizeTwoPass or kQuantizeFused (two-pass under CUDA graph capture).
constexpr int kQuantizeTwoPass = 1;
constexpr int kQuantizeFused = 2;
int64_t fp8_quantize_workspace_words();
int fp8_quantize(const void* src, DType in, int64_t numel, int64_t cols, void* dst, void* dst_t, DType out,
                 float* scale_inv, float* amax, float eps, int algo, uint32_t* workspace, void* stream);

// dst (cols, rows) = src (rows, cols), one-byte elements
int fp8_transpose(const void* src, int64_t rows, int64_t cols, void* dst, void* stream);

const char* error_string(int err);
// 1 when work on `stream` is being captured into a CUDA graph, else 0
int stream_is_capturing(void* stream);

}  // namespace cuda
}  // namespace mfsdp
