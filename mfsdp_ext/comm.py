"""Collectives on flat buffers: the torch.distributed path (the native symmetric path lives in symm_mem.py).

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single``; use what exists.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """output (world * n) <- concatenation of every rank's input (n), on the current stream."""
    _all_gather_flat(output, input, group=group)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """output (n) <- SUM over ranks of this rank's n-element slice of input (world * n)."""
    if _gloo_lacks_reduce_scatter(group):
        dist.all_reduce(input, group=group)
        rank = dist.get_rank(group)
        output.copy_(input[rank * output.numel() : (rank + 1) * output.numel()])
        return
    _reduce_scatter_flat(output, input, group=group)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM) -> None:
    dist.all_reduce(tensor, op=op, group=group)


_GLOO_RS_SUPPORT: dict[int, bool] = {}


def _gloo_lacks_reduce_scatter(group: dist.ProcessGroup) -> bool:
    """Older gloo builds have no flat reduce-scatter; probe once per group."""
    if dist.get_backend(group) != "gloo":
        return False
    key = id(group)
    if key not in _GLOO_RS_SUPPORT:
        world = dist.get_world_size(group)
        try:
            _reduce_scatter_flat(torch.zeros(1), torch.zeros(world), group=group)
            _GLOO_RS_SUPPORT[key] = True
        except (RuntimeError, NotImplementedError):
            _GLOO_RS_SUPPORT[key] = False
    return not _GLOO_RS_SUPPORT[key]
