// The vector ISAs of the CPU optimizer kernels (optim_cpu.cpp) and their operations: one struct per ISA whose
// members carry that ISA's function-level target attribute, so one binary holds every path and picks one at run
// time (cpu_simd_supported, __builtin_cpu_supports). Each operation is one correctly rounded IEEE fp32 operation
// per lane (add, sub, mul, div, sqrt; fma rounded once), the same as optim_math.h's scalar helpers, so a loop
// written with them in optim_math.h's order gives the scalar path's bits.
//
//   Avx512Ops: AVX-512F, 16 lanes (fp16 grads: vcvtph2ps zmm, part of AVX-512F)
//   AvxOps:    AVX + FMA3 + F16C, 8 lanes; no AVX2 needed: the float ops are AVX1, bf16 is widened with 128-bit
//              SSE2 unpacks (AVX1 has no 256-bit integer ops)
//
// x86-64 only; elsewhere (or built with -DMFSDP_CPU_SIMD_OFF) the kernels have the scalar path alone.
#pragma once

#include <cstdint>

#include "float_formats.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(MFSDP_CPU_SIMD_OFF)
#define MFSDP_CPU_SIMD_X86 1
#include <immintrin.h>
#endif

namespace mfsdp {
namespace cpu {

// The code paths of the CPU optimizer kernels, best last
enum class SimdPath : int { kScalar = 0, kAvx = 1, kAvx512 = 2 };
constexpr int kNumSimdPaths = 3;

// Defined in optim_cpu.cpp. Names: "scalar", "avx", "avx512".
const char* simd_path_name(SimdPath path);
bool simd_path_supported(SimdPath path);  // by this CPU and its OS (register state enabled)
SimdPath best_simd_path();
// The path adamw_step / sgd_step take on the CPU: set_optim_simd_path's, else MFSDP_CPU_SIMD's (read at the first
// call: auto | scalar | avx | avx512), else the best supported. Raises ValueError for an unknown or unsupported one.
SimdPath optim_simd_path();
// "auto" or a path name; raises ValueError (the path unchanged) for an unknown or unsupported one. Returns the
// path in effect before.
SimdPath set_optim_simd_path(const char* name);

#if defined(MFSDP_CPU_SIMD_X86)

// fma is listed for the scalar tails (std::fma inlined as one instruction); every CPU with AVX-512F has it
#define MFSDP_TARGET_AVX512 __attribute__((target("avx512f,fma"), always_inline)) inline
#define MFSDP_TARGET_AVX __attribute__((target("avx,fma,f16c"), always_inline)) inline

struct Avx512Ops {
  using V = __m512;
  static constexpr int kWidth = 16;
  MFSDP_TARGET_AVX512 static V set1(float x) { return _mm512_set1_ps(x); }
  MFSDP_TARGET_AVX512 static V load(const float* p) { return _mm512_loadu_ps(p); }
  MFSDP_TARGET_AVX512 static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  MFSDP_TARGET_AVX512 static V add(V a, V b) { return _mm512_add_ps(a, b); }
  MFSDP_TARGET_AVX512 static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  MFSDP_TARGET_AVX512 static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  MFSDP_TARGET_AVX512 static V div(V a, V b) { return _mm512_div_ps(a, b); }
  MFSDP_TARGET_AVX512 static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  MFSDP_TARGET_AVX512 static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
  // grads as fp32 (exact widening)
  MFSDP_TARGET_AVX512 static V load_grad(const F32T::raw* p, F32T) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  }
  MFSDP_TARGET_AVX512 static V load_grad(const BF16T::raw* p, BF16T) {
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));  // bf16 is the top half of an fp32
  }
  MFSDP_TARGET_AVX512 static V load_grad(const F16T::raw* p, F16T) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};

struct AvxOps {
  using V = __m256;
  static constexpr int kWidth = 8;
  MFSDP_TARGET_AVX static V set1(float x) { return _mm256_set1_ps(x); }
  MFSDP_TARGET_AVX static V load(const float* p) { return _mm256_loadu_ps(p); }
  MFSDP_TARGET_AVX static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  MFSDP_TARGET_AVX static V add(V a, V b) { return _mm256_add_ps(a, b); }
  MFSDP_TARGET_AVX static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  MFSDP_TARGET_AVX static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  MFSDP_TARGET_AVX static V div(V a, V b) { return _mm256_div_ps(a, b); }
  MFSDP_TARGET_AVX static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  MFSDP_TARGET_AVX static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  MFSDP_TARGET_AVX static V load_grad(const F32T::raw* p, F32T) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
  MFSDP_TARGET_AVX static V load_grad(const BF16T::raw* p, BF16T) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i zero = _mm_setzero_si128();
    // interleaving zeros below each bf16 puts it in the top half of a 32-bit lane: its fp32 value
    const __m128i lo = _mm_unpacklo_epi16(zero, h), hi = _mm_unpackhi_epi16(zero, h);
    return _mm256_castsi256_ps(_mm256_insertf128_si256(_mm256_castsi128_si256(lo), hi, 1));
  }
  MFSDP_TARGET_AVX static V load_grad(const F16T::raw* p, F16T) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};

#endif  // MFSDP_CPU_SIMD_X86

}  // namespace cpu
}  // namespace mfsdp
