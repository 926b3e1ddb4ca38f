// Bit-exact number formats shared by the CPU (C++) and CUDA kernels of mfsdp_ext: conversions between fp32 and
// bf16 / fp16 / fp8, correctly rounded fp32 arithmetic, and the dtype tags the kernels are templated on.
//
// The CPU path (and the GPU below sm_80 / sm_89) converts with integer bit manipulation, no FMA contraction;
// newer GPUs use the hardware's cvt.rn conversions (see MFSDP_DEVICE_CVT), which round the same way. Both
// produce identical bits (the GPU tests compare them exhaustively):
//   * fp32 -> bf16 / fp16: round to nearest even (IEEE), overflow to +-inf as IEEE says.
//   * fp32 -> fp8 e4m3fn / e5m2: round to nearest even with explicit saturation to +-448 / +-57344
//     (inf saturates too); NaN stays NaN.
//   * NaN results are canonical: bf16 0x7FC0, fp16 0x7E00, fp8 0x7F, fp32 0x7FC00000 (fp32 only after
//     arithmetic; plain same-dtype copies keep the source bits).
// No torch or CUDA headers: it is included by .cpp and .cu files.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtype.h"
#include "host_device.h"

namespace mfsdp {

MFSDP_HD uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

MFSDP_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// fp32 multiply / fused multiply-add, correctly rounded, never contracted or flushed differently.
MFSDP_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;  // host code is compiled with -ffp-contract=off
#endif
}

MFSDP_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// a * b + c with one rounding (fused on both CPU and GPU)
MFSDP_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

MFSDP_HD bool is_nan_bits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

// ---------------------------------------------------------------------------------------------
// fp32 -> bf16 / fp16 (round to nearest even)
// ---------------------------------------------------------------------------------------------
// On the GPU the stores use the hardware's IEEE round-to-nearest-even conversions (cvt.rn / cvt.rn.satfinite,
// which handle subnormals and overflow exactly like the integer code below) with the NaN result
// canonicalised, so both give the same bits; tests compare the two on every fp32 bit pattern.
#if defined(__CUDA_ARCH__)
#define MFSDP_DEVICE_CVT 1
#endif

MFSDP_HD uint16_t f32_to_bf16_bits_sw(float f) {
  uint32_t x = f2u(f);
  if (is_nan_bits(x)) return 0x7FC0u;
  // x + 0x7FFF + lsb never overflows 32 bits (largest input 0xFF800000 = -inf)
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

MFSDP_HD uint16_t f32_to_bf16_bits(float f) {
#if defined(MFSDP_DEVICE_CVT) && __CUDA_ARCH__ >= 800
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return (f != f) ? static_cast<uint16_t>(0x7FC0u) : r;
#else
  return f32_to_bf16_bits_sw(f);
#endif
}

MFSDP_HD float bf16_bits_to_f32(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

MFSDP_HD uint16_t f32_to_f16_bits_sw(float f) {
  uint32_t x = f2u(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7FFFFFFFu;
  if (x > 0x7F800000u) return 0x7E00u;                          // NaN
  if (x >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (x >= 0x38800000u) {                                          // normal fp16 (>= 2^-14)
    x -= (112u << 23);                                             // rebias 127 -> 15
    x += 0xFFFu + ((x >> 13) & 1u);
    return static_cast<uint16_t>(sign | (x >> 13));
  }
  // fp16 subnormal (unit 2^-24) or zero
  const uint32_t e = x >> 23;
  if (e < 102u) return static_cast<uint16_t>(sign);  // < 2^-25 (half a unit, ties to even 0)
  const uint32_t m = (x & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  uint32_t r = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

MFSDP_HD uint16_t f32_to_f16_bits(float f) {
#if defined(MFSDP_DEVICE_CVT)
  uint16_t r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return (f != f) ? static_cast<uint16_t>(0x7E00u) : r;
#else
  return f32_to_f16_bits_sw(f);
#endif
}

MFSDP_HD float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1Fu) return u2f(sign | 0x7F800000u | (m << 13));  // inf / NaN
  if (e != 0) return u2f(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0) return u2f(sign);
  // subnormal: m * 2^-24, exact in fp32
  return u2f(sign | f2u(static_cast<float>(m) * 5.9604644775390625e-08f));
}

// ---------------------------------------------------------------------------------------------
// fp32 -> fp8 (round to nearest even, saturating), fp8 -> fp32
// Format: EB exponent bits, MB mantissa bits, bias BIAS, max finite code MAXC (448 / 57344).
// ---------------------------------------------------------------------------------------------
template <int MB, int BIAS, uint32_t MAX_F32_BITS, uint8_t MAXC>
MFSDP_HD uint8_t f32_to_fp8_sat(float f) {
  uint32_t x = f2u(f);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  x &= 0x7FFFFFFFu;
  if (x > 0x7F800000u) return 0x7Fu;                      // NaN (canonical, positive)
  if (x >= MAX_F32_BITS) return static_cast<uint8_t>(sign | MAXC);  // saturate (inf included)
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - BIAS) << 23;  // 2^(1-BIAS)
  if (x >= kMinNormal) {
    constexpr uint32_t kShift = 23 - MB;
    x -= static_cast<uint32_t>(127 - BIAS) << 23;
    x += ((1u << (kShift - 1)) - 1u) + ((x >> kShift) & 1u);
    return static_cast<uint8_t>(sign | (x >> kShift));  // x < max, so no overflow past MAXC
  }
  // subnormal fp8, unit 2^(1-BIAS-MB): r = round(value / unit)
  uint32_t e = x >> 23;
  uint32_t m = x & 0x7FFFFFu;
  if (e == 0) {
    e = 1;  // fp32 subnormal: value = m * 2^-149
  } else {
    m |= 0x800000u;
  }
  const uint32_t shift = static_cast<uint32_t>(151 - BIAS - MB) - e;  // >= 21 here
  if (shift > 25u) return sign;  // value < unit / 2 -> rounds to zero
  uint32_t r = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return static_cast<uint8_t>(sign | r);
}

template <int MB, int BIAS, bool HAS_INF>
MFSDP_HD float fp8_to_f32(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  constexpr int EB = 7 - MB;
  constexpr uint32_t kEMax = (1u << EB) - 1u;
  constexpr uint32_t kMMask = (1u << MB) - 1u;
  const uint32_t e = (v >> MB) & kEMax;
  const uint32_t m = v & kMMask;
  if (HAS_INF) {
    if (e == kEMax) return u2f(m ? 0x7FC00000u : (sign | 0x7F800000u));
  } else {
    if (e == kEMax && m == kMMask) return u2f(0x7FC00000u);
  }
  if (e != 0) return u2f(sign | ((e + 127u - BIAS) << 23) | (m << (23 - MB)));
  if (m == 0) return u2f(sign);
  // subnormal: m * 2^(1-BIAS-MB), exact
  return u2f(sign | f2u(static_cast<float>(m) * u2f(static_cast<uint32_t>(128 - BIAS - MB) << 23)));
}

// e4m3fn: bias 7, 3 mantissa bits, no inf, max 448 = 0x43E00000, code 0x7E
// e5m2:   bias 15, 2 mantissa bits, inf,   max 57344 = 0x47600000, code 0x7B
MFSDP_HD uint8_t f32_to_e4m3_bits_sw(float f) { return f32_to_fp8_sat<3, 7, 0x43E00000u, 0x7Eu>(f); }
MFSDP_HD uint8_t f32_to_e5m2_bits_sw(float f) { return f32_to_fp8_sat<2, 15, 0x47600000u, 0x7Bu>(f); }
MFSDP_HD uint8_t f32_to_e4m3_bits(float f) {
#if defined(MFSDP_DEVICE_CVT) && __CUDA_ARCH__ >= 890
  uint16_t r;  // b -> low byte; satfinite: +-inf and out-of-range saturate to +-448
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(f));
  return (f != f) ? static_cast<uint8_t>(0x7Fu) : static_cast<uint8_t>(r & 0xFFu);
#else
  return f32_to_e4m3_bits_sw(f);
#endif
}
MFSDP_HD uint8_t f32_to_e5m2_bits(float f) {
#if defined(MFSDP_DEVICE_CVT) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(f));
  return (f != f) ? static_cast<uint8_t>(0x7Fu) : static_cast<uint8_t>(r & 0xFFu);
#else
  return f32_to_e5m2_bits_sw(f);
#endif
}
#if defined(MFSDP_DEVICE_CVT) && __CUDA_ARCH__ >= 890
// fp8 -> f16 (exact) -> f32 (exact) in hardware; NaN stays NaN (payloads are canonicalised on every store)
#define MFSDP_FP8_DECODE(FMT)                                                                   \
  uint32_t h2;                                                                                  \
  asm("cvt.rn.f16x2." FMT "x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(v)));            \
  float f;                                                                                      \
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<uint16_t>(h2 & 0xFFFFu)));             \
  return f;
MFSDP_HD float e4m3_bits_to_f32(uint8_t v) { MFSDP_FP8_DECODE("e4m3") }
MFSDP_HD float e5m2_bits_to_f32(uint8_t v) { MFSDP_FP8_DECODE("e5m2") }
#undef MFSDP_FP8_DECODE
#else
MFSDP_HD float e4m3_bits_to_f32(uint8_t v) { return fp8_to_f32<3, 7, false>(v); }
MFSDP_HD float e5m2_bits_to_f32(uint8_t v) { return fp8_to_f32<2, 15, true>(v); }
#endif

// ---------------------------------------------------------------------------------------------
// dtype tags: raw storage type + exact conversions to / from fp32
// ---------------------------------------------------------------------------------------------
struct F32T {
  using raw = uint32_t;
  MFSDP_HD static float load(raw v) { return u2f(v); }
  MFSDP_HD static raw store(float f) { return is_nan_bits(f2u(f)) ? 0x7FC00000u : f2u(f); }
};
struct BF16T {
  using raw = uint16_t;
  MFSDP_HD static float load(raw v) { return bf16_bits_to_f32(v); }
  MFSDP_HD static raw store(float f) { return f32_to_bf16_bits(f); }
};
struct F16T {
  using raw = uint16_t;
  MFSDP_HD static float load(raw v) { return f16_bits_to_f32(v); }
  MFSDP_HD static raw store(float f) { return f32_to_f16_bits(f); }
};
struct E4M3T {
  using raw = uint8_t;
  static constexpr float max_value = 448.0f;
  MFSDP_HD static float load(raw v) { return e4m3_bits_to_f32(v); }
  MFSDP_HD static raw store(float f) { return f32_to_e4m3_bits(f); }
};
struct E5M2T {
  using raw = uint8_t;
  static constexpr float max_value = 57344.0f;
  MFSDP_HD static float load(raw v) { return e5m2_bits_to_f32(v); }
  MFSDP_HD static raw store(float f) { return f32_to_e5m2_bits(f); }
};

// Call f(tag) with the dtype tag type of d: float types only (anything else runs as F32T) / fp8 types only
// (anything else runs as E4M3T). Callers check d first.
template <class F>
decltype(auto) with_float_tag(DType d, F&& f) {
  switch (d) {
    case kBF16: return f(BF16T{});
    case kF16: return f(F16T{});
    default: return f(F32T{});
  }
}

template <class F>
decltype(auto) with_fp8_tag(DType d, F&& f) {
  if (d == kE5M2) return f(E5M2T{});
  return f(E4M3T{});
}

}  // namespace mfsdp
