// The walk of one range of the flat index space over a segment table, shared by the CPU kernels
// (cpu_kernel_utils.h) and the CUDA kernels (kernel_utils.cuh); only the search for the first segment differs.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace mfsdp {

// Walk [b0, b1) over seg (nseg rows of [start, end), sorted, non-overlapping), starting at row i, which must
// be the first row with end > b0: on_seg(i, p, q) for [p, q) inside row i, on_gap(p, q) for elements in no
// row. Every range handed out lies inside [b0, b1). Returns the row the walk stopped at (<= nseg).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // instantiated with device lambdas from the kernels, host lambdas on the CPU
#endif
template <class OnSeg, class OnGap>
MFSDP_HD int64_t walk_segments_from(const int64_t* seg, int64_t nseg, int64_t i, int64_t b0, int64_t b1,
                                    OnSeg&& on_seg, OnGap&& on_gap) {
  int64_t p = b0;
  while (p < b1) {
    int64_t s = b1, e = b1;
    if (i < nseg) {
      s = seg[2 * i];
      e = seg[2 * i + 1];
    }
    if (s > p) {
      const int64_t q = s < b1 ? s : b1;
      on_gap(p, q);
      p = q;
      continue;
    }
    if (e <= p) {
      ++i;
      continue;
    }
    const int64_t q = e < b1 ? e : b1;
    on_seg(i, p, q);
    p = q;
  }
  return i < nseg ? i : nseg;
}

}  // namespace mfsdp
