// CPU kernel of the flat fused optimizer step: at::parallel_for splits the buffer into one contiguous chunk per
// thread, each walks its part of the run table and steps every run's span with the per-element arithmetic of
// optim_math.h (the CUDA kernel's too). Semantics: launch.h.
//
// Three code paths with the same bits (optim_cpu_simd.h): AVX-512F and AVX + FMA + F16C vector loops
// (optim_cpu_vec.h, compiled for their ISA with function-level target attributes) and the portable scalar loop.
// One is picked at run time: the best this CPU supports, or MFSDP_CPU_SIMD / set_optim_simd_path's.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cpu_kernel_utils.h"
#include "launch.h"
#include "optim_cpu_simd.h"
#include "optim_math.h"

#if defined(MFSDP_CPU_SIMD_X86)
#include <cpuid.h>
#endif

namespace mfsdp {
namespace cpu {
namespace {

// one run's span: (param, grad, state0, state1, n, the run's coefficients), all pointers at the span's first
// element; state0 / state1 may be null where the step has no such state
using SpanFn = void (*)(float*, const void*, float*, float*, int64_t, const float*);

// ---------------------------------------------------------------------------------------------- scalar path
template <class G>
void adamw_span_scalar(float* p, const void* g, float* m, float* v, int64_t n, const float* c) {
  const auto* gr = static_cast<const typename G::raw*>(g);
  for (int64_t j = 0; j < n; ++j) adamw_update(p[j], G::load(gr[j]), m[j], v[j], c);
}

template <class G>
void sgd_span_scalar(float* p, const void* g, float* b, float*, int64_t n, const float* c) {
  const auto* gr = static_cast<const typename G::raw*>(g);
  if (static_cast<int>(c[kSgdFlags]) & kSgdMomentum) {
    for (int64_t j = 0; j < n; ++j) sgd_update(p[j], G::load(gr[j]), b[j], c);
  } else {
    float unused = 0.0f;
    for (int64_t j = 0; j < n; ++j) sgd_update(p[j], G::load(gr[j]), unused, c);
  }
}

// ---------------------------------------------------------------------------------------------- vector paths
#if defined(MFSDP_CPU_SIMD_X86)
namespace avx512 {
using Ops = Avx512Ops;
#define MFSDP_VEC_TARGET __attribute__((target("avx512f,fma")))
#include "optim_cpu_vec.h"
#undef MFSDP_VEC_TARGET
}  // namespace avx512

namespace avx {
using Ops = AvxOps;
#define MFSDP_VEC_TARGET __attribute__((target("avx,fma,f16c")))
#include "optim_cpu_vec.h"
#undef MFSDP_VEC_TARGET
}  // namespace avx
#endif

template <class G>
SpanFn span_fn(OptimKind kind, SimdPath path) {
  const bool adamw = kind == kOptimAdamW;
  switch (path) {
#if defined(MFSDP_CPU_SIMD_X86)
    case SimdPath::kAvx512: return adamw ? &avx512::adamw_span<G> : &avx512::sgd_span<G>;
    case SimdPath::kAvx: return adamw ? &avx::adamw_span<G> : &avx::sgd_span<G>;
#endif
    default: return adamw ? &adamw_span_scalar<G> : &sgd_span_scalar<G>;
  }
}

// ---------------------------------------------------------------------------------------------- path choice
constexpr const char* kPathNames[kNumSimdPaths] = {"scalar", "avx", "avx512"};

// -1 until the first use, which reads MFSDP_CPU_SIMD
std::atomic<int> g_path{-1};

SimdPath parse_path(const char* name, const char* what) {
  if (std::strcmp(name, "auto") == 0) return best_simd_path();
  for (int i = 0; i < kNumSimdPaths; ++i) {
    if (std::strcmp(name, kPathNames[i]) == 0) {
      const auto path = static_cast<SimdPath>(i);
      TORCH_CHECK_VALUE(simd_path_supported(path), "mfsdp_ext: ", what, " asks for the CPU SIMD path '", name,
                        "', which this CPU does not support (best here: '", simd_path_name(best_simd_path()), "')");
      return path;
    }
  }
  TORCH_CHECK_VALUE(false, "mfsdp_ext: ", what, ": unknown CPU SIMD path '", name,
                    "' (auto, scalar, avx, avx512)");
}

}  // namespace

const char* simd_path_name(SimdPath path) { return kPathNames[static_cast<int>(path)]; }

bool simd_path_supported(SimdPath path) {
#if defined(MFSDP_CPU_SIMD_X86)
  // __builtin_cpu_supports also checks that the OS saves the vector registers (XCR0) for avx / avx512f
  __builtin_cpu_init();
  switch (path) {
    case SimdPath::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
    case SimdPath::kAvx: {
      unsigned a = 0, b = 0, c = 0, d = 0;  // F16C from CPUID (not every compiler's __builtin_cpu_supports has it)
      const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
      return __builtin_cpu_supports("avx") && __builtin_cpu_supports("fma") && f16c;
    }
    default: break;
  }
#endif
  return path == SimdPath::kScalar;
}

SimdPath best_simd_path() {
  for (int i = kNumSimdPaths - 1; i > 0; --i) {
    if (simd_path_supported(static_cast<SimdPath>(i))) return static_cast<SimdPath>(i);
  }
  return SimdPath::kScalar;
}

SimdPath optim_simd_path() {
  int v = g_path.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("MFSDP_CPU_SIMD");
    v = static_cast<int>(parse_path(env && *env ? env : "auto", "MFSDP_CPU_SIMD"));
    g_path.store(v, std::memory_order_relaxed);
  }
  return static_cast<SimdPath>(v);
}

SimdPath set_optim_simd_path(const char* name) {
  const SimdPath path = parse_path(name, "set_cpu_simd");
  const int before = g_path.exchange(static_cast<int>(path));
  return before < 0 ? best_simd_path() : static_cast<SimdPath>(before);
}

int launch(const OptimStepParams& p, void*) {
  const SimdPath path = optim_simd_path();
  with_float_tag(p.grad_dtype, [&](auto grad_tag) {
    using G = decltype(grad_tag);
    const SpanFn fn = span_fn<G>(p.kind, path);
    const auto* grad = static_cast<const typename G::raw*>(p.grad);
    // chunk boundaries on 64-byte multiples of the buffers (one AVX-512 vector): no vector of a thread's chunk
    // straddles two threads' cache lines
    walk_segments(
        p.host_runs, p.num_runs, p.numel,
        [&](int64_t i, int64_t a, int64_t b) {
          fn(p.param + a, grad + a, p.state0 ? p.state0 + a : nullptr, p.state1 ? p.state1 + a : nullptr, b - a,
             p.host_coeffs + kOptimCoeffs * i);
        },
        [](int64_t, int64_t) {}, /*align=*/16);
  });
  return 0;
}

}  // namespace cpu
}  // namespace mfsdp
