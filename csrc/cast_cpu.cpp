// CPU kernels of the main->model cast family (at::parallel_for): plain cast, per-segment amax, FP8 cast with
// per-segment current scaling, FP8 dequantize, gradient accumulation. Same conversions, arithmetic and segment
// walk as cast_cuda.cu, so both give the same bits. Semantics: launch.h.
#include <atomic>
#include <memory>
#include <vector>

#include "cpu_kernel_utils.h"
#include "fp8_scaling.h"
#include "launch.h"

namespace mfsdp {
namespace cpu {
namespace {

// dst = src * scale[i] in segment i, 0 in the gaps (FP8 cast and dequantize)
template <class In, class Out>
void scaled_segment_copy(const void* src, int64_t numel, const int64_t* segments, int64_t nseg, void* dst,
                         const float* scale) {
  const auto* s = static_cast<const typename In::raw*>(src);
  auto* d = static_cast<typename Out::raw*>(dst);
  walk_segments(
      segments, nseg, numel,
      [&](int64_t i, int64_t p, int64_t q) { copy_range<In, Out>(s + p, d + p, q - p, scale[i], true); },
      [&](int64_t p, int64_t q) { zero_range<Out>(d + p, q - p); });
}

}  // namespace

int launch(const CastParams& p, void*) {
  with_float_tag(p.src_dtype, [&](auto in_tag) {
    with_float_tag(p.dst_dtype, [&](auto out_tag) {
      using In = decltype(in_tag);
      using Out = decltype(out_tag);
      const auto* s = static_cast<const typename In::raw*>(p.src);
      auto* d = static_cast<typename Out::raw*>(p.dst);
      at::parallel_for(0, p.numel, kGrain, [&](int64_t b0, int64_t b1) {
        copy_range<In, Out>(s + b0, d + b0, b1 - b0, 1.0f, false);
      });
    });
  });
  return 0;
}

int launch(const SegmentAmaxParams& p, void*) {
  const int64_t nseg = p.num_segments;
  // per-segment maxima as fp32 bits, merged across threads with compare-and-swap
  std::unique_ptr<std::atomic<uint32_t>[]> acc(new std::atomic<uint32_t>[nseg]);
  for (int64_t i = 0; i < nseg; ++i) acc[i].store(0u, std::memory_order_relaxed);
  with_float_tag(p.src_dtype, [&](auto in_tag) {
    using In = decltype(in_tag);
    const auto* s = static_cast<const typename In::raw*>(p.src);
    walk_segments(
        p.segments, nseg, p.numel,
        [&](int64_t i, int64_t a, int64_t b) {
          const uint32_t m = amax_bits<In>(s + a, b - a);
          uint32_t cur = acc[i].load(std::memory_order_relaxed);
          while (m > cur && !acc[i].compare_exchange_weak(cur, m, std::memory_order_relaxed)) {
          }
        },
        [](int64_t, int64_t) {});
  });
  for (int64_t i = 0; i < nseg; ++i) p.amax[i] = u2f(acc[i].load(std::memory_order_relaxed));
  return 0;
}

int launch(const Fp8CastParams& p, void*) {
  with_fp8_tag(p.dst_dtype, [&](auto out_tag) {
    using F8 = decltype(out_tag);
    std::vector<float> scale(p.num_segments);
    for (int64_t i = 0; i < p.num_segments; ++i) scale[i] = fp8_scale(p.amax[i], F8::max_value, p.eps);
    for (int64_t i = 0; i < p.num_segments; ++i) p.scale_inv[i] = fp8_scale_inv(scale[i]);
    with_float_tag(p.src_dtype, [&](auto in_tag) {
      scaled_segment_copy<decltype(in_tag), F8>(p.src, p.numel, p.segments, p.num_segments, p.dst, scale.data());
    });
  });
  return 0;
}

int launch(const Fp8DequantizeParams& p, void*) {
  with_fp8_tag(p.src_dtype, [&](auto in_tag) {
    with_float_tag(p.dst_dtype, [&](auto out_tag) {
      scaled_segment_copy<decltype(in_tag), decltype(out_tag)>(p.src, p.numel, p.segments, p.num_segments, p.dst,
                                                               p.scale_inv);
    });
  });
  return 0;
}

int launch(const GradAccumulateParams& p, void*) {
  with_float_tag(p.main_grad_dtype, [&](auto main_tag) {
    with_float_tag(p.reduced_dtype, [&](auto red_tag) {
      using Main = decltype(main_tag);
      using Red = decltype(red_tag);
      auto* m = static_cast<typename Main::raw*>(p.main_grad);
      const auto* r = static_cast<const typename Red::raw*>(p.reduced);
      const float scale = p.scale;
      at::parallel_for(0, p.numel, kGrain, [&](int64_t b0, int64_t b1) {
        for (int64_t part = 0; part < p.parts; ++part) {  // as one call per part (main_grad stored between)
          const auto* rp = r + part * p.numel;
          if (p.accumulate || part > 0) {
            for (int64_t j = b0; j < b1; ++j) m[j] = Main::store(fma_rn(scale, Red::load(rp[j]), Main::load(m[j])));
          } else {
            for (int64_t j = b0; j < b1; ++j) m[j] = Main::store(mul_rn(scale, Red::load(rp[j])));
          }
        }
      });
    });
  });
  return 0;
}

}  // namespace cpu
}  // namespace mfsdp
