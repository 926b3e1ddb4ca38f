// The FP8 Linear (mfsdp_ext/fp8/linear.py) as one autograd function in C++: forward and backward each quantize
// their input with per-tensor current scaling and run the FP8 GEMMs that need it, with no Python in between. In
// eager training the host time per layer, not the GPU, decided whether FP8 beat bf16. Semantics:
// mfsdp_ext/_native/__init__.py (fp8_linear, fp8_linear_forward / fp8_linear_backward).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace mfsdp {

// x (..., K) float32 / bfloat16 / float16 quantized to e4m3 with per-tensor current scaling, as fp8_linear does
// it: returns (x8 (M, K), x's scale_inv, x8t (K, M) when keep_x_t else None), M = x.numel() / K. Lets several
// layers that take the same input quantize it once (fp8_linear's x8 / x_scale_inv / x8t).
std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> fp8_quantize_input(const at::Tensor& x, bool keep_x_t,
                                                                                 double eps, int64_t algo);

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

// y = x @ W.T (+ bias) differentiable in x, weight and bias, computed from w8 (W in e4m3, (N, K)); dgrad uses w8t
// (its transpose (K, N)) when given, else transposes w8 in backward; weight's values are not read: it receives
// dW. x: (..., K) float32 / bfloat16 / float16. need_dx / need_dw: whether x / weight get gradients (grad mode
// and requires_grad, decided by the caller); fp8_wgrad: dW = dy.T @ x in FP8 (x's transpose kept from forward) or
// in x's dtype (x kept). x8 / x_scale_inv / x8t: x already quantized (fp8_quantize_input of this very x; x8t
// required when need_dw and fp8_wgrad), used instead of quantizing it again.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const at::Tensor& w8, const at::Tensor& w_scale_inv, const std::optional<at::Tensor>& w8t,
                      at::ScalarType grad_dtype, bool need_dx, bool need_dw, bool fp8_wgrad, bool fast_accum,
                      double eps, int64_t algo, const std::optional<at::Tensor>& x8 = std::nullopt,
                      const std::optional<at::Tensor>& x_scale_inv = std::nullopt,
                      const std::optional<at::Tensor>& x8t = std::nullopt);

}  // namespace mfsdp
