// Entry points of the flat fused optimizer step (adamw_step, sgd_step): check the tensors and the run table,
// fill OptimStepParams and run the kernel (optim_cpu.cpp, optim_cuda.cu). On CUDA the runs travel in the
// kernel's parameters up to kOptimInlineRuns and are uploaded through pinned memory above that.
#include "optim.h"

#include <string>

#include "device_launch.h"
#include "optim_cpu_simd.h"
#include "optim_math.h"
#include "tensor_checks.h"

namespace mfsdp {
namespace {

// an fp32 flat buffer of `numel` elements on param's device, not overlapping param
void check_state(const at::Tensor& t, const at::Tensor& param, const char* fn, const char* what) {
  check_flat(t, fn, what);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "mfsdp_ext.", fn, ": ", what, " must be float32, got ",
                   t.scalar_type());
  check_same_device(t, param, fn, what, "param");
  check_same_numel(t, param, fn, what, "param");
  if (!t.is_meta()) check_no_overlap(t, param, fn, what, "param");
}

// The checks both steps share; returns the number of runs.
int64_t check_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& runs, const at::Tensor& coeffs,
                   const char* fn) {
  check_flat(param, fn, "param");
  check_device_supported(param, fn);
  TORCH_CHECK_TYPE(param.scalar_type() == at::kFloat, "mfsdp_ext.", fn, ": param must be float32, got ",
                   param.scalar_type());
  check_flat(grad, fn, "grad");
  float_dtype(grad, fn, "grad");
  check_same_device(grad, param, fn, "grad", "param");
  check_same_numel(grad, param, fn, "grad", "param");
  TORCH_CHECK_VALUE(runs.defined() && runs.is_cpu(), "mfsdp_ext.", fn, ": runs must be a CPU tensor");
  const int64_t n = check_segment_table(runs, param.numel(), fn);
  TORCH_CHECK_VALUE(coeffs.defined() && coeffs.is_cpu() && coeffs.scalar_type() == at::kFloat && coeffs.dim() == 2 &&
                        coeffs.size(0) == n && coeffs.size(1) == kOptimCoeffs && coeffs.is_contiguous(),
                    "mfsdp_ext.", fn, ": coeffs must be a contiguous CPU float32 tensor of shape (", n, ", ",
                    kOptimCoeffs, "), got ", coeffs.scalar_type(), " ", coeffs.sizes(), " on ", coeffs.device());
  if (!param.is_meta()) check_no_overlap(grad, param, fn, "grad", "param");
  return n;
}

// A device table given by the caller: a CUDA byte buffer on param's device holding the runs (2n int64) then the
// coefficients (n x kOptimCoeffs float32), the layout run_step uploads.
void use_device_table(OptimStepParams& p, const std::optional<at::Tensor>& table, const at::Tensor& param,
                      const char* fn) {
  if (!table.has_value() || !table->defined()) return;
  const int64_t n = p.num_runs;
  const int64_t bytes = n * (2 * static_cast<int64_t>(sizeof(int64_t)) + kOptimCoeffs * static_cast<int64_t>(sizeof(float)));
  TORCH_CHECK_VALUE(table->is_cuda() && param.is_cuda() && table->device() == param.device() &&
                        table->is_contiguous() && table->nbytes() >= static_cast<size_t>(bytes) &&
                        reinterpret_cast<uintptr_t>(table->data_ptr()) % alignof(int64_t) == 0,
                    "mfsdp_ext.", fn, ": device_table must be a contiguous CUDA buffer on param's device of at least ",
                    bytes, " bytes (optim_device_table's layout), got ", table->sizes(), " on ", table->device());
  p.device_runs = static_cast<const int64_t*>(table->data_ptr());
  p.device_coeffs = reinterpret_cast<const float*>(p.device_runs + 2 * n);
}

void run_step(OptimStepParams& p, const at::Tensor& like, const char* fn) {
  if (p.num_runs == 0 || p.numel == 0 || like.is_meta()) return;
#ifdef MFSDP_WITH_CUDA
  at::Tensor device_runs;  // alive until the kernel is queued; the allocator orders its reuse after it
  if (like.is_cuda() && p.num_runs > kOptimInlineRuns && p.device_runs == nullptr) {  // runs, coefficients: one upload
    const int64_t n = p.num_runs;
    const std::string what = "more than " + std::to_string(kOptimInlineRuns) + " runs";
    device_runs = upload_table(
        {{p.host_runs, 2 * n * sizeof(int64_t)}, {p.host_coeffs, kOptimCoeffs * n * sizeof(float)}}, like, fn,
        what.c_str());
    p.device_runs = device_runs.data_ptr<int64_t>();
    p.device_coeffs = reinterpret_cast<const float*>(p.device_runs + 2 * n);
  }
#endif
  run_kernel(like, fn, p);
}

}  // namespace

void adamw_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const at::Tensor& runs, const at::Tensor& coeffs,
                const std::optional<at::Tensor>& device_table) {
  const char* fn = "adamw_step";
  const int64_t n = check_step(param, grad, runs, coeffs, fn);
  check_state(exp_avg, param, fn, "exp_avg");
  check_state(exp_avg_sq, param, fn, "exp_avg_sq");
  if (!param.is_meta()) {
    check_no_overlap(exp_avg, exp_avg_sq, fn, "exp_avg", "exp_avg_sq");
    check_no_overlap(grad, exp_avg, fn, "grad", "exp_avg");
    check_no_overlap(grad, exp_avg_sq, fn, "grad", "exp_avg_sq");
  }
  OptimStepParams p{kOptimAdamW, param.data_ptr<float>(), grad.data_ptr(), float_dtype(grad, fn, "grad"),
                    exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), param.numel(), runs.data_ptr<int64_t>(),
                    coeffs.data_ptr<float>(), nullptr, nullptr, n};
  use_device_table(p, device_table, param, fn);
  run_step(p, param, fn);
}

void sgd_step(const at::Tensor& param, const at::Tensor& grad, const std::optional<at::Tensor>& momentum_buffer,
              const at::Tensor& runs, const at::Tensor& coeffs, const std::optional<at::Tensor>& device_table) {
  const char* fn = "sgd_step";
  const int64_t n = check_step(param, grad, runs, coeffs, fn);
  float* buf = nullptr;
  if (momentum_buffer.has_value() && momentum_buffer->defined()) {
    check_state(*momentum_buffer, param, fn, "momentum_buffer");
    if (!param.is_meta()) check_no_overlap(grad, *momentum_buffer, fn, "grad", "momentum_buffer");
    buf = momentum_buffer->data_ptr<float>();
  } else {
    const float* c = coeffs.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK_VALUE(!(static_cast<int>(c[kOptimCoeffs * i + kSgdFlags]) & kSgdMomentum), "mfsdp_ext.sgd_step: run ",
                        i, " uses momentum but no momentum_buffer was given");
    }
  }
  OptimStepParams p{kOptimSgd, param.data_ptr<float>(), grad.data_ptr(), float_dtype(grad, fn, "grad"), buf, nullptr,
                    param.numel(), runs.data_ptr<int64_t>(), coeffs.data_ptr<float>(), nullptr, nullptr, n};
  use_device_table(p, device_table, param, fn);
  run_step(p, param, fn);
}

std::string cpu_simd() { return cpu::simd_path_name(cpu::optim_simd_path()); }

std::string set_cpu_simd(const std::string& name) {
  return cpu::simd_path_name(cpu::set_optim_simd_path(name.c_str()));
}

std::vector<std::string> cpu_simd_paths() {
  std::vector<std::string> out;
  for (int i = cpu::kNumSimdPaths - 1; i >= 0; --i) {
    const auto path = static_cast<cpu::SimdPath>(i);
    if (cpu::simd_path_supported(path)) out.emplace_back(cpu::simd_path_name(path));
  }
  return out;
}

}  // namespace mfsdp
