// CUDA kernel of the flat fused optimizer step (AdamW, SGD): one launch over a group's flat buffers, driven
// by the run table (launch.h), which travels in the kernel's parameters when it has at most kOptimInlineRuns
// rows (no upload, capturable) and is read from device memory above that. Work split as the other kernels
// (kernel_utils.cuh: one wave of blocks striding over chunks, each chunk walked over the runs); inside a run
// the block reads and writes 4 elements per thread at a time: 16-byte loads and stores of param and state,
// 16-byte (fp32) or 8-byte (bf16 / fp16) loads of grad, when every buffer is aligned at the same element
// (always so for the flat buffers of one layout); element by element otherwise. The arithmetic is
// optim_math.h's, as on the CPU (optim_cpu.cpp).
#include <cuda_runtime.h>

#include "kernel_utils.cuh"
#include "launch.h"
#include "optim_math.h"

namespace mfsdp {
namespace cuda {
namespace {

using namespace detail;

constexpr int kVec = 4;  // fp32 elements per vector

struct Buffers {
  float* param;
  const void* grad;
  float* s0;  // exp_avg / momentum buffer
  float* s1;  // exp_avg_sq
};

struct InlineRuns {
  int64_t runs[2 * kOptimInlineRuns];
  float coeffs[kOptimCoeffs * kOptimInlineRuns];
};

__device__ __forceinline__ void load4(float (&x)[kVec], const float* p) {
  const float4 t = *reinterpret_cast<const float4*>(p);
  x[0] = t.x, x[1] = t.y, x[2] = t.z, x[3] = t.w;
}

__device__ __forceinline__ void store4(float* p, const float (&x)[kVec]) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}

template <class G>
__device__ __forceinline__ void load_grad4(float (&x)[kVec], const typename G::raw* p) {
  if constexpr (sizeof(typename G::raw) == 4) {
    const uint4 t = *reinterpret_cast<const uint4*>(p);
    x[0] = G::load(t.x), x[1] = G::load(t.y), x[2] = G::load(t.z), x[3] = G::load(t.w);
  } else {
    const uint2 t = *reinterpret_cast<const uint2*>(p);
    x[0] = G::load(static_cast<uint16_t>(t.x)), x[1] = G::load(static_cast<uint16_t>(t.x >> 16));
    x[2] = G::load(static_cast<uint16_t>(t.y)), x[3] = G::load(static_cast<uint16_t>(t.y >> 16));
  }
}

template <class G, OptimKind K>
__device__ __forceinline__ void step_one(const Buffers& b, int64_t j, const float* c, bool use_s0) {
  const float g = G::load(static_cast<const typename G::raw*>(b.grad)[j]);
  if constexpr (K == kOptimAdamW) {
    adamw_update(b.param[j], g, b.s0[j], b.s1[j], c);
  } else {
    float unused = 0.0f;
    sgd_update(b.param[j], g, use_s0 ? b.s0[j] : unused, c);
  }
}

// kVec elements of every stream, in registers
struct Lanes {
  float p[kVec], g[kVec], s0[kVec], s1[kVec];
};

template <class G, OptimKind K>
__device__ __forceinline__ void load_vec(Lanes& r, const Buffers& b, int64_t j, bool use_s0) {
  load4(r.p, b.param + j);
  load_grad4<G>(r.g, static_cast<const typename G::raw*>(b.grad) + j);
  if (use_s0) load4(r.s0, b.s0 + j);
  if constexpr (K == kOptimAdamW) load4(r.s1, b.s1 + j);
}

template <OptimKind K>
__device__ __forceinline__ void update_store_vec(Lanes& r, const Buffers& b, int64_t j, const float* c, bool use_s0) {
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    if constexpr (K == kOptimAdamW) {
      adamw_update(r.p[k], r.g[k], r.s0[k], r.s1[k], c);
    } else {
      sgd_update(r.p[k], r.g[k], r.s0[k], c);  // s0 is not stored back without momentum
    }
  }
  store4(b.param + j, r.p);
  if (use_s0) store4(b.s0 + j, r.s0);
  if constexpr (K == kOptimAdamW) store4(b.s1 + j, r.s1);
}

// Vectors [0, nvec) from element v0: two per thread per iteration, both loaded before either is stored (the
// stores could alias the next loads, so the compiler would not hoist them itself).
template <class G, OptimKind K>
__device__ __forceinline__ void step_vectors(const Buffers& b, int64_t v0, int64_t nvec, const float* c, bool use_s0) {
  const int64_t nt = blockDim.x;
  for (int64_t v = threadIdx.x; v < nvec; v += 2 * nt) {
    const bool second = v + nt < nvec;
    Lanes x, y;
    load_vec<G, K>(x, b, v0 + v * kVec, use_s0);
    if (second) load_vec<G, K>(y, b, v0 + (v + nt) * kVec, use_s0);
    update_store_vec<K>(x, b, v0 + v * kVec, c, use_s0);
    if (second) update_store_vec<K>(y, b, v0 + (v + nt) * kVec, c, use_s0);
  }
}

__device__ __forceinline__ bool aligned_at(const void* base, int64_t j, int esize, int bytes) {
  return ((reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(j) * esize) % bytes) == 0;
}

// Elements [a, q) of one run with the whole block; c: the run's coefficients.
template <class G, OptimKind K>
__device__ __forceinline__ void step_range(const Buffers& b, int64_t a, int64_t q, const float* coeffs) {
  float c[kOptimCoeffs];
#pragma unroll
  for (int k = 0; k < kOptimCoeffs; ++k) c[k] = coeffs[k];
  const bool use_s0 = K == kOptimAdamW || (static_cast<int>(c[kSgdFlags]) & kSgdMomentum);
  const int tid = threadIdx.x, nt = blockDim.x;
  constexpr int gsize = sizeof(typename G::raw);
  int64_t head = static_cast<int64_t>((16u - (reinterpret_cast<uintptr_t>(b.param + a) & 15u)) & 15u) / 4;
  if (head > q - a) head = q - a;
  const int64_t v0 = a + head;
  const bool vec = aligned_at(b.grad, v0, gsize, kVec * gsize) && (!use_s0 || aligned_at(b.s0, v0, 4, 16)) &&
                   (K != kOptimAdamW || aligned_at(b.s1, v0, 4, 16));
  const int64_t nvec = vec ? (q - v0) / kVec : 0;
  const int64_t vend = v0 + nvec * kVec;
  for (int64_t j = a + tid; j < v0 && nvec > 0; j += nt) step_one<G, K>(b, j, c, use_s0);
  step_vectors<G, K>(b, v0, nvec, c, use_s0);
  for (int64_t j = (nvec > 0 ? vend : a) + tid; j < q; j += nt) step_one<G, K>(b, j, c, use_s0);
}

template <class G, OptimKind K>
__device__ __forceinline__ void step_body(const Buffers& b, const int64_t* runs, const float* coeffs, int64_t n,
                                          int64_t total, int64_t chunk, int64_t nchunks) {
  int64_t hint = 0;
  for_each_chunk(chunk, nchunks, total, [&](int64_t b0, int64_t b1) {
    walk_segments(
        runs, n, hint, b0, b1,
        [&](int64_t i, int64_t p, int64_t q) { step_range<G, K>(b, p, q, coeffs + kOptimCoeffs * i); },
        [](int64_t, int64_t) {});
  });
}

template <class G, OptimKind K>
__global__ void __launch_bounds__(kThreads)
    optim_kernel(Buffers b, const int64_t* __restrict__ runs, const float* __restrict__ coeffs, int64_t n,
                 int64_t total, int64_t chunk, int64_t nchunks) {
  step_body<G, K>(b, runs, coeffs, n, total, chunk, nchunks);
}

// __grid_constant__: the runs are read in place from the parameter space (no per-thread copy)
template <class G, OptimKind K>
__global__ void __launch_bounds__(kThreads)
    optim_inline_kernel(const __grid_constant__ InlineRuns t, Buffers b, int64_t n, int64_t total, int64_t chunk,
                        int64_t nchunks) {
  step_body<G, K>(b, t.runs, t.coeffs, n, total, chunk, nchunks);
}

template <class G, OptimKind K>
int launch_step(const OptimStepParams& p, cudaStream_t stream) {
  const Buffers b{p.param, p.grad, p.state0, p.state1};
  const int64_t n = p.num_runs;
  const int64_t total = p.host_runs[2 * n - 1];  // the last run's end: nothing past it is touched
  if (total <= 0) return 0;
  if (n <= kOptimInlineRuns && p.device_runs == nullptr) {  // a caller's device table is read where it is
    InlineRuns t;
    for (int64_t k = 0; k < 2 * n; ++k) t.runs[k] = p.host_runs[k];
    for (int64_t k = 0; k < kOptimCoeffs * n; ++k) t.coeffs[k] = p.host_coeffs[k];
    auto kernel = optim_inline_kernel<G, K>;
    const Grid g = make_grid(reinterpret_cast<const void*>(kernel), total);
    kernel<<<g.blocks, kThreads, 0, stream>>>(t, b, n, total, g.chunk, g.nchunks);
  } else {
    if (p.device_runs == nullptr || p.device_coeffs == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    auto kernel = optim_kernel<G, K>;
    const Grid g = make_grid(reinterpret_cast<const void*>(kernel), total);
    kernel<<<g.blocks, kThreads, 0, stream>>>(b, p.device_runs, p.device_coeffs, n, total, g.chunk, g.nchunks);
  }
  return last_error();
}

}  // namespace

int launch(const OptimStepParams& p, void* stream) {
  if (p.num_runs <= 0 || p.numel <= 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return for_float(p.grad_dtype, [&](auto grad_tag) {
    using G = decltype(grad_tag);
    return p.kind == kOptimAdamW ? launch_step<G, kOptimAdamW>(p, s) : launch_step<G, kOptimSgd>(p, s);
  });
}

}  // namespace cuda
}  // namespace mfsdp
