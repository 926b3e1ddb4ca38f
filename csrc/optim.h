// Entry points (torch tensors in, checked) of the flat fused optimizer step: AdamW and SGD over the runs of
// a group's flat buffers in one kernel. Semantics: mfsdp_ext/_native/__init__.py docstring; arithmetic: optim_math.h.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace mfsdp {

// device_table (CUDA only, optional): the same runs and coefficients already in device memory, as
// optim_device_table lays them out (2n int64 runs, then n x kOptimCoeffs float32): the kernel reads them there
// (nothing is uploaded, the launch is capturable in a CUDA graph, and a later copy into the table is seen).
void adamw_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const at::Tensor& runs, const at::Tensor& coeffs,
                const std::optional<at::Tensor>& device_table);
void sgd_step(const at::Tensor& param, const at::Tensor& grad, const std::optional<at::Tensor>& momentum_buffer,
              const at::Tensor& runs, const at::Tensor& coeffs, const std::optional<at::Tensor>& device_table);


// The code path of the CPU kernels (optim_cpu_simd.h): "avx512", "avx" or "scalar", all with the same bits.
// cpu_simd(): the one in effect; set_cpu_simd(name): force one ("auto": the best supported; ValueError for one this
// CPU lacks), returns the one before; cpu_simd_paths(): those this CPU supports, best first.
std::string cpu_simd();
std::string set_cpu_simd(const std::string& name);
std::vector<std::string> cpu_simd_paths();

}  // namespace mfsdp
