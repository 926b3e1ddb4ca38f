// FP8 per-tensor current scaling, shared by the CPU and CUDA kernels (the same fp32 operations on both, so
// every rank and every device computes the same scales).
#pragma once

#include "float_formats.h"

namespace mfsdp {

// scale = fp8_max / max(amax, eps); amax 0 / inf / NaN -> 1.
MFSDP_HD float fp8_scale(float amax, float fp8_max, float eps) {
  const uint32_t a = f2u(amax) & 0x7FFFFFFFu;
  if (a == 0u || a >= 0x7F800000u) return 1.0f;  // 0, inf, NaN
  const float d = (amax > eps) ? amax : eps;      // max(amax, eps)
  return div_rn(fp8_max, d);
}

MFSDP_HD float fp8_scale_inv(float scale) { return div_rn(1.0f, scale); }

}  // namespace mfsdp
