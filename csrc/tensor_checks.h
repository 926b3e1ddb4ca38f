// Input checks of the host glue (cast.cpp, pack.cpp), with messages that name the function and the argument,
// and the mapping of torch dtypes to the launchers' DType codes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "dtype.h"

namespace mfsdp {

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

inline void check_same_numel(const at::Tensor& a, const at::Tensor& b, const char* fn, const char* what_a,
                             const char* what_b) {
  TORCH_CHECK_VALUE(a.numel() == b.numel(), "mfsdp_ext.", fn, ": ", what_a, " and ", what_b,
              " must have the same number of elements, got ", a.numel(), " and ", b.numel());
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

// The one check of a segment table, used by every kernel that takes one and by check_segments: an int64
// (n, 2) contiguous tensor of [start, end) rows, on src's device when src is given; the rows of a CPU table
// must lie in [0, total), be sorted and not overlap: 0 <= start_i <= end_i <= total and end_{i-1} <= start_i
// (an empty row (e, e) fits in order). A CUDA table's rows are not read here (that would cost a device-to-host
// copy per call): mfsdp_ext/_native checks a CPU copy once per table version through check_segments.
// Returns n.
inline int64_t check_segment_table(const at::Tensor& segments, int64_t total, const char* fn,
                                   const at::Tensor* src = nullptr) {
  TORCH_CHECK_TYPE(segments.scalar_type() == at::kLong, "mfsdp_ext.", fn, ": segments must be int64, got ",
                   segments.scalar_type());
  TORCH_CHECK_VALUE(segments.dim() == 2 && segments.size(1) == 2, "mfsdp_ext.", fn,
              ": segments must have shape (n, 2) of [start, end) rows, got ", segments.sizes());
  check_contiguous(segments, fn, "segments");
  if (src != nullptr) check_same_device(segments, *src, fn, "segments", "src");
  const int64_t n = segments.size(0);
  if (!segments.is_cpu()) return n;
  const int64_t* s = segments.data_ptr<int64_t>();
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
  return n;
}

}  // namespace mfsdp
