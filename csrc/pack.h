// pack / unpack: many tensors <-> one flat buffer, with a dtype cast and a scale, in one pass.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace mfsdp {

// out[offsets[i] : offsets[i] + tensors[i].numel()] = cast(tensors[i].flatten() * scale); every element of
// out that no tensor covers is set to 0. One kernel launch on CUDA when all tensors share a dtype.
void pack(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets, const at::Tensor& out,
          double scale);

// outs[i].view(-1)[:] = cast(flat[offsets[i] : offsets[i] + outs[i].numel()]). One launch per output dtype.
void unpack(const at::Tensor& flat, const std::vector<int64_t>& offsets, const std::vector<at::Tensor>& outs);

}  // namespace mfsdp
