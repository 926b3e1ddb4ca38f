"""What a rank holds of a full parameter, and back: torch.chunk's rows of a group's parameters (FSDP2's split).

A group's flat buffers hold each rank's local tensors: a tensor-parallel parameter's TP shard, split again here.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from .. import _native
from ..comm import dist_ops
from ..core import placements
from ..core.flat_buffer import FlatBuffer


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """What the flat buffers hold of ``p``: its local tensor when it is a (tensor-parallel) DTensor."""
    return p._local_tensor if isinstance(p, DTensor) else p


def local_rows(g, i: int, full: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``g``'s parameter i (torch.chunk's split), out of its unsharded local tensor (the whole
    parameter, or a tensor-parallel parameter's TP shard): a view, detached."""
    slot = g.layout.slots[i]
    full = full.detach().reshape(slot.shape)
    if slot.dim:  # an even split on that dim
        b = slot.shape[slot.dim] // g.world
        return full.narrow(slot.dim, g.rank * b, b)
    r0, r1 = g.layout.local_rows(slot, g.rank)
    return full[r0:r1]


def local_of_full(g, i: int, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``g``'s parameter i out of the full (global) tensor: its TP shard's rows for a
    tensor-parallel parameter (sliced locally, no communication)."""
    spec = g.infos[i].tp_spec
    if spec is not None:
        full = distribute_tensor(full.detach(), spec.mesh, spec.placements, src_data_rank=None)._local_tensor
    return local_rows(g, i, full)


def full_of_local(g, i: int, local: torch.Tensor) -> torch.Tensor:
    """Parameter i's full tensor from its gathered local tensor (``gather_full``): for a tensor-parallel parameter,
    its TP shards gathered too (a collective over the tensor-parallel mesh)."""
    spec = g.infos[i].tp_spec
    if spec is None:
        return local
    return DTensor(local, placements.with_dtype(spec, local.dtype), requires_grad=False).full_tensor()


def load_main_weight(g, params: list[torch.Tensor]) -> None:
    """Copy this rank's rows of each full parameter (local tensors) into ``g``'s main weight (padding zeroed, one
    native pack)."""
    local, offsets = [], []
    for i, (slot, p) in enumerate(zip(g.layout.slots, params)):
        rows = local_rows(g, i, p)
        if rows.numel() > 0:
            local.append(rows.to(g.main_weight.data.device, g.dtype).contiguous())
            offsets.append(slot.shard_offset)
    _native.pack(local, offsets, g.main_weight.data)


def gather_full(g, shard: FlatBuffer) -> FlatBuffer:
    """A new param-major buffer assembled from every rank's ``shard`` of ``g`` (a collective over the shard group), on
    the shard's device; its ``param_view(i)`` is parameter i. A shard in host memory (offload) is gathered on the
    mesh's device, then copied back."""
    home = shard.data.device
    if home != g.device:
        on_device = FlatBuffer(g.layout, shard.dtype, g.device, rank=g.rank)
        on_device.data.copy_(shard.data)
        shard = on_device
    full = FlatBuffer(g.layout, shard.dtype, g.device)
    if g.world == 1:
        full.data.copy_(shard.data)
    else:
        dist_ops.all_gather_into([full.padded_param(i) for i in g.plan.gathered],
                                 [shard.chunk_slot(i) for i in g.plan.gathered], g.shard_group)
        g.plan.unstage(full)
    if home != g.device:
        back = FlatBuffer(g.layout, full.dtype, home)
        back.data.copy_(full.data)
        return back
    return full
