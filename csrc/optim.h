// Entry points (torch tensors in, checked) of the flat fused optimizer step: AdamW and SGD over the runs of
// a group's flat buffers in one kernel. Semantics: mfsdp_ext/_native/__init__.py docstring; arithmetic: optim_math.h.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace mfsdp {

void adamw_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const at::Tensor& runs, const at::Tensor& coeffs);
void sgd_step(const at::Tensor& param, const at::Tensor& grad, const std::optional<at::Tensor>& momentum_buffer,
              const at::Tensor& runs, const at::Tensor& coeffs);

}  // namespace mfsdp
