// Entry points of the main->model cast family: cast / segment_amax / fp8_cast / fp8_dequantize /
// grad_accumulate check their tensors, fill the kernel's params and run it on the tensors' device
// (kernels: cast_cpu.cpp, cast_cuda.cu). check_segments exposes the segment-table rule to Python.
#include "cast.h"

#include "device_launch.h"
#include "tensor_checks.h"

namespace mfsdp {
namespace {

// The checks of a (src, segments) pair. Returns the segment count; CPU tables are validated here.
int64_t check_src_segments(const at::Tensor& src, const at::Tensor& segments, const char* fn) {
  check_flat(src, fn, "src");
  check_device_supported(src, fn);
  TORCH_CHECK_VALUE(segments.defined(), "mfsdp_ext.", fn, ": segments is undefined");
  return check_segment_table(segments, src.numel(), fn, &src);
}

void check_per_segment(const at::Tensor& t, const at::Tensor& src, int64_t n, const char* fn, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), "mfsdp_ext.", fn, ": ", what, " is undefined");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "mfsdp_ext.", fn, ": ", what, " must be float32, got ", t.scalar_type());
  check_contiguous(t, fn, what);
  TORCH_CHECK_VALUE(t.numel() == n, "mfsdp_ext.", fn, ": ", what, " must have one element per segment (", n, "), got ",
              t.numel());
  check_same_device(t, src, fn, what, "src");
}

}  // namespace

void check_segments(const at::Tensor& segments, int64_t total) {
  TORCH_CHECK_VALUE(segments.defined() && segments.is_cpu(), "mfsdp_ext.check_segments: segments must be a CPU tensor");
  check_segment_table(segments.contiguous(), total, "check_segments");
}

void cast(const at::Tensor& src, const at::Tensor& dst) {
  const char* fn = "cast";
  check_flat(src, fn, "src");
  check_flat(dst, fn, "dst");
  check_device_supported(src, fn);
  check_same_device(src, dst, fn, "src", "dst");
  check_same_numel(src, dst, fn, "src", "dst");
  DType dd;
  TORCH_CHECK_TYPE(!(to_dtype(dst.scalar_type(), dd) && is_fp8_dtype(dd)),
              "mfsdp_ext.cast: dst is ", dst.scalar_type(), "; FP8 needs scales: use fp8_cast(src, segments, amax, dst, scale_inv)");
  const DType sd = float_dtype(src, fn, "src");
  dd = float_dtype(dst, fn, "dst");
  if (src.is_meta()) return;
  check_no_overlap(src, dst, fn, "src", "dst");
  const int64_t n = src.numel();
  if (n == 0) return;
  run_kernel(src, fn, CastParams{src.data_ptr(), sd, dst.data_ptr(), dd, n});
}

void segment_amax(const at::Tensor& src, const at::Tensor& segments, const at::Tensor& amax) {
  const char* fn = "segment_amax";
  const int64_t nseg = check_src_segments(src, segments, fn);
  const DType sd = float_dtype(src, fn, "src");
  check_per_segment(amax, src, nseg, fn, "amax");
  if (nseg == 0 || src.is_meta()) return;
  run_kernel(src, fn,
             SegmentAmaxParams{src.data_ptr(), sd, src.numel(), segments.data_ptr<int64_t>(), nseg,
                               amax.data_ptr<float>()});
}

void fp8_cast(const at::Tensor& src, const at::Tensor& segments, const at::Tensor& amax, const at::Tensor& dst,
              const at::Tensor& scale_inv, double eps) {
  const char* fn = "fp8_cast";
  const int64_t nseg = check_src_segments(src, segments, fn);
  const DType sd = float_dtype(src, fn, "src");
  check_flat(dst, fn, "dst");
  const DType dd = float_dtype(dst, fn, "dst", /*want_fp8=*/true);
  check_same_device(src, dst, fn, "src", "dst");
  check_same_numel(src, dst, fn, "src", "dst");
  check_per_segment(amax, src, nseg, fn, "amax");
  check_per_segment(scale_inv, src, nseg, fn, "scale_inv");
  if (src.is_meta()) return;
  check_no_overlap(src, dst, fn, "src", "dst");
  check_no_overlap(amax, scale_inv, fn, "amax", "scale_inv");
  run_kernel(src, fn,
             Fp8CastParams{src.data_ptr(), sd, src.numel(), segments.data_ptr<int64_t>(), nseg,
                           amax.data_ptr<float>(), static_cast<float>(eps), dst.data_ptr(), dd,
                           scale_inv.data_ptr<float>()});
}

void fp8_dequantize(const at::Tensor& src, const at::Tensor& segments, const at::Tensor& scale_inv,
                    const at::Tensor& dst) {
  const char* fn = "fp8_dequantize";
  const int64_t nseg = check_src_segments(src, segments, fn);
  const DType sd = float_dtype(src, fn, "src", /*want_fp8=*/true);
  check_flat(dst, fn, "dst");
  const DType dd = float_dtype(dst, fn, "dst");
  check_same_device(src, dst, fn, "src", "dst");
  check_same_numel(src, dst, fn, "src", "dst");
  check_per_segment(scale_inv, src, nseg, fn, "scale_inv");
  if (src.is_meta()) return;
  check_no_overlap(src, dst, fn, "src", "dst");
  run_kernel(src, fn,
             Fp8DequantizeParams{src.data_ptr(), sd, src.numel(), segments.data_ptr<int64_t>(), nseg,
                                 scale_inv.data_ptr<float>(), dst.data_ptr(), dd});
}

void grad_accumulate(const at::Tensor& main_grad, const at::Tensor& reduced, double scale, bool accumulate) {
  const char* fn = "grad_accumulate";
  check_flat(main_grad, fn, "main_grad");
  check_flat(reduced, fn, "reduced");
  check_device_supported(main_grad, fn);
  check_same_device(main_grad, reduced, fn, "main_grad", "reduced");
  // reduced: main_grad's numel, or (parts, numel): parts added in row order
  const int64_t parts = reduced.dim() == 2 ? reduced.size(0) : 1;
  TORCH_CHECK_VALUE((reduced.dim() == 2 && reduced.size(1) == main_grad.numel() && parts >= 1) ||
                        (reduced.dim() != 2 && reduced.numel() == main_grad.numel()),
                    "mfsdp_ext.grad_accumulate: reduced must have main_grad's ", main_grad.numel(),
                    " elements, or be (parts, ", main_grad.numel(), "), got ", reduced.sizes());
  const DType md = float_dtype(main_grad, fn, "main_grad");
  const DType rd = float_dtype(reduced, fn, "reduced");
  if (main_grad.is_meta()) return;
  check_no_overlap(main_grad, reduced, fn, "main_grad", "reduced");  // the kernel reads and writes through __restrict__
  const int64_t n = main_grad.numel();
  if (n == 0) return;
  run_kernel(main_grad, fn,
             GradAccumulateParams{main_grad.data_ptr(), md, reduced.data_ptr(), rd, n, static_cast<float>(scale),
                                  accumulate, parts});
}

}  // namespace mfsdp
