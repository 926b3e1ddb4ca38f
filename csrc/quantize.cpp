// Entry points of fp8_quantize / fp8_transpose: check the tensors, fill the kernel's params and run it on the
// tensors' device (kernels: quantize_cpu.cpp, quantize_cuda.cu).
#include "quantize.h"

#include <cmath>

#include "device_launch.h"
#include "tensor_checks.h"

namespace mfsdp {
namespace {

// a one-element float32 output (scale_inv, amax) on `like`'s device
void check_scalar_out(const at::Tensor& t, const at::Tensor& like, const char* fn, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), "mfsdp_ext.", fn, ": ", what, " is undefined (None)");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "mfsdp_ext.", fn, ": ", what, " must be float32, got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.numel() == 1, "mfsdp_ext.", fn, ": ", what, " must have one element, got ", t.numel());
  check_same_device(t, like, fn, what, "src");
}

}  // namespace

void fp8_quantize(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& scale_inv,
                  const std::optional<at::Tensor>& amax, const std::optional<at::Tensor>& dst_t, double eps,
                  int64_t algo) {
  const char* fn = "fp8_quantize";
  check_flat(src, fn, "src");
  check_device_supported(src, fn);
  const DType sd = float_dtype(src, fn, "src");
  check_flat(dst, fn, "dst");
  const DType dd = float_dtype(dst, fn, "dst", /*want_fp8=*/true);
  check_same_device(src, dst, fn, "src", "dst");
  check_same_numel(src, dst, fn, "src", "dst");
  check_scalar_out(scale_inv, src, fn, "scale_inv");
  const bool has_amax = amax.has_value() && amax->defined();
  if (has_amax) check_scalar_out(*amax, src, fn, "amax");
  // the transpose sees src as (rows, cols): cols = the last dimension
  const int64_t cols = src.dim() > 0 ? src.size(-1) : 1;
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < src.dim(); ++d) rows *= src.size(d);
  const bool has_t = dst_t.has_value() && dst_t->defined();
  if (has_t) {
    check_flat(*dst_t, fn, "dst_t");
    TORCH_CHECK_TYPE(dst_t->scalar_type() == dst.scalar_type(), "mfsdp_ext.fp8_quantize: dst_t must have dst's dtype ",
                     dst.scalar_type(), ", got ", dst_t->scalar_type());
    check_same_device(*dst_t, src, fn, "dst_t", "src");
    TORCH_CHECK_VALUE(dst_t->dim() == 2 && dst_t->size(0) == cols && dst_t->size(1) == rows, "mfsdp_ext.fp8_quantize: "
                      "dst_t must have shape (", cols, ", ", rows, "): the transpose of src seen as (",
                      rows, ", ", cols, ") (rows = all leading dimensions), got ", dst_t->sizes());
  }
  TORCH_CHECK_VALUE(algo >= 0 && algo <= 2, "mfsdp_ext.fp8_quantize: algo must be 0 (auto), 1 (two-pass) or 2 "
                    "(fused), got ", algo);
  TORCH_CHECK_VALUE(std::isfinite(eps) && static_cast<float>(eps) > 0.0f,
                    "mfsdp_ext.fp8_quantize: eps must be a positive finite float32, got ", eps);
  if (src.is_meta()) return;
  check_no_overlap(src, dst, fn, "src", "dst");
  check_no_overlap(scale_inv, src, fn, "scale_inv", "src");
  check_no_overlap(scale_inv, dst, fn, "scale_inv", "dst");
  if (has_amax) check_no_overlap(scale_inv, *amax, fn, "scale_inv", "amax");
  if (has_t) {
    check_no_overlap(*dst_t, dst, fn, "dst_t", "dst");
    check_no_overlap(*dst_t, src, fn, "dst_t", "src");
  }
  Fp8QuantizeParams p{src.data_ptr(), sd, src.numel(), cols, dst.data_ptr(), has_t ? dst_t->data_ptr() : nullptr,
                      dd, scale_inv.data_ptr<float>(), has_amax ? amax->data_ptr<float>() : nullptr,
                      static_cast<float>(eps), static_cast<QuantizeAlgo>(algo), nullptr};
  at::Tensor workspace;  // CUDA two-pass: the partial amax of each block of its first kernel
#ifdef MFSDP_WITH_CUDA
  if (src.is_cuda()) {
    // the workspaces kept per stream (the fused kernel's counters, two-pass partials) belong to the stream, and a
    // captured graph may replay on any stream: under capture, two-pass with a workspace of its own
    c10::cuda::CUDAGuard guard(src.device());  // the sizes follow the device's SM count
    const bool capturing = cuda_stream_is_capturing(src);
    if (p.algo == kQuantizeFused && capturing) p.algo = kQuantizeTwoPass;
    if (p.algo != kQuantizeFused && capturing) {
      workspace = at::empty({cuda::fp8_quantize_workspace_words()}, src.options().dtype(at::kInt));
      p.workspace = reinterpret_cast<uint32_t*>(workspace.data_ptr<int32_t>());
    } else if (p.algo != kQuantizeFused) {
      int err = 0;
      p.workspace = cuda::fp8_quantize_stream_workspace(cuda_stream(src), &err);
      TORCH_CHECK(p.workspace != nullptr, "mfsdp_ext.fp8_quantize: workspace allocation failed: ",
                  cudaGetErrorString(static_cast<cudaError_t>(err)));
    }
  }
#endif
  run_kernel(src, fn, p);
}

void fp8_transpose(const at::Tensor& src, const at::Tensor& dst) {
  const char* fn = "fp8_transpose";
  check_flat(src, fn, "src");
  check_device_supported(src, fn);
  float_dtype(src, fn, "src", /*want_fp8=*/true);
  check_flat(dst, fn, "dst");
  TORCH_CHECK_TYPE(dst.scalar_type() == src.scalar_type(), "mfsdp_ext.fp8_transpose: dst must have src's dtype ",
                   src.scalar_type(), ", got ", dst.scalar_type());
  check_same_device(src, dst, fn, "src", "dst");
  TORCH_CHECK_VALUE(src.dim() == 2, "mfsdp_ext.fp8_transpose: src must be 2-D, got sizes ", src.sizes());
  TORCH_CHECK_VALUE(dst.dim() == 2 && dst.size(0) == src.size(1) && dst.size(1) == src.size(0),
                    "mfsdp_ext.fp8_transpose: dst must have shape (", src.size(1), ", ", src.size(0), "), got ",
                    dst.sizes());
  if (src.is_meta() || src.numel() == 0) return;
  check_no_overlap(src, dst, fn, "src", "dst");
  run_kernel(src, fn, Fp8TransposeParams{src.data_ptr(), src.size(0), src.size(1), dst.data_ptr()});
}

}  // namespace mfsdp
