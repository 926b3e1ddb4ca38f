// fp8_linear_forward / fp8_linear_backward (fp8_linear.h): fp8_quantize (quantize.cpp) and fp8_gemm (fp8_gemm.cpp)
// in one call each; the checks of the tensors are theirs.
#include "fp8_linear.h"

#include "fp8_gemm.h"
#include "quantize.h"

namespace mfsdp {
namespace {

void check_matrix(const at::Tensor& t, const char* fn, const char* what) {
  TORCH_CHECK_VALUE(t.defined() && t.dim() == 2, "mfsdp_ext.", fn, ": ", what, " must be 2-D, got ",
                    t.defined() ? t.sizes() : at::IntArrayRef{});
}

// an uninitialised (rows, cols) tensor of an FP8 dtype on like's device
at::Tensor fp8_empty(const at::Tensor& like, int64_t rows, int64_t cols, at::ScalarType dtype) {
  return at::empty({rows, cols}, like.options().dtype(dtype));
}

}  // namespace

std::tuple<at::Tensor, std::optional<at::Tensor>, at::Tensor> fp8_linear_forward(
    const at::Tensor& x, const at::Tensor& w8, const at::Tensor& w_scale_inv, const std::optional<at::Tensor>& bias,
    bool keep_x_t, bool fast_accum, double eps, int64_t algo) {
  const char* fn = "fp8_linear_forward";
  check_matrix(x, fn, "x");
  check_matrix(w8, fn, "w8");
  TORCH_CHECK_TYPE(w8.scalar_type() == at::kFloat8_e4m3fn, "mfsdp_ext.fp8_linear_forward: w8 must be float8_e4m3fn, "
                   "got ", w8.scalar_type());
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor x8 = fp8_empty(x, m, k, at::kFloat8_e4m3fn);
  at::Tensor x_scale_inv = at::empty({}, x.options().dtype(at::kFloat));
  std::optional<at::Tensor> x8t;
  if (keep_x_t) x8t = fp8_empty(x, k, m, at::kFloat8_e4m3fn);
  fp8_quantize(x, x8, x_scale_inv, std::nullopt, x8t, eps, algo);
  at::Tensor y = fp8_gemm(x8, w8, x_scale_inv, w_scale_inv, bias, x.scalar_type(), fast_accum);
  return {y, x8t, x_scale_inv};
}

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> fp8_linear_backward(
    const at::Tensor& dy, at::ScalarType grad_dtype, const std::optional<at::Tensor>& w8t,
    const std::optional<at::Tensor>& w_scale_inv, const std::optional<at::Tensor>& x8t,
    const std::optional<at::Tensor>& x_scale_inv,
    at::ScalarType dx_dtype, at::ScalarType dw_dtype, double eps, int64_t algo) {
  const char* fn = "fp8_linear_backward";
  check_matrix(dy, fn, "dy");
  const bool need_dx = w8t.has_value(), need_dw = x8t.has_value();
  TORCH_CHECK_VALUE(!need_dx || w_scale_inv.has_value(), "mfsdp_ext.fp8_linear_backward: w8t needs w_scale_inv");
  TORCH_CHECK_VALUE(!need_dw || x_scale_inv.has_value(), "mfsdp_ext.fp8_linear_backward: x8t needs x_scale_inv");
  std::optional<at::Tensor> dx, dw;
  if (!need_dx && !need_dw) return {dx, dw};
  const int64_t m = dy.size(0), n = dy.size(1);
  at::Tensor dy8 = fp8_empty(dy, m, n, grad_dtype);
  at::Tensor dy_scale_inv = at::empty({}, dy.options().dtype(at::kFloat));
  std::optional<at::Tensor> dy8t;
  if (need_dw) dy8t = fp8_empty(dy, n, m, grad_dtype);
  fp8_quantize(dy, dy8, dy_scale_inv, std::nullopt, dy8t, eps, algo);
  if (need_dx) dx = fp8_gemm(dy8, *w8t, dy_scale_inv, *w_scale_inv, std::nullopt, dx_dtype, false);
  if (need_dw) dw = fp8_gemm(*dy8t, *x8t, dy_scale_inv, *x_scale_inv, std::nullopt, dw_dtype, false);
  return {dx, dw};
}

}  // namespace mfsdp
