// Entry points (torch tensors in, checked) of the FP8 quantizer of one tensor with per-tensor current scaling,
// and of the FP8 transpose. Semantics: mfsdp_ext/_native/__init__.py docstring (fp8_quantize, fp8_transpose).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace mfsdp {

// algo: a QuantizeAlgo code (launch.h): 0 auto, 1 two-pass, 2 fused (one launch; CUDA only, two-pass under
// graph capture)
void fp8_quantize(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& scale_inv,
                  const std::optional<at::Tensor>& amax, const std::optional<at::Tensor>& dst_t, double eps,
                  int64_t algo);
void fp8_transpose(const at::Tensor& src, const at::Tensor& dst);

}  // namespace mfsdp
