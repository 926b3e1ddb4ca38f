// fp8_gemm (fp8_gemm.h). On CUDA builds that found cuBLASLt's headers (MFSDP_WITH_CUBLASLT): cublasLtMatmul, with
// the algorithm and the matrix layouts chosen once per shape and kept. torch._scaled_mm builds its descriptors
// and asks cuBLASLt's heuristic on every call; in an eager FP8 Linear that host time, not the GPU, bounded the
// step. Elsewhere (CPU; CUDA without the headers): torch._scaled_mm, and on a CPU torch build that lacks it an
// fp32 emulation (dequantize, matmul) so the same code runs in CPU tests.
#include "fp8_gemm.h"

#include <atomic>
#include <c10/core/impl/LocalDispatchKeySet.h>  // ExcludeDispatchKeyGuard

#ifdef MFSDP_WITH_CUBLASLT
#include <ATen/cuda/CUDAContextLight.h>  // getCurrentCUDABlasLtHandle
#include <c10/cuda/CUDACachingAllocator.h>
#include <cublasLt.h>

#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "device_launch.h"  // cuda_stream_is_capturing (and the CUDA guard / stream headers)
#endif

namespace mfsdp {
namespace {

std::atomic<int64_t> gemm_calls{0};

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

void check_operand(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), "mfsdp_ext.fp8_gemm: ", what, " is undefined (None)");
  TORCH_CHECK_TYPE(is_fp8(t.scalar_type()), "mfsdp_ext.fp8_gemm: ", what,
                   " must be float8_e4m3fn or float8_e5m2, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.is_contiguous(), "mfsdp_ext.fp8_gemm: ", what,
                    " must be a contiguous 2-D tensor (rows, K), got sizes ", t.sizes(), " strides ", t.strides());
}

void check_scale(const at::Tensor& s, const at::Tensor& like, const char* what) {
  TORCH_CHECK_VALUE(s.defined(), "mfsdp_ext.fp8_gemm: ", what, " is undefined (None)");
  TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat && s.numel() == 1, "mfsdp_ext.fp8_gemm: ", what,
                   " must be a one-element float32 tensor, got ", s.scalar_type(), " with ", s.numel(), " elements");
  TORCH_CHECK_VALUE(s.device() == like.device(), "mfsdp_ext.fp8_gemm: ", what, " is on ", s.device(),
                    ", the operands on ", like.device());
}

// the GEMM epilogue adds a bias of the output's 16-bit dtype; any other bias is added afterwards
bool bias_fusable(const std::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  return bias.has_value() && bias->scalar_type() == out_dtype && out_dtype != at::kFloat;
}

at::Tensor add_bias(at::Tensor out, const std::optional<at::Tensor>& bias) {
  if (bias.has_value()) out.add_(bias->to(out.scalar_type()));
  return out;
}

// Whether this torch build runs torch._scaled_mm on CPU (e4m3 x e4m3 and e5m2 x e4m3); asked once.
bool cpu_has_scaled_mm() {
  static const bool has = [] {
    // Unseen by Python dispatch modes active at the first call: torch.utils.checkpoint's selective checkpointing
    // (torchtitan's default) records the forward's ops and replays them in order at recompute, which does not
    // probe again; the probe's 16 x 16 _scaled_mm outputs would then stand in for the layer's.
    c10::impl::ExcludeDispatchKeyGuard no_python_modes(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    try {
      const at::Tensor a = at::zeros({16, 16}, at::TensorOptions().dtype(at::kFloat8_e4m3fn));
      const at::Tensor one = at::ones({}, at::TensorOptions().dtype(at::kFloat));
      at::_scaled_mm(a, a.t(), one, one, std::nullopt, std::nullopt, at::kBFloat16, false);
      at::_scaled_mm(a.to(at::kFloat8_e5m2), a.t(), one, one, std::nullopt, std::nullopt, at::kBFloat16, false);
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return has;
}

at::Tensor torch_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                           const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                           bool fast_accum) {
  if (a.is_cpu() && !cpu_has_scaled_mm()) {
    // EMULATION for CPU torch builds without _scaled_mm: same operands and scales, fp32 arithmetic
    at::Tensor out =
        at::mm(a.to(at::kFloat), b.to(at::kFloat).t()).mul_(scale_a.to(at::kFloat) * scale_b.to(at::kFloat));
    if (bias.has_value()) out.add_(bias->to(at::kFloat));
    return out.to(out_dtype);
  }
  const bool fuse = bias_fusable(bias, out_dtype);
  at::Tensor out = at::_scaled_mm(a, b.t(), scale_a, scale_b, fuse ? bias : std::nullopt, std::nullopt, out_dtype,
                                  fast_accum);
  return fuse ? out : add_bias(out, bias);
}

#ifdef MFSDP_WITH_CUBLASLT
// ---------------------------------------------------------------------------------------------
// cuBLASLt with a plan cache
// ---------------------------------------------------------------------------------------------
constexpr uint64_t kMaxWorkspaceBytes = 32ull << 20;  // what torch gives cuBLASLt on Hopper
constexpr size_t kMaxPlans = 4096;                      // distinct shapes kept; past this the cache starts over

void check_lt(cublasStatus_t st, const char* what) {
  TORCH_CHECK(st == CUBLAS_STATUS_SUCCESS, "mfsdp_ext.fp8_gemm: ", what, " failed: ", cublasLtGetStatusString(st));
}

cudaDataType cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat8_e4m3fn: return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2: return CUDA_R_8F_E5M2;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: TORCH_CHECK_TYPE(false, "mfsdp_ext.fp8_gemm: unsupported dtype ", t);
  }
  return CUDA_R_32F;  // unreachable
}

// the largest power of two (<= 256) that divides the address: cuBLASLt's kernels are chosen for an alignment
uint32_t alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 1;
  while (a < 256 && v % (2 * a) == 0) a *= 2;
  return a;
}

struct MatmulDesc {
  cublasLtMatmulDesc_t d = nullptr;
  MatmulDesc() { check_lt(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate"); }
  ~MatmulDesc() { cublasLtMatmulDescDestroy(d); }
  MatmulDesc(const MatmulDesc&) = delete;
  MatmulDesc& operator=(const MatmulDesc&) = delete;
  template <class T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& value) {
    check_lt(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)), "cublasLtMatmulDescSetAttribute");
  }
};

struct PlanKey {
  int device;
  int64_t m, n, k;  // of the row-major product: out (m, n) = a (m, k) @ b (n, k).T
  int a_type, b_type, out_type, bias_type;  // bias_type -1: no fused bias
  bool fast_accum;
  uint32_t align_a, align_b, align_out, align_bias;
  bool operator==(const PlanKey& o) const {
    return device == o.device && m == o.m && n == o.n && k == o.k && a_type == o.a_type && b_type == o.b_type &&
           out_type == o.out_type && bias_type == o.bias_type && fast_accum == o.fast_accum &&
           align_a == o.align_a && align_b == o.align_b && align_out == o.align_out && align_bias == o.align_bias;
  }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& p) const {
    size_t h = std::hash<int64_t>()(p.m);
    auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(p.n);
    mix(p.k);
    mix((uint64_t(p.device) << 48) ^ (uint64_t(p.a_type) << 36) ^ (uint64_t(p.b_type) << 24) ^
        (uint64_t(p.out_type) << 12) ^ uint64_t(p.bias_type + 1) ^ (uint64_t(p.fast_accum) << 60));
    mix((uint64_t(p.align_a) << 48) ^ (uint64_t(p.align_b) << 32) ^ (uint64_t(p.align_out) << 16) ^ p.align_bias);
    return h;
  }
};

// The matrix layouts and the algorithm of one shape. cuBLAS is column-major: the row-major out (m, n) is the
// column-major D (n x m) = op(A) (n x k) @ op(B) (k x m) with A = b (k x n column-major, transposed: "TN", the
// only FP8 form Hopper has) and B = a (k x m column-major, as is).
struct Plan {
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  bool found = false;  // false: cuBLASLt has no algorithm for it; torch._scaled_mm then runs (and says why)
  ~Plan() {
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
  }
};

// the descriptor of one call: operand order, scales (A's is b's), fast accumulation, the bias epilogue
void describe(MatmulDesc& desc, const at::Tensor& b_scale, const at::Tensor& a_scale, bool fast_accum,
              const at::Tensor* bias) {
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(CUBLAS_OP_T));
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(CUBLAS_OP_N));
  desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b_scale.data_ptr());
  desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_scale.data_ptr());
  desc.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(fast_accum ? 1 : 0));
  if (bias != nullptr) {
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(CUBLASLT_EPILOGUE_BIAS));
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias->data_ptr());
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(cuda_type(bias->scalar_type())));
  }
}

std::shared_ptr<Plan> make_plan(const PlanKey& key, cublasLtHandle_t handle, MatmulDesc& desc) {
  auto plan = std::make_shared<Plan>();
  const auto out_type = static_cast<cudaDataType>(key.out_type);
  check_lt(cublasLtMatrixLayoutCreate(&plan->la, static_cast<cudaDataType>(key.b_type), key.k, key.n, key.k),
           "cublasLtMatrixLayoutCreate");
  check_lt(cublasLtMatrixLayoutCreate(&plan->lb, static_cast<cudaDataType>(key.a_type), key.k, key.m, key.k),
           "cublasLtMatrixLayoutCreate");
  check_lt(cublasLtMatrixLayoutCreate(&plan->ld, out_type, key.n, key.m, key.n), "cublasLtMatrixLayoutCreate");
  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t ws = kMaxWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_b,
                                       sizeof(uint32_t));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_a,
                                       sizeof(uint32_t));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_out,
                                       sizeof(uint32_t));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_out,
                                       sizeof(uint32_t));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, desc.d, plan->la, plan->lb, plan->ld, plan->ld,
                                                           pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
    plan->algo = result.algo;
    plan->workspace = result.workspaceSize;
    plan->found = true;
  }
  return plan;
}

std::shared_ptr<Plan> cached_plan(const PlanKey& key, cublasLtHandle_t handle, MatmulDesc& desc) {
  static std::mutex mu;
  static std::unordered_map<PlanKey, std::shared_ptr<Plan>, PlanKeyHash> plans;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
  }
  auto plan = make_plan(key, handle, desc);  // outside the lock: the heuristic takes tens of microseconds
  std::lock_guard<std::mutex> lock(mu);
  if (plans.size() >= kMaxPlans) plans.clear();  // a caller still holding a plan keeps it alive
  plans.emplace(key, plan);
  return plan;
}

// cuBLASLt's workspace of at least `bytes` for `stream`: kept per (device, stream) and grown when a plan needs
// more (calls on one stream run in order, so they share it; never freed: nothing to tear down at exit). Under
// graph capture, a fresh allocation held by `holder` (the graph may replay on another stream).
void* gemm_workspace(size_t bytes, int device, cudaStream_t stream, at::Tensor& holder, const at::Tensor& like) {
  if (cuda_stream_is_capturing(like)) {  // `stream` is like's current stream
    holder = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
    return holder.data_ptr();
  }
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, std::pair<void*, size_t>> spaces;
  std::lock_guard<std::mutex> lock(mu);
  auto& space = spaces[{device, stream}];
  if (space.second < bytes) {
    if (space.first != nullptr) c10::cuda::CUDACachingAllocator::raw_delete(space.first);
    space.first = c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, stream);
    space.second = bytes;
  }
  return space.first;
}

at::Tensor cublaslt_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                         const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                         bool fast_accum) {
  c10::cuda::CUDAGuard guard(a.device());
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  at::Tensor out = at::empty({m, n}, a.options().dtype(out_dtype));
  if (m == 0 || n == 0) return out;
  if (k == 0) return add_bias(out.zero_(), bias);
  const bool fuse = bias_fusable(bias, out_dtype);
  const at::Tensor* fused_bias = fuse ? &*bias : nullptr;
  const PlanKey key{static_cast<int>(a.device().index()), m, n, k, static_cast<int>(cuda_type(a.scalar_type())),
                    static_cast<int>(cuda_type(b.scalar_type())), static_cast<int>(cuda_type(out_dtype)),
                    fuse ? static_cast<int>(cuda_type(bias->scalar_type())) : -1, fast_accum, alignment(a.data_ptr()),
                    alignment(b.data_ptr()), alignment(out.data_ptr()), fuse ? alignment(bias->data_ptr()) : 0u};
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  MatmulDesc desc;
  describe(desc, scale_b, scale_a, fast_accum, fused_bias);
  const std::shared_ptr<Plan> plan = cached_plan(key, handle, desc);
  if (!plan->found) return torch_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, fast_accum);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(a.device().index()).stream();
  at::Tensor holder;
  void* workspace =
      plan->workspace > 0 ? gemm_workspace(plan->workspace, key.device, stream, holder, a) : nullptr;
  const float alpha = 1.0f, beta = 0.0f;
  check_lt(cublasLtMatmul(handle, desc.d, &alpha, b.data_ptr(), plan->la, a.data_ptr(), plan->lb, &beta,
                          out.data_ptr(), plan->ld, out.data_ptr(), plan->ld, &plan->algo, workspace,
                          plan->workspace, stream),
           "cublasLtMatmul");
  return fuse ? out : add_bias(out, bias);
}
#endif  // MFSDP_WITH_CUBLASLT

}  // namespace

at::Tensor fp8_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                    const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool fast_accum) {
  gemm_calls.fetch_add(1, std::memory_order_relaxed);
  check_operand(a, "a");
  check_operand(b, "b");
  TORCH_CHECK_VALUE(a.size(1) == b.size(1), "mfsdp_ext.fp8_gemm: a (M, K) and b (N, K) must share K, got sizes ",
                    a.sizes(), " and ", b.sizes());
  TORCH_CHECK_VALUE(a.device() == b.device(), "mfsdp_ext.fp8_gemm: a is on ", a.device(), ", b on ", b.device());
  TORCH_CHECK_TYPE(!(a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2),
                   "mfsdp_ext.fp8_gemm: a and b cannot both be float8_e5m2 (no FP8 GEMM takes two e5m2 operands)");
  TORCH_CHECK_TYPE(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
                   "mfsdp_ext.fp8_gemm: out_dtype must be bfloat16, float16 or float32, got ", out_dtype);
  check_scale(scale_a, a, "scale_a");
  check_scale(scale_b, a, "scale_b");
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == b.size(0) && bias->is_contiguous(),
                      "mfsdp_ext.fp8_gemm: bias must be contiguous of shape (", b.size(0), "), got sizes ",
                      bias->sizes());
    TORCH_CHECK_VALUE(bias->device() == a.device(), "mfsdp_ext.fp8_gemm: bias is on ", bias->device(),
                      ", the operands on ", a.device());
  }
#ifdef MFSDP_WITH_CUBLASLT
  if (a.is_cuda()) return cublaslt_gemm(a, b, scale_a, scale_b, bias, out_dtype, fast_accum);
#endif
  return torch_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, fast_accum);
}

int64_t fp8_gemm_calls() { return gemm_calls.load(std::memory_order_relaxed); }

const char* fp8_gemm_cuda_backend() {
#ifdef MFSDP_WITH_CUBLASLT
  return "cublaslt";
#else
  return "torch._scaled_mm";
#endif
}

}  // namespace mfsdp
