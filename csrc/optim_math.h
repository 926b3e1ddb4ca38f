// The per-element arithmetic of the flat fused optimizer step (AdamW, SGD), shared by the CPU kernel
// (optim_cpu.cpp) and the CUDA kernel (optim_cuda.cu), written in the order of torch's single-tensor
// implementations (torch/optim/adam.py _single_tensor_adam with decoupled weight decay, torch/optim/sgd.py
// _single_tensor_sgd) with each fp32 operation rounded once, so the CPU result equals torch's CPU result
// (except torch's CPU sqrt of large tensors, MKL VML, which is not correctly rounded; ours is):
// lerp, `add(x, alpha=a)` and addcmul as torch's vectorized CPU kernels compute them (one fused multiply-add:
// addcmul is fma(value * t1, t2, self)), addcdiv as `self + (value * t1) / t2` (checked against torch 2.13 in
// tests/optim/test_optim.py). optim_cpu_vec.h computes the same in vector lanes, operation for operation: change
// both together (tests/optim/test_cpu_optim.py compares the paths bit for bit).
//
// Per-run coefficients (kOptimCoeffs floats per run, computed on the host in double and rounded to fp32 as
// torch rounds its Python scalars):
//   AdamW: decay = 1 - lr * wd, w1 = 1 - beta1, beta2, omb2 = 1 - beta2, bc2_sqrt = sqrt(1 - beta2^step),
//          eps, neg_step = -lr / (1 - beta1^step), sign (-1 when maximize)
//   SGD:   wd, momentum, omd = 1 - dampening, neg_lr = -lr, sign, flags (kSgdMomentum | kSgdFirst | kSgdNesterov)
#pragma once

#include <cmath>

#include "float_formats.h"
#include "host_device.h"
#include "launch.h"  // kOptimCoeffs

namespace mfsdp {

enum AdamWCoeff : int { kAwDecay = 0, kAwW1, kAwBeta2, kAwOmb2, kAwBc2Sqrt, kAwEps, kAwNegStep, kAwSign };
enum SgdCoeff : int { kSgdWd = 0, kSgdMomentumValue, kSgdOmd, kSgdNegLr, kSgdSign, kSgdFlags };
// SGD flags (small integers stored exactly in the flags column)
enum SgdFlag : int { kSgdMomentum = 1, kSgdFirst = 2, kSgdNesterov = 4 };

MFSDP_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;  // host code is compiled with -ffp-contract=off
#endif
}

MFSDP_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

MFSDP_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// torch.lerp(start, end, w) as torch's vectorized CPU kernel: fma(w, end - start, start) for |w| < 0.5,
// else fma(w - 1, end - start, end)
MFSDP_HD float torch_lerp(float start, float end, float w) {
  const float d = sub_rn(end, start);
  return (w < 0.5f && w > -0.5f) ? fma_rn(w, d, start) : fma_rn(sub_rn(w, 1.0f), d, end);
}

// One element of AdamW: p, m (exp_avg), v (exp_avg_sq) updated in place from the gradient g.
MFSDP_HD void adamw_update(float& p, float g, float& m, float& v, const float* c) {
  g = mul_rn(g, c[kAwSign]);                                   // maximize: -grad (exact)
  p = mul_rn(p, c[kAwDecay]);                                  // param.mul_(1 - lr * wd)
  m = torch_lerp(m, g, c[kAwW1]);                              // exp_avg.lerp_(grad, 1 - beta1)
  v = fma_rn(mul_rn(c[kAwOmb2], g), g, mul_rn(v, c[kAwBeta2]));  // .mul_(beta2).addcmul_(g, g, 1 - beta2)
  const float denom = add_rn(div_rn(sqrt_rn(v), c[kAwBc2Sqrt]), c[kAwEps]);  // (v.sqrt() / bc2_sqrt).add_(eps)
  p = add_rn(p, div_rn(mul_rn(c[kAwNegStep], m), denom));      // param.addcdiv_(m, denom, value=-step_size)
}

// One element of SGD: p and (with kSgdMomentum) the momentum buffer b updated in place from the gradient g.
MFSDP_HD void sgd_update(float& p, float g, float& b, const float* c) {
  g = mul_rn(g, c[kSgdSign]);
  if (c[kSgdWd] != 0.0f) g = fma_rn(p, c[kSgdWd], g);          // grad.add(param, alpha=wd)
  const int flags = static_cast<int>(c[kSgdFlags]);
  if (flags & kSgdMomentum) {
    const float mom = c[kSgdMomentumValue];
    b = (flags & kSgdFirst) ? g : fma_rn(g, c[kSgdOmd], mul_rn(b, mom));  // clone, or .mul_(mom).add_(g, 1 - d)
    g = (flags & kSgdNesterov) ? fma_rn(b, mom, g) : b;       // grad.add(buf, alpha=momentum) or buf
  }
  p = fma_rn(g, c[kSgdNegLr], p);                              // param.add_(grad, alpha=-lr)
}

}  // namespace mfsdp
