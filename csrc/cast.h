// Entry points (torch tensors in, checked) of the fused main->model weight cast (fp32 -> bf16 / fp16 / fp8 with
// per-segment current scaling), per-segment amax, FP8 dequantize and the fp32 gradient accumulation.
// Semantics: mfsdp_ext/_native/__init__.py docstring.
#pragma once

#include <ATen/ATen.h>

namespace mfsdp {

void cast(const at::Tensor& src, const at::Tensor& dst);
void segment_amax(const at::Tensor& src, const at::Tensor& segments, const at::Tensor& amax);
void fp8_cast(const at::Tensor& src, const at::Tensor& segments, const at::Tensor& amax, const at::Tensor& dst,
              const at::Tensor& scale_inv, double eps);
void fp8_dequantize(const at::Tensor& src, const at::Tensor& segments, const at::Tensor& scale_inv,
                    const at::Tensor& dst);
void grad_accumulate(const at::Tensor& main_grad, const at::Tensor& reduced, double scale, bool accumulate);

// Validates a CPU segment table against a buffer of `total` elements (check_segment_table's rule); the Python
// layer runs it on a CPU copy of each CUDA table (cached), whose rows the kernels do not check.
void check_segments(const at::Tensor& segments, int64_t total);

}  // namespace mfsdp
