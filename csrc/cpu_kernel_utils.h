// Building blocks of the CPU kernels (cast_cpu.cpp, pack_cpu.cpp, quantize_cpu.cpp), mirroring kernel_utils.cuh:
// the split of a flat index space over the CPU threads, the segment walk, and the amax / copy / zero loops of
// one range.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "float_formats.h"
#include "segment_walk.h"

namespace mfsdp {
namespace cpu {

// elements per CPU task (at::parallel_for grain)
constexpr int64_t kGrain = 1 << 15;

// Split [0, total) into contiguous chunks over the CPU threads, each starting at a multiple of `align` elements;
// in each chunk find the first segment with end > chunk start (binary search) and walk forward (segment_walk.h):
// on_seg(i, p, q) / on_gap(p, q).
template <class OnSeg, class OnGap>
void walk_segments(const int64_t* seg, int64_t nseg, int64_t total, OnSeg&& on_seg, OnGap&& on_gap,
                   int64_t align = 1) {
  if (total <= 0) return;
  const int64_t blocks = (total + align - 1) / align;
  at::parallel_for(0, blocks, (kGrain + align - 1) / align, [&](int64_t k0, int64_t k1) {
    const int64_t b0 = k0 * align, b1 = k1 * align < total ? k1 * align : total;
    int64_t lo = 0, hi = nseg;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (seg[2 * mid + 1] <= b0) lo = mid + 1;
      else hi = mid;
    }
    walk_segments_from(seg, nseg, lo, b0, b1, on_seg, on_gap);
  });
}

// max |x| over n elements as fp32 bits (|x| >= 0 orders like its bit pattern; NaN bits are above inf, so a
// NaN wins, as on the GPU)
template <class In>
inline uint32_t amax_bits(const typename In::raw* src, int64_t n) {
  uint32_t m = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t a = f2u(In::load(src[j])) & 0x7FFFFFFFu;
    m = a > m ? a : m;
  }
  return m;
}

// dst[j] = Out(In(src[j]) * scale) for j < n (raw copy when the types match and no scale)
template <class In, class Out>
inline void copy_range(const typename In::raw* src, typename Out::raw* dst, int64_t n, float scale, bool use_scale) {
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
inline void zero_range(typename Out::raw* dst, int64_t n) {
  std::memset(dst, 0, static_cast<size_t>(n) * sizeof(typename Out::raw));
}

}  // namespace cpu
}  // namespace mfsdp
