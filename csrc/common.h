// Host-side helpers shared by pack.cpp and cast.cpp: dtype mapping, input checks with clear messages,
// the CPU segment walkers (the same walk the CUDA kernels do), and the CUDA stream / error glue.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "fp8_math.h"
#include "segment_walk.h"

#ifdef MFSDP_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "launch.h"
#endif

namespace mfsdp {

// elements per CPU task (at::parallel_for grain)
constexpr int64_t kCpuGrain = 1 << 15;

inline bool to_dtype(at::ScalarType t, DType& d) {
  switch (t) {
    case at::kFloat: d = kF32; return true;
    case at::kBFloat16: d = kBF16; return true;
    case at::kHalf: d = kF16; return true;
    case at::kFloat8_e4m3fn: d = kE4M3; return true;
    case at::kFloat8_e5m2: d = kE5M2; return true;
    default: return false;
  }
}


// dtype of t, which must be one of float32 / bfloat16 / float16 (want_fp8 = false) or an fp8 type
inline DType float_dtype(const at::Tensor& t, const char* fn, const char* what, bool want_fp8 = false) {
  DType d;
  const bool ok = to_dtype(t.scalar_type(), d) && (want_fp8 ? is_fp8_dtype(d) : is_float_dtype(d));
  TORCH_CHECK_TYPE(ok, "mfsdp_ext.", fn, ": ", what, " must be ",
              want_fp8 ? "float8_e4m3fn or float8_e5m2" : "float32, bfloat16 or float16", ", got ",
              t.scalar_type());
  return d;
}

inline void check_contiguous(const at::Tensor& t, const char* fn, const char* what) {
  TORCH_CHECK_VALUE(t.is_contiguous(), "mfsdp_ext.", fn, ": ", what, " must be contiguous (got sizes ", t.sizes(),
              ", strides ", t.strides(), ")");
}

// a flat buffer: any contiguous tensor, indexed by its flat element index
inline void check_flat(const at::Tensor& t, const char* fn, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), "mfsdp_ext.", fn, ": ", what, " is undefined (None)");
  check_contiguous(t, fn, what);
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* fn, const char* what_a,
                              const char* what_b) {
  TORCH_CHECK_VALUE(a.device() == b.device(), "mfsdp_ext.", fn, ": ", what_a, " and ", what_b,
              " must be on the same device, got ", a.device(), " and ", b.device());
}

// CPU, CUDA (when built with CUDA) or meta (shape checks only, nothing runs)
inline void check_device_supported(const at::Tensor& t, const char* fn) {
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda() || t.device().is_meta(), "mfsdp_ext.", fn,
              ": only CPU, CUDA and meta tensors are supported, got ", t.device());
#ifndef MFSDP_WITH_CUDA
  TORCH_CHECK_VALUE(!t.device().is_cuda(), "mfsdp_ext.", fn,
              ": this build of mfsdp_ext._C has no CUDA kernels (it was built where torch had no CUDA or nvcc "
              "was not found); rebuild on the GPU machine with `pip install --no-build-isolation -e .`");
#endif
}

// byte ranges [a, a + na) and [b, b + nb) overlap
inline bool bytes_overlap(const void* a, int64_t na, const void* b, int64_t nb) {
  if (na <= 0 || nb <= 0) return false;
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + static_cast<uintptr_t>(nb) && pb < pa + static_cast<uintptr_t>(na);
}

inline void check_no_overlap(const at::Tensor& a, const at::Tensor& b, const char* fn, const char* what_a,
                             const char* what_b) {
  TORCH_CHECK_VALUE(!bytes_overlap(a.data_ptr(), a.numel() * a.element_size(), b.data_ptr(), b.numel() * b.element_size()),
              "mfsdp_ext.", fn, ": ", what_a, " and ", what_b, " must not overlap in memory");
}

// segments: int64 (n, 2)
inline void check_segment_shape(const at::Tensor& seg, const char* fn) {
  TORCH_CHECK_TYPE(seg.scalar_type() == at::kLong, "mfsdp_ext.", fn, ": segments must be int64, got ", seg.scalar_type());
  TORCH_CHECK_VALUE(seg.dim() == 2 && seg.size(1) == 2, "mfsdp_ext.", fn,
              ": segments must have shape (n, 2) of [start, end) rows, got ", seg.sizes());
}

// segments: int64 (n, 2), contiguous, on `like`'s device.
inline int64_t check_segment_table(const at::Tensor& seg, const at::Tensor& like, const char* fn) {
  check_segment_shape(seg, fn);
  check_contiguous(seg, fn, "segments");
  check_same_device(seg, like, fn, "segments", "src");
  return seg.size(0);
}

// Segment rows must lie in [0, total), be sorted and not overlap: 0 <= start_i <= end_i <= total and
// end_{i-1} <= start_i (an empty row (e, e) fits in order). CPU table only.
inline void validate_segments_cpu(const int64_t* s, int64_t n, int64_t total, const char* fn) {
  int64_t prev_end = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = s[2 * i], b = s[2 * i + 1];
    TORCH_CHECK_VALUE(0 <= a && a <= b && b <= total, "mfsdp_ext.", fn, ": segment ", i, " = [", a, ", ", b,
                ") is not a range inside [0, ", total, ")");
    TORCH_CHECK_VALUE(a >= prev_end, "mfsdp_ext.", fn, ": segments must be sorted and non-overlapping, but segment ", i,
                " starts at ", a, " before the previous segment's end ", prev_end,
                " (write an empty segment as (e, e) at its place in order)");
    prev_end = b;
  }
}

// ---------------------------------------------------------------------------------------------
// CPU walkers (mirror kernel_utils.cuh)
// ---------------------------------------------------------------------------------------------
// Split [0, total) into contiguous chunks over the CPU threads; in each chunk find the first segment with
// end > chunk start (binary search) and walk forward (segment_walk.h): on_seg(i, p, q) / on_gap(p, q).
template <class OnSeg, class OnGap>
void cpu_walk_segments(const int64_t* seg, int64_t nseg, int64_t total, OnSeg&& on_seg, OnGap&& on_gap) {
  if (total <= 0) return;
  at::parallel_for(0, total, kCpuGrain, [&](int64_t b0, int64_t b1) {
    int64_t lo = 0, hi = nseg;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (seg[2 * mid + 1] <= b0) lo = mid + 1;
      else hi = mid;
    }
    walk_segments_from(seg, nseg, lo, b0, b1, on_seg, on_gap);
  });
}

// dst[j] = Out(In(src[j]) * scale) for j < n (raw copy when the types match and no scale)
template <class In, class Out>
inline void cpu_copy_range(const typename In::raw* src, typename Out::raw* dst, int64_t n, float scale,
                           bool use_scale) {
  if constexpr (std::is_same<In, Out>::value) {
    if (!use_scale) {
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(typename In::raw));
      return;
    }
  }
  if (use_scale) {
    for (int64_t j = 0; j < n; ++j) dst[j] = Out::store(mul_rn(In::load(src[j]), scale));
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = Out::store(In::load(src[j]));
  }
}

template <class Out>
inline void cpu_zero_range(typename Out::raw* dst, int64_t n) {
  std::memset(dst, 0, static_cast<size_t>(n) * sizeof(typename Out::raw));
}

#ifdef MFSDP_WITH_CUDA
inline void* cuda_stream(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

inline void check_cuda(int err, const char* fn) {
  TORCH_CHECK(err == 0, "mfsdp_ext.", fn, ": CUDA kernel launch failed: ", cuda::error_string(err));
}
#endif

}  // namespace mfsdp
