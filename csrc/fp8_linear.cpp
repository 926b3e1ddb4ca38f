// fp8_linear_forward / fp8_linear_backward (fp8_linear.h): fp8_quantize (quantize.cpp) and fp8_gemm (fp8_gemm.cpp)
// in one call each; the checks of the tensors are theirs. fp8_linear: a C++ autograd function over the same pieces
// (its forward also takes an input the caller quantized, fp8_quantize_input, shared by several layers).
#include "fp8_linear.h"

#include <torch/autograd.h>

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

std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> fp8_quantize_input(const at::Tensor& x, bool keep_x_t,
                                                                                 double eps, int64_t algo) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "mfsdp_ext.fp8_quantize_input: x must have a feature dimension, got a scalar");
  const int64_t k = x.size(-1);
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  at::Tensor x8 = fp8_empty(x2, m, k, at::kFloat8_e4m3fn);
  at::Tensor x_scale_inv = at::empty({}, x2.options().dtype(at::kFloat));
  std::optional<at::Tensor> x8t;
  if (keep_x_t) x8t = fp8_empty(x2, k, m, at::kFloat8_e4m3fn);
  fp8_quantize(x2, x8, x_scale_inv, std::nullopt, x8t, eps, algo);
  return {x8, x_scale_inv, x8t};
}

std::tuple<at::Tensor, std::optional<at::Tensor>, at::Tensor> fp8_linear_forward(
    const at::Tensor& x, const at::Tensor& w8, const at::Tensor& w_scale_inv, const std::optional<at::Tensor>& bias,
    bool keep_x_t, bool fast_accum, double eps, int64_t algo) {
  const char* fn = "fp8_linear_forward";
  check_matrix(x, fn, "x");
  check_matrix(w8, fn, "w8");
  TORCH_CHECK_TYPE(w8.scalar_type() == at::kFloat8_e4m3fn, "mfsdp_ext.fp8_linear_forward: w8 must be float8_e4m3fn, "
                   "got ", w8.scalar_type());
  auto [x8, x_scale_inv, x8t] = fp8_quantize_input(x, keep_x_t, eps, algo);
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

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
  // Optional tensors: autograd takes an absent one for no input at all (an undefined at::Tensor would not do).
  // bias stays third, so that when present it is autograd's input 2 (needs_input_grad counts present inputs).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& w8, const at::Tensor& w_scale_inv,
                            const std::optional<at::Tensor>& w8t, at::ScalarType grad_dtype, bool need_dx,
                            bool need_dw, bool fp8_wgrad, bool fast_accum, double eps, int64_t algo,
                            const std::optional<at::Tensor>& given_x8, const std::optional<at::Tensor>& given_x_scale_inv,
                            const std::optional<at::Tensor>& given_x8t) {
    const int64_t k = x.size(-1);
    const bool keep_x_t = need_dw && fp8_wgrad;
    TORCH_CHECK_TYPE(w8.scalar_type() == at::kFloat8_e4m3fn, "mfsdp_ext.fp8_linear: w8 must be float8_e4m3fn, got ",
                     w8.scalar_type());
    at::Tensor x8, x_scale_inv;
    std::optional<at::Tensor> x8t;
    if (given_x8) {  // quantized by the caller (fp8_quantize_input of this x), maybe for another layer too
      TORCH_CHECK_VALUE(given_x_scale_inv && (given_x8t || !keep_x_t) && given_x8->dim() == 2 &&
                            given_x8->size(1) == k && given_x8->numel() == x.numel(),
                        "mfsdp_ext.fp8_linear: x8 must be fp8_quantize_input(x) of this x, with x_scale_inv, and "
                        "x8t where the weight gradient is made in FP8");
      x8 = *given_x8;
      x_scale_inv = *given_x_scale_inv;
      if (keep_x_t) x8t = given_x8t;
    } else {
      std::tie(x8, x_scale_inv, x8t) = fp8_quantize_input(x, keep_x_t, eps, algo);
    }
    const at::Tensor y = fp8_gemm(x8, w8, x_scale_inv, w_scale_inv, bias, x.scalar_type(), fast_accum);
    const bool keep_x = need_dw && !fp8_wgrad;
    const at::Tensor x2 = keep_x ? x.reshape({-1, k}).contiguous() : at::Tensor();
    // saved: what backward reads (undefined where it reads nothing). For dgrad, the weight's transpose when the
    // caller has one, else the FP8 weight itself, transposed in backward: a transpose made here would stay alive
    // from forward to backward, though fully_shard frees the gathered weight in between (its saved view is
    // valid again after the backward's all-gather).
    const bool has_t = w8t.has_value();
    ctx->saved_data["w_transposed"] = has_t;
    ctx->save_for_backward({need_dx ? (has_t ? *w8t : w8) : at::Tensor(), need_dx ? w_scale_inv : at::Tensor(),
                            keep_x_t ? *x8t : at::Tensor(), keep_x_t ? x_scale_inv : at::Tensor(),
                            x2});
    ctx->saved_data["grad_dtype"] = static_cast<int64_t>(grad_dtype);
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->saved_data["b_dtype"] = static_cast<int64_t>(bias.has_value() ? bias->scalar_type() : x.scalar_type());
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["algo"] = algo;
    std::vector<int64_t> y_sizes = x.sizes().vec();
    y_sizes.back() = y.size(1);
    return y.view(y_sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &w_saved = saved[0], &w_scale_inv = saved[1], &x8t = saved[2], &x_scale_inv = saved[3],
                     &x2 = saved[4];
    const auto dtype = [ctx](const char* key) { return static_cast<at::ScalarType>(ctx->saved_data[key].toInt()); };
    const bool need_dx = ctx->needs_input_grad(0) && w_saved.defined();
    const bool need_dw = ctx->needs_input_grad(1);
    const bool need_db = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
    const at::Tensor& dy = grads[0];
    const at::Tensor dy2 = dy.reshape({-1, dy.size(-1)}).contiguous();
    at::Tensor dx, dw, db;
    const bool fp8_dw = need_dw && x8t.defined();
    if (need_dx || fp8_dw) {
      at::Tensor w8t;
      if (need_dx) {
        w8t = w_saved;
        if (!ctx->saved_data["w_transposed"].toBool()) {
          w8t = at::empty({w_saved.size(1), w_saved.size(0)}, w_saved.options());
          fp8_transpose(w_saved, w8t);
        }
      }
      auto [dx_opt, dw_opt] = fp8_linear_backward(
          dy2, dtype("grad_dtype"), need_dx ? std::optional<at::Tensor>(w8t) : std::nullopt,
          need_dx ? std::optional<at::Tensor>(w_scale_inv) : std::nullopt,
          fp8_dw ? std::optional<at::Tensor>(x8t) : std::nullopt,
          fp8_dw ? std::optional<at::Tensor>(x_scale_inv) : std::nullopt, dtype("x_dtype"), dtype("w_dtype"),
          ctx->saved_data["eps"].toDouble(), ctx->saved_data["algo"].toInt());
      if (dx_opt) dx = dx_opt->view(ctx->saved_data["x_sizes"].toIntVector());
      if (dw_opt) dw = *dw_opt;
    }
    if (need_dw && !fp8_dw) dw = at::mm(dy2.t(), x2.to(dy2.scalar_type())).to(dtype("w_dtype"));
    if (need_db) db = dy2.sum(0).to(dtype("b_dtype"));
    variable_list out(16);  // one per argument of forward after ctx
    out[0] = dx;
    out[1] = dw;
    out[2] = db;
    return out;
  }
};

}  // namespace

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const at::Tensor& w8, const at::Tensor& w_scale_inv, const std::optional<at::Tensor>& w8t,
                      at::ScalarType grad_dtype, bool need_dx, bool need_dw, bool fp8_wgrad, bool fast_accum,
                      double eps, int64_t algo, const std::optional<at::Tensor>& x8,
                      const std::optional<at::Tensor>& x_scale_inv, const std::optional<at::Tensor>& x8t) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && w8.dim() == 2 && x.size(-1) == w8.size(1),
                    "mfsdp_ext.fp8_linear: x (..., K) and w8 (N, K) must share K, got sizes ", x.sizes(), " and ",
                    w8.sizes());
  const auto present = [](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->defined() ? t : std::optional<at::Tensor>();
  };
  return Fp8LinearFunction::apply(x, weight, present(bias), w8, w_scale_inv, present(w8t), grad_dtype, need_dx,
                                  need_dw, fp8_wgrad, fast_accum, eps, algo, present(x8), present(x_scale_inv),
                                  present(x8t));
}

}  // namespace mfsdp
