// FP8 GEMM with per-tensor scales: out (M, N) = (a * scale_a) @ (b * scale_b).T (+ bias), out in out_dtype.
// a (M, K) and b (N, K) are row-major FP8 with the contraction dimension contiguous: the operand layout
// Hopper's FP8 tensor cores take, so no operand is copied. Semantics: mfsdp_ext/_native/__init__.py (fp8_gemm).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace mfsdp {

at::Tensor fp8_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                    const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool fast_accum);

// How many fp8_gemm calls this process has made (tests count the GEMMs of a Linear with it).
int64_t fp8_gemm_calls();

// Which implementation fp8_gemm runs on a CUDA tensor: "cublaslt" (this build's, with a per-shape plan cache) or
// "torch._scaled_mm" (a build without the cuBLASLt headers).
const char* fp8_gemm_cuda_backend();

}  // namespace mfsdp
