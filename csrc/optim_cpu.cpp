// CPU kernel of the flat fused optimizer step (at::parallel_for over the buffer, walking the run table):
// the same per-element arithmetic as optim_cuda.cu (optim_math.h). Semantics: launch.h.
#include "cpu_kernel_utils.h"
#include "launch.h"
#include "optim_math.h"

namespace mfsdp {
namespace cpu {
namespace {

// fn(the run's coefficients, first, end) for every run; the elements between runs are not touched
template <class Fn>
void for_each_run(const OptimStepParams& p, Fn fn) {
  walk_segments(
      p.host_runs, p.num_runs, p.numel,
      [&](int64_t i, int64_t a, int64_t b) { fn(p.host_coeffs + kOptimCoeffs * i, a, b); },
      [](int64_t, int64_t) {});
}

template <class G>
void adamw_runs(const OptimStepParams& p) {
  const auto* g = static_cast<const typename G::raw*>(p.grad);
  for_each_run(p, [&](const float* c, int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) adamw_update(p.param[j], G::load(g[j]), p.state0[j], p.state1[j], c);
  });
}

template <class G>
void sgd_runs(const OptimStepParams& p) {
  const auto* g = static_cast<const typename G::raw*>(p.grad);
  for_each_run(p, [&](const float* c, int64_t a, int64_t b) {
    if (static_cast<int>(c[kSgdFlags]) & kSgdMomentum) {
      for (int64_t j = a; j < b; ++j) sgd_update(p.param[j], G::load(g[j]), p.state0[j], c);
    } else {
      float unused = 0.0f;
      for (int64_t j = a; j < b; ++j) sgd_update(p.param[j], G::load(g[j]), unused, c);
    }
  });
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
