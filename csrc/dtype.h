// Dtype codes passed from the host glue to the CPU and CUDA launchers (launch.h), so that the launchers need
// no torch or CUDA types. The first three index per-dtype arrays (pack.cpp): keep their values.
#pragma once

namespace mfsdp {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kE4M3 = 3, kE5M2 = 4 };

inline bool is_float_dtype(DType d) { return d == kF32 || d == kBF16 || d == kF16; }
inline bool is_fp8_dtype(DType d) { return d == kE4M3 || d == kE5M2; }

}  // namespace mfsdp
