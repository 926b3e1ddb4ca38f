// The kernels' launchers. Every kernel has a CPU implementation (mfsdp::cpu, *_cpu.cpp) and a CUDA one
// (mfsdp::cuda, *_cuda.cu) with one signature, `int launch(const XParams& p, void* stream)`: the params struct
// names the kernel, `stream` is a cudaStream_t (ignored on the CPU). The result is a cudaError_t as int (the
// launch error read right after the launch; 0 = success; the CPU kernels always return 0). The host glue
// (cast.cpp, pack.cpp, quantize.cpp) checks the tensors, fills the params and calls run_kernel
// (device_launch.h), which picks the implementation from the tensors' device. Plain C++ here: raw pointers,
// sizes and dtype codes, so the glue and the .cu files share no torch or CUDA header.
//
// Segment tables (segments, num_segments): int64 rows [start, end) in the source's memory space, sorted,
// non-overlapping, within [0, numel) (the glue checks CPU tables; mfsdp_ext/_native checks CUDA tables once).
#pragma once

#include <cstdint>

#include "dtype.h"

namespace mfsdp {

// dst[i] = cvt(src[i]) for i < numel (fp32 / bf16 / fp16 in and out)
struct CastParams {
  const void* src;
  DType src_dtype;
  void* dst;
  DType dst_dtype;
  int64_t numel;
};

// amax[i] = max |src| over segment i (0 for an empty segment; NaN wins)
struct SegmentAmaxParams {
  const void* src;
  DType src_dtype;
  int64_t numel;
  const int64_t* segments;
  int64_t num_segments;
  float* amax;
};

// dst = saturate(src * scale_i) in segment i, 0 outside every segment; scale_i = fp8_scale(amax[i], eps),
// scale_inv[i] = 1 / scale_i. dst_dtype is an fp8 code.
struct Fp8CastParams {
  const void* src;
  DType src_dtype;
  int64_t numel;
  const int64_t* segments;
  int64_t num_segments;
  const float* amax;
  float eps;
  void* dst;
  DType dst_dtype;
  float* scale_inv;
};

// dst = src * scale_inv[i] in segment i, 0 outside every segment. src_dtype is an fp8 code.
struct Fp8DequantizeParams {
  const void* src;
  DType src_dtype;
  int64_t numel;
  const int64_t* segments;
  int64_t num_segments;
  const float* scale_inv;
  void* dst;
  DType dst_dtype;
};

// main_grad = (accumulate ? main_grad : 0) + scale * reduced, in fp32 (one rounding when accumulating); with
// parts > 1, reduced holds parts rows of numel and they are added in row order, each as one such call would
// (row 0 with `accumulate`, every later row accumulating): the sum of the shards an all-to-all delivered
struct GradAccumulateParams {
  void* main_grad;
  DType main_grad_dtype;
  const void* reduced;
  DType reduced_dtype;
  int64_t numel;
  float scale;
  bool accumulate;
  int64_t parts;
};

// Copy table of pack / unpack (int64 words), num_entries entries:
//   [0, n]          vstart: prefix sums of the entry lengths (vstart[0] = 0, vstart[n] = total)
//   [n+1, 2n+1)     src element pointers (0 = write zeros)
//   [2n+1, 3n+1)    dst element pointers
// Entry i maps virtual element v in [vstart[i], vstart[i+1]) to dst_i[v - vstart[i]] = cvt(src_i[...] * scale).
constexpr int64_t copy_table_words(int64_t n) { return 3 * n + 1; }

// Tables of at most this many entries travel in the CUDA kernel's parameters (3.8 KB of the 4 KB limit):
// no upload, so the launch can be captured in a CUDA graph.
constexpr int64_t kInlineTableEntries = 160;

struct CopyTableParams {
  const int64_t* host_table;    // the table in host memory
  const int64_t* device_table;  // CUDA, more than kInlineTableEntries entries: the same words in device memory
  int64_t num_entries;
  int64_t total;  // vstart[num_entries]
  DType src_dtype;
  DType dst_dtype;
  float scale;
  bool use_scale;  // false: no multiplication (a plain copy when the dtypes agree)
};

// FP8 quantizer of one tensor with per-tensor current scaling: amax = max |src| over all numel elements,
// scale = fp8_scale(amax, eps), dst[i] = saturate(src[i] * scale); scale_inv[0] = 1 / scale, amax[0] = amax
// (amax may be null). dst_t (may be null): the (cols, rows) transpose of dst seen as (numel / cols, cols).
// src_dtype: a float code, dst_dtype: an fp8 code. numel may be 0 (scale 1).
// algo: how the CUDA kernel gets the amax before the cast (quantize_cuda.cu; the CPU has one way):
//   kQuantizeTwoPass: two launches, reading workspace (fp8_quantize_workspace_words() uint32 words on the
//     device, from the caller); kQuantizeFused: one launch, with counters of its own per (device, stream), so
//     never under CUDA graph capture (quantize.cpp asks for two-pass there); kQuantizeAuto: two-pass for now.
enum QuantizeAlgo : int { kQuantizeAuto = 0, kQuantizeTwoPass = 1, kQuantizeFused = 2 };

struct Fp8QuantizeParams {
  const void* src;
  DType src_dtype;
  int64_t numel;
  int64_t cols;  // the last dimension of src (what the transpose sees as a row)
  void* dst;
  void* dst_t;
  DType dst_dtype;
  float* scale_inv;
  float* amax;
  float eps;
  QuantizeAlgo algo;
  uint32_t* workspace;  // CUDA two-pass only
};

// dst (cols, rows) = src (rows, cols), one-byte elements
struct Fp8TransposeParams {
  const void* src;
  int64_t rows;
  int64_t cols;
  void* dst;
};


// One flat optimizer step (AdamW or SGD) over the runs of a flat buffer: for each run i, [runs[2i], runs[2i+1])
// (a segment table: sorted, non-overlapping, within [0, numel)), every element is updated with run i's
// coefficients coeffs[kOptimCoeffs * i ...] (optim_math.h); elements in no run are not touched.
// param / state0 / state1: fp32 flat buffers of numel elements; grad: fp32 / bf16 / fp16.
// AdamW: state0 = exp_avg, state1 = exp_avg_sq. SGD: state0 = momentum buffer (null when no run has
// kSgdMomentum), state1 = null.
enum OptimKind : int { kOptimAdamW = 0, kOptimSgd = 1 };

// Runs of at most this many rows travel in the CUDA kernel's parameters (2 KB + 1 KB of the 4 KB limit):
// no upload, so the step can be captured in a CUDA graph.
constexpr int64_t kOptimInlineRuns = 64;
constexpr int kOptimCoeffs = 8;  // floats per run in the coefficient table (columns: optim_math.h)

struct OptimStepParams {
  OptimKind kind;
  float* param;
  const void* grad;
  DType grad_dtype;
  float* state0;
  float* state1;
  int64_t numel;
  const int64_t* host_runs;     // (num_runs, 2) in host memory
  const float* host_coeffs;     // (num_runs, kOptimCoeffs) in host memory
  const int64_t* device_runs;   // CUDA, more than kOptimInlineRuns runs: the same rows in device memory
  const float* device_coeffs;
  int64_t num_runs;
};

namespace cpu {
int launch(const CastParams& p, void* stream);
int launch(const SegmentAmaxParams& p, void* stream);
int launch(const Fp8CastParams& p, void* stream);
int launch(const Fp8DequantizeParams& p, void* stream);
int launch(const GradAccumulateParams& p, void* stream);
int launch(const CopyTableParams& p, void* stream);
int launch(const Fp8QuantizeParams& p, void* stream);
int launch(const Fp8TransposeParams& p, void* stream);
int launch(const OptimStepParams& p, void* stream);
}  // namespace cpu

namespace cuda {
int launch(const CastParams& p, void* stream);
int launch(const SegmentAmaxParams& p, void* stream);
int launch(const Fp8CastParams& p, void* stream);
int launch(const Fp8DequantizeParams& p, void* stream);
int launch(const GradAccumulateParams& p, void* stream);
int launch(const CopyTableParams& p, void* stream);
int launch(const Fp8QuantizeParams& p, void* stream);
int launch(const Fp8TransposeParams& p, void* stream);
int launch(const OptimStepParams& p, void* stream);
// words of Fp8QuantizeParams::workspace for the two-pass quantizer on the current device
int64_t fp8_quantize_workspace_words();
// A two-pass workspace of the current device kept for `stream` (allocated once, never freed): calls on one stream
// run in order, so they can share it. Not under graph capture (a graph may replay on another stream). nullptr
// with *err set on failure.
uint32_t* fp8_quantize_stream_workspace(void* stream, int* err);
}  // namespace cuda

}  // namespace mfsdp
