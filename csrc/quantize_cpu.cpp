// CPU kernels of the FP8 quantizer of one tensor (per-tensor current scaling, optional transpose) and of the FP8
// transpose (at::parallel_for). Same conversions and scales as quantize_cuda.cu, so both give the same bits.
// Semantics: launch.h.
#include <algorithm>
#include <atomic>

#include "cpu_kernel_utils.h"
#include "fp8_scaling.h"
#include "launch.h"

namespace mfsdp {
namespace cpu {
namespace {

constexpr int64_t kTransposeTile = 64;  // CPU transpose tile (bytes per side)

// dst (cols, rows) = src (rows, cols), bytes, in 64 x 64 tiles over the CPU threads
void transpose_u8(const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst) {
  const int64_t tr = (rows + kTransposeTile - 1) / kTransposeTile, tc = (cols + kTransposeTile - 1) / kTransposeTile;
  const int64_t grain = std::max<int64_t>(1, kGrain / (kTransposeTile * kTransposeTile));
  at::parallel_for(0, tr * tc, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = (t / tc) * kTransposeTile, c0 = (t % tc) * kTransposeTile;
      const int64_t r1 = std::min(rows, r0 + kTransposeTile), c1 = std::min(cols, c0 + kTransposeTile);
      for (int64_t c = c0; c < c1; ++c) {
        for (int64_t r = r0; r < r1; ++r) dst[c * rows + r] = src[r * cols + c];
      }
    }
  });
}

// max |x| over the whole tensor as fp32 bits, the threads' maxima merged with compare-and-swap
template <class In>
uint32_t parallel_amax_bits(const typename In::raw* s, int64_t n) {
  std::atomic<uint32_t> acc{0u};
  at::parallel_for(0, n, kGrain, [&](int64_t b0, int64_t b1) {
    const uint32_t m = amax_bits<In>(s + b0, b1 - b0);
    uint32_t cur = acc.load(std::memory_order_relaxed);
    while (m > cur && !acc.compare_exchange_weak(cur, m, std::memory_order_relaxed)) {
    }
  });
  return acc.load(std::memory_order_relaxed);
}

template <class In, class F8>
void quantize(const Fp8QuantizeParams& p) {
  const auto* s = static_cast<const typename In::raw*>(p.src);
  auto* d = static_cast<typename F8::raw*>(p.dst);
  const int64_t n = p.numel;
  const float amax = u2f(parallel_amax_bits<In>(s, n));
  const float scale = fp8_scale(amax, F8::max_value, p.eps);
  p.scale_inv[0] = fp8_scale_inv(scale);
  if (p.amax != nullptr) p.amax[0] = amax;
  at::parallel_for(0, n, kGrain, [&](int64_t b0, int64_t b1) {
    copy_range<In, F8>(s + b0, d + b0, b1 - b0, scale, true);
  });
  if (p.dst_t != nullptr) {
    const int64_t rows = p.cols > 0 ? n / p.cols : 0;
    transpose_u8(d, rows, p.cols, static_cast<uint8_t*>(p.dst_t));
  }
}

}  // namespace

// one way on the CPU: p.algo and p.workspace are not used
int launch(const Fp8QuantizeParams& p, void*) {
  with_float_tag(p.src_dtype, [&](auto in_tag) {
    with_fp8_tag(p.dst_dtype, [&](auto out_tag) { quantize<decltype(in_tag), decltype(out_tag)>(p); });
  });
  return 0;
}

int launch(const Fp8TransposeParams& p, void*) {
  transpose_u8(static_cast<const uint8_t*>(p.src), p.rows, p.cols, static_cast<uint8_t*>(p.dst));
  return 0;
}

}  // namespace cpu
}  // namespace mfsdp
