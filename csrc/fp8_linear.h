// The two native calls of an FP8 Linear (mfsdp_ext/fp8_linear.py): each quantizes its input with per-tensor
// current scaling and runs the FP8 GEMMs that need it, allocating every output here, so that a layer's forward and
// backward each cross from Python once. Semantics: mfsdp_ext/_native.py (fp8_linear_forward / fp8_linear_backward).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace mfsdp {

// y = x @ W.T (+ bias) with x quantized to e4m3. x (M, K) contiguous float32 / bfloat16 / float16; w8 (N, K) e4m3.
// Returns (y (M, N) in x's dtype, x8t (K, M) e4m3 when keep_x_t else None, x's scale_inv).
std::tuple<at::Tensor, std::optional<at::Tensor>, at::Tensor> fp8_linear_forward(
    const at::Tensor& x, const at::Tensor& w8, const at::Tensor& w_scale_inv, const std::optional<at::Tensor>& bias,
    bool keep_x_t, bool fast_accum, double eps, int64_t algo);

// dy (M, N) quantized to grad_dtype, then dx = dy @ W (when w8t (K, N) and w_scale_inv are given) in dx_dtype and
// dW = dy.T @ x (when x8t (K, M) and x_scale_inv are given) in dw_dtype. Returns (dx or None, dW or None).
std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> fp8_linear_backward(
    const at::Tensor& dy, at::ScalarType grad_dtype, const std::optional<at::Tensor>& w8t,
    const std::optional<at::Tensor>& w_scale_inv, const std::optional<at::Tensor>& x8t,
    const std::optional<at::Tensor>& x_scale_inv,
    at::ScalarType dx_dtype, at::ScalarType dw_dtype, double eps, int64_t algo);

}  // namespace mfsdp
