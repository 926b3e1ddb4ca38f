// cast / segment_amax / fp8_cast / fp8_dequantize / grad_accumulate: input checks, the CPU kernels
// (at::parallel_for, same conversions and segment walk as the CUDA kernels) and the CUDA dispatch.
#include "cast.h"

#include <atomic>
#include <memory>

#include "common.h"

namespace mfsdp {
namespace {

// Common checks of a (src, segments) pair. Returns the segment count; CPU tables are validated here.
int64_t check_src_segments(const at::Tensor& src, const at::Tensor& segments, const char* fn) {
  check_flat(src, fn, "src");
  check_device_supported(src, fn);
  TORCH_CHECK_VALUE(segments.defined(), "mfsdp_ext.", fn, ": segments is undefined");
  const int64_t n = check_segment_table(segments, src, fn);
  if (segments.is_cpu() && !src.is_meta()) validate_segments_cpu(segments.data_ptr<int64_t>(), n, src.numel(), fn);
  return n;
}

void check_per_segment(const at::Tensor& t, const at::Tensor& src, int64_t n, const char* fn, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), "mfsdp_ext.", fn, ": ", what, " is undefined");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "mfsdp_ext.", fn, ": ", what, " must be float32, got ", t.scalar_type());
  check_contiguous(t, fn, what);
  TORCH_CHECK_VALUE(t.numel() == n, "mfsdp_ext.", fn, ": ", what, " must have one element per segment (", n, "), got ",
              t.numel());
  check_same_device(t, src, fn, what, "src");
}

void check_same_numel(const at::Tensor& a, const at::Tensor& b, const char* fn, const char* wa, const char* wb) {
  TORCH_CHECK_VALUE(a.numel() == b.numel(), "mfsdp_ext.", fn, ": ", wa, " and ", wb, " must have the same number of elements, got ",
              a.numel(), " and ", b.numel());
}

template <class In>
uint32_t cpu_amax_bits(const typename In::raw* src, int64_t n) {
  uint32_t m = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t a = f2u(In::load(src[j])) & 0x7FFFFFFFu;
    m = a > m ? a : m;
  }
  return m;
}

// dst = src * scale[i] in segment i, 0 in the gaps (FP8 cast and dequantize on the CPU)
template <class In, class Out>
void cpu_scaled_segment_copy(const at::Tensor& src, const at::Tensor& segments, int64_t nseg, const at::Tensor& dst,
                             const float* scale) {
  const auto* s = static_cast<const typename In::raw*>(src.data_ptr());
  auto* d = static_cast<typename Out::raw*>(dst.data_ptr());
  cpu_walk_segments(
      segments.data_ptr<int64_t>(), nseg, src.numel(),
      [&](int64_t i, int64_t p, int64_t q) { cpu_copy_range<In, Out>(s + p, d + p, q - p, scale[i], true); },
      [&](int64_t p, int64_t q) { cpu_zero_range<Out>(d + p, q - p); });
}

}  // namespace

void check_segments(const at::Tensor& segments, int64_t total) {
  const char* fn = "check_segments";
  TORCH_CHECK_VALUE(segments.defined() && segments.is_cpu(), "mfsdp_ext.check_segments: segments must be a CPU tensor");
  check_segment_shape(segments, fn);
  const at::Tensor s = segments.contiguous();
  validate_segments_cpu(s.data_ptr<int64_t>(), s.size(0), total, fn);
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
  if (src.is_cpu()) {
    with_float_tag(sd, [&](auto in_tag) {
      with_float_tag(dd, [&](auto out_tag) {
        using In = decltype(in_tag);
        using Out = decltype(out_tag);
        const auto* s = static_cast<const typename In::raw*>(src.data_ptr());
        auto* d = static_cast<typename Out::raw*>(dst.data_ptr());
        at::parallel_for(0, n, kCpuGrain, [&](int64_t b0, int64_t b1) {
          cpu_copy_range<In, Out>(s + b0, d + b0, b1 - b0, 1.0f, false);
        });
      });
    });
    return;
  }
#ifdef MFSDP_WITH_CUDA
  c10::cuda::CUDAGuard guard(src.device());
  check_cuda(cuda::cast(src.data_ptr(), sd, dst.data_ptr(), dd, n, cuda_stream(src)), fn);
#endif
}

void segment_amax(const at::Tensor& src, const at::Tensor& segments, const at::Tensor& amax) {
  const char* fn = "segment_amax";
  const int64_t nseg = check_src_segments(src, segments, fn);
  const DType sd = float_dtype(src, fn, "src");
  check_per_segment(amax, src, nseg, fn, "amax");
  if (nseg == 0 || src.is_meta()) return;
  const int64_t total = src.numel();
  if (src.is_cpu()) {
    const int64_t* seg = segments.data_ptr<int64_t>();
    std::unique_ptr<std::atomic<uint32_t>[]> acc(new std::atomic<uint32_t>[nseg]);
    for (int64_t i = 0; i < nseg; ++i) acc[i].store(0u, std::memory_order_relaxed);
    with_float_tag(sd, [&](auto in_tag) {
      using In = decltype(in_tag);
      const auto* s = static_cast<const typename In::raw*>(src.data_ptr());
      cpu_walk_segments(
          seg, nseg, total,
          [&](int64_t i, int64_t p, int64_t q) {
            const uint32_t m = cpu_amax_bits<In>(s + p, q - p);
            uint32_t cur = acc[i].load(std::memory_order_relaxed);
            while (m > cur && !acc[i].compare_exchange_weak(cur, m, std::memory_order_relaxed)) {
            }
          },
          [](int64_t, int64_t) {});
    });
    float* out = amax.data_ptr<float>();
    for (int64_t i = 0; i < nseg; ++i) out[i] = u2f(acc[i].load(std::memory_order_relaxed));
    return;
  }
#ifdef MFSDP_WITH_CUDA
  c10::cuda::CUDAGuard guard(src.device());
  check_cuda(cuda::segment_amax(src.data_ptr(), sd, total, segments.data_ptr<int64_t>(), nseg, amax.data_ptr<float>(),
                                cuda_stream(src)),
             fn);
#endif
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
  const float feps = static_cast<float>(eps);
  if (src.is_cpu()) {
    const float* am = amax.data_ptr<float>();
    with_fp8_tag(dd, [&](auto out_tag) {
      using F8 = decltype(out_tag);
      std::vector<float> scale(nseg);
      float* sinv = scale_inv.data_ptr<float>();
      for (int64_t i = 0; i < nseg; ++i) scale[i] = fp8_scale(am[i], F8::max_value, feps);
      for (int64_t i = 0; i < nseg; ++i) sinv[i] = fp8_scale_inv(scale[i]);
      with_float_tag(sd, [&](auto in_tag) {
        cpu_scaled_segment_copy<decltype(in_tag), F8>(src, segments, nseg, dst, scale.data());
      });
    });
    return;
  }
#ifdef MFSDP_WITH_CUDA
  c10::cuda::CUDAGuard guard(src.device());
  check_cuda(cuda::fp8_cast(src.data_ptr(), sd, src.numel(), segments.data_ptr<int64_t>(), nseg, amax.data_ptr<float>(), feps,
                            dst.data_ptr(), dd, scale_inv.data_ptr<float>(), cuda_stream(src)),
             fn);
#endif
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
  if (src.is_cpu()) {
    const float* sinv = scale_inv.data_ptr<float>();
    with_fp8_tag(sd, [&](auto in_tag) {
      with_float_tag(dd, [&](auto out_tag) {
        cpu_scaled_segment_copy<decltype(in_tag), decltype(out_tag)>(src, segments, nseg, dst, sinv);
      });
    });
    return;
  }
#ifdef MFSDP_WITH_CUDA
  c10::cuda::CUDAGuard guard(src.device());
  check_cuda(cuda::fp8_dequantize(src.data_ptr(), sd, src.numel(), segments.data_ptr<int64_t>(), nseg,
                                  scale_inv.data_ptr<float>(), dst.data_ptr(), dd, cuda_stream(src)),
             fn);
#endif
}

void grad_accumulate(const at::Tensor& main_grad, const at::Tensor& reduced, double scale, bool accumulate) {
  const char* fn = "grad_accumulate";
  check_flat(main_grad, fn, "main_grad");
  check_flat(reduced, fn, "reduced");
  check_device_supported(main_grad, fn);
  check_same_device(main_grad, reduced, fn, "main_grad", "reduced");
  check_same_numel(main_grad, reduced, fn, "main_grad", "reduced");
  const DType md = float_dtype(main_grad, fn, "main_grad");
  const DType rd = float_dtype(reduced, fn, "reduced");
  if (main_grad.is_meta()) return;
  check_no_overlap(main_grad, reduced, fn, "main_grad", "reduced");  // the kernel reads and writes through __restrict__
  const float fscale = static_cast<float>(scale);
  const int64_t n = main_grad.numel();
  if (n == 0) return;
  if (main_grad.is_cpu()) {
    with_float_tag(md, [&](auto main_tag) {
      with_float_tag(rd, [&](auto red_tag) {
        using Main = decltype(main_tag);
        using Red = decltype(red_tag);
        auto* m = static_cast<typename Main::raw*>(main_grad.data_ptr());
        const auto* r = static_cast<const typename Red::raw*>(reduced.data_ptr());
        at::parallel_for(0, n, kCpuGrain, [&](int64_t b0, int64_t b1) {
          if (accumulate) {
            for (int64_t j = b0; j < b1; ++j) m[j] = Main::store(fma_rn(fscale, Red::load(r[j]), Main::load(m[j])));
          } else {
            for (int64_t j = b0; j < b1; ++j) m[j] = Main::store(mul_rn(fscale, Red::load(r[j])));
          }
        });
      });
    });
    return;
  }
#ifdef MFSDP_WITH_CUDA
  c10::cuda::CUDAGuard guard(main_grad.device());
  check_cuda(cuda::grad_accumulate(main_grad.data_ptr(), md, reduced.data_ptr(), rd, n, fscale, accumulate,
                                   cuda_stream(main_grad)),
             fn);
#endif
}

}  // namespace mfsdp
