// The vector loops of the CPU optimizer kernels, written once and compiled once per ISA: optim_cpu.cpp includes
// this file (no include guard, on purpose) inside a namespace per ISA, with `Ops` (optim_cpu_simd.h) naming that
// ISA's operations and MFSDP_VEC_TARGET its target attribute, which every function here must carry for the ISA's
// always_inline intrinsics to inline into it.
//
// Each lane computes optim_math.h's adamw_update / sgd_update in the same order with the same roundings (fma
// exactly where it has fma_rn, separate mul and add elsewhere), so the bits equal the scalar path's. The last
// n % width elements of a span run adamw_update / sgd_update themselves. The per-run choices (lerp's form, SGD's
// flags) are uniform over a span and decided once, outside the loop.
//
// Span functions: (param, grad, state0, state1, n, the run's coefficients) over the span's first element
// (optim_cpu.cpp's SpanFn).

template <class G, bool kLerpFromStart>
MFSDP_VEC_TARGET void adamw_loop(float* p, const typename G::raw* g, float* m, float* v, int64_t n, const float* c) {
  using V = typename Ops::V;
  constexpr int kW = Ops::kWidth;
  const V sign = Ops::set1(c[kAwSign]), decay = Ops::set1(c[kAwDecay]), beta2 = Ops::set1(c[kAwBeta2]),
          omb2 = Ops::set1(c[kAwOmb2]), bc2_sqrt = Ops::set1(c[kAwBc2Sqrt]), eps = Ops::set1(c[kAwEps]),
          neg_step = Ops::set1(c[kAwNegStep]);
  // torch_lerp: fma(w, g - m, m) for |w| < 0.5, else fma(w - 1, g - m, g)
  const V w = Ops::set1(kLerpFromStart ? c[kAwW1] : sub_rn(c[kAwW1], 1.0f));
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const V gj = Ops::mul(Ops::load_grad(g + j, G{}), sign);
    const V pj = Ops::mul(Ops::load(p + j), decay);
    const V m0 = Ops::load(m + j);
    const V mj = Ops::fma(w, Ops::sub(gj, m0), kLerpFromStart ? m0 : gj);
    const V vj = Ops::fma(Ops::mul(omb2, gj), gj, Ops::mul(Ops::load(v + j), beta2));
    const V denom = Ops::add(Ops::div(Ops::sqrt(vj), bc2_sqrt), eps);
    Ops::store(p + j, Ops::add(pj, Ops::div(Ops::mul(neg_step, mj), denom)));
    Ops::store(m + j, mj);
    Ops::store(v + j, vj);
  }
  for (; j < n; ++j) adamw_update(p[j], G::load(g[j]), m[j], v[j], c);
}

template <class G>
MFSDP_VEC_TARGET void adamw_span(float* p, const void* g, float* m, float* v, int64_t n, const float* c) {
  const auto* gr = static_cast<const typename G::raw*>(g);
  const float w1 = c[kAwW1];
  if (w1 < 0.5f && w1 > -0.5f) {
    adamw_loop<G, true>(p, gr, m, v, n, c);
  } else {
    adamw_loop<G, false>(p, gr, m, v, n, c);
  }
}

template <class G>
MFSDP_VEC_TARGET void sgd_span(float* p, const void* g, float* b, float*, int64_t n, const float* c) {
  using V = typename Ops::V;
  constexpr int kW = Ops::kWidth;
  const auto* gr = static_cast<const typename G::raw*>(g);
  const int flags = static_cast<int>(c[kSgdFlags]);
  const bool with_wd = c[kSgdWd] != 0.0f, momentum = flags & kSgdMomentum, first = flags & kSgdFirst,
             nesterov = flags & kSgdNesterov;
  const V sign = Ops::set1(c[kSgdSign]), wd = Ops::set1(c[kSgdWd]), mom = Ops::set1(c[kSgdMomentumValue]),
          omd = Ops::set1(c[kSgdOmd]), neg_lr = Ops::set1(c[kSgdNegLr]);
  int64_t j = 0;
  // branches on run constants: predicted, and unswitched by the compiler
  for (; j + kW <= n; j += kW) {
    V gj = Ops::mul(Ops::load_grad(gr + j, G{}), sign);
    const V pj = Ops::load(p + j);
    if (with_wd) gj = Ops::fma(pj, wd, gj);
    if (momentum) {
      const V bj = first ? gj : Ops::fma(gj, omd, Ops::mul(Ops::load(b + j), mom));
      Ops::store(b + j, bj);
      gj = nesterov ? Ops::fma(bj, mom, gj) : bj;
    }
    Ops::store(p + j, Ops::fma(gj, neg_lr, pj));
  }
  float unused = 0.0f;
  for (; j < n; ++j) sgd_update(p[j], G::load(gr[j]), momentum ? b[j] : unused, c);
}
