// pack / unpack: many tensors <-> one flat buffer, with a dtype cast and a scale, in one pass.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace mfsdp {

// out[offsets[i] : offsets[i] + tensors[i].numel()] = cast(tensors[i].flatten() * scale); every element of
// out that no tensor covers is set to 0. One kernel launch on CUDA when all tensors share a dtype.
void pack(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets, const at::Tensor& out,
          double scale);

// The same with each source given as pieces: every row (t, first, count, offset) of `pieces` (a CPU int64 (n, 4)
// tensor, made once and reused) copies tensors[t].flatten()[first : first + count] to out[offset : offset + count].
// A missing tensor (None) leaves its pieces' ranges zero. E.g. gradients into a rank-major buffer, W pieces each.
void pack_pieces(const std::vector<std::optional<at::Tensor>>& tensors, const at::Tensor& pieces, const at::Tensor& out,
                 double scale);

// outs[i].view(-1)[:] = cast(flat[offsets[i] : offsets[i] + outs[i].numel()]). One launch per output dtype.
void unpack(const at::Tensor& flat, const std::vector<int64_t>& offsets, const std::vector<at::Tensor>& outs);

}  // namespace mfsdp
