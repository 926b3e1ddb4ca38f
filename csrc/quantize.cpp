// fp8_quantize / fp8_transpose: input checks, the CPU kernels (at::parallel_for, the same conversions as the
// CUDA kernels, so the same bits) and the CUDA dispatch (quantize_cuda.cu).
#include "quantize.h"

#include <atomic>
#include <cmath>

#include "common.h"

namespace mfsdp {
namespace {

constexpr int64_t kCpuTile = 64;  // CPU transpose tile (bytes per side)

// a one-element float32 output (scale_inv, amax) on `like`'s device
void check_scalar_out(const at::Tensor& t, const at::Tensor& like, const char* fn, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), "mfsdp_ext.", fn, ": ", what, " is undefined (None)");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "mfsdp_ext.", fn, ": ", what, " must be float32, got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.numel() == 1, "mfsdp_ext.", fn, ": ", what, " must have one element, got ", t.numel());
  check_same_device(t, like, fn, what, "src");
}

// dst (cols, rows) = src (rows, cols), bytes, in 64 x 64 tiles over the CPU threads
void cpu_transpose_u8(const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst) {
  const int64_t tr = (rows + kCpuTile - 1) / kCpuTile, tc = (cols + kCpuTile - 1) / kCpuTile;
  const int64_t grain = std::max<int64_t>(1, kCpuGrain / (kCpuTile * kCpuTile));
  at::parallel_for(0, tr * tc, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = (t / tc) * kCpuTile, c0 = (t % tc) * kCpuTile;
      const int64_t r1 = std::min(rows, r0 + kCpuTile), c1 = std::min(cols, c0 + kCpuTile);
      for (int64_t c = c0; c < c1; ++c) {
        for (int64_t r = r0; r < r1; ++r) dst[c * rows + r] = src[r * cols + c];
      }
    }
  });
}

// max |x| as fp32 bits (NaN bits order above inf, so a NaN wins, as on the GPU)
template <class In>
uint32_t cpu_amax_bits(const typename In::raw* s, int64_t n) {
  std::atomic<uint32_t> acc{0u};
  at::parallel_for(0, n, kCpuGrain, [&](int64_t b0, int64_t b1) {
    uint32_t m = 0;
    for (int64_t j = b0; j < b1; ++j) {
      const uint32_t a = f2u(In::load(s[j])) & 0x7FFFFFFFu;
      m = a > m ? a : m;
    }
    uint32_t cur = acc.load(std::memory_order_relaxed);
    while (m > cur && !acc.compare_exchange_weak(cur, m, std::memory_order_relaxed)) {
    }
  });
  return acc.load(std::memory_order_relaxed);
}

template <class In, class F8>
void cpu_quantize(const at::Tensor& src, const at::Tensor& dst, float* scale_inv, float* amax_out,
                  uint8_t* dst_t, int64_t rows, int64_t cols, float eps) {
  const auto* s = static_cast<const typename In::raw*>(src.data_ptr());
  auto* d = static_cast<typename F8::raw*>(dst.data_ptr());
  const int64_t n = src.numel();
  const float amax = u2f(cpu_amax_bits<In>(s, n));
  const float scale = fp8_scale(amax, F8::max_value, eps);
  *scale_inv = fp8_scale_inv(scale);
  if (amax_out != nullptr) *amax_out = amax;
  at::parallel_for(0, n, kCpuGrain, [&](int64_t b0, int64_t b1) {
    cpu_copy_range<In, F8>(s + b0, d + b0, b1 - b0, scale, true);
  });
  if (dst_t != nullptr) cpu_transpose_u8(d, rows, cols, dst_t);
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
  TORCH_CHECK_VALUE(src.numel() == dst.numel(), "mfsdp_ext.fp8_quantize: src and dst must have the same number of "
                    "elements, got ", src.numel(), " and ", dst.numel());
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
  const float feps = static_cast<float>(eps);
  float* amax_ptr = has_amax ? amax->data_ptr<float>() : nullptr;
  void* dst_t_ptr = has_t ? dst_t->data_ptr() : nullptr;
  if (src.is_cpu()) {
    with_float_tag(sd, [&](auto in_tag) {
      with_fp8_tag(dd, [&](auto out_tag) {
        cpu_quantize<decltype(in_tag), decltype(out_tag)>(src, dst, scale_inv.data_ptr<float>(), amax_ptr,
                                                          static_cast<uint8_t*>(dst_t_ptr), rows, cols, feps);
      });
    });
    return;
  }
#ifdef MFSDP_WITH_CUDA
  c10::cuda::CUDAGuard guard(src.device());
  const int code = algo == 2 ? cuda::kQuantizeFused : cuda::kQuantizeTwoPass;  // auto: two-pass (quantize_cuda.cu)
  const at::Tensor workspace = at::empty({cuda::fp8_quantize_workspace_words()}, src.options().dtype(at::kInt));
  check_cuda(cuda::fp8_quantize(src.data_ptr(), sd, src.numel(), cols, dst.data_ptr(), dst_t_ptr, dd,
                                scale_inv.data_ptr<float>(), amax_ptr, feps, code,
                                reinterpret_cast<uint32_t*>(workspace.data_ptr<int32_t>()), cuda_stream(src)),
             fn);
#endif
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
  const auto* s = static_cast<const uint8_t*>(src.data_ptr());
  auto* d = static_cast<uint8_t*>(dst.data_ptr());
  if (src.is_cpu()) {
    cpu_transpose_u8(s, src.size(0), src.size(1), d);
    return;
  }
#ifdef MFSDP_WITH_CUDA
  c10::cuda::CUDAGuard guard(src.device());
  check_cuda(cuda::fp8_transpose(s, src.size(0), src.size(1), d, cuda_stream(src)), fn);
#endif
}

}  // namespace mfsdp
