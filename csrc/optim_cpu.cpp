// CPU kernel of the flat fused optimizer step (at::parallel_for over the buffer, walking the run table):
// the same per-element arithmetic as optim_cuda.cu (optim_math.h). Semantics: launch.h.
#include "cpu_kernel_utils.h"
#include "launch.h"
#include "optim_math.h"

namespace mfsdp {
namespace cpu {
namespace {

template <class G>
void adamw_runs(const OptimStepParams& p) {
  const auto* g = static_cast<const typename G::raw*>(p.grad);
  walk_segments(
      p.host_runs, p.num_runs, p.numel,
      [&](int64_t i, int64_t a, int64_t b) {
        const float* c = p.host_coeffs + kOptimCoeffs * i;
        for (int64_t j = a; j < b; ++j) adamw_update(p.param[j], G::load(g[j]), p.state0[j], p.state1[j], c);
      },
      [](int64_t, int64_t) {});
}

template <class G>
void sgd_runs(const OptimStepParams& p) {
  const auto* g = static_cast<const typename G::raw*>(p.grad);
  walk_segments(
      p.host_runs, p.num_runs, p.numel,
      [&](int64_t i, int64_t a, int64_t b) {
        const float* c = p.host_coeffs + kOptimCoeffs * i;
        if (static_cast<int>(c[kSgdFlags]) & kSgdMomentum) {
          for (int64_t j = a; j < b; ++j) sgd_update(p.param[j], G::load(g[j]), p.state0[j], c);
        } else {
          float unused = 0.0f;
          for (int64_t j = a; j < b; ++j) sgd_update(p.param[j], G::load(g[j]), unused, c);
        }
      },
      [](int64_t, int64_t) {});
}

}  // namespace

int launch(const OptimStepParams& p, void*) {
  with_float_tag(p.grad_dtype, [&](auto grad_tag) {
    using G = decltype(grad_tag);
    if (p.kind == kOptimAdamW) {
      adamw_runs<G>(p);
    } else {
      sgd_runs<G>(p);
    }
  });
  return 0;
}

}  // namespace cpu
}  // namespace mfsdp
