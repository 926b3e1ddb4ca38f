"""The collectives of FSDP2's custom hooks (``set_custom_all_gather`` / ``set_custom_reduce_scatter``), called as FSDP2
calls them: the hook allocates the flat buffers and runs the collective, once per unit and collective (a unit's groups
of one dtype share the call, as FSDP2's one param group does).

  all-gather      ``output = comm.allocate((world * n,), dtype=compute dtype, device=...)`` where n is the groups'
                  shards together; this rank's shards are written into ``output[rank * n : (rank + 1) * n]`` (in place,
                  as FSDP2's copy-in), then ``comm(output_tensor=output, input_tensor=that slice, group=shard group,
                  async_op=False)``; the rank-major result is unpacked into the parameters (one native launch per group)
  reduce-scatter  ``input = comm.allocate((world * n,), dtype=reduce dtype, ...)`` holds the gradients packed
                  rank-major (one native launch), already divided (so the op is SUM), ``output = comm.allocate((n,),
                  ...)``, then ``comm(output_tensor=output, input_tensor=input, group=shard group, op=SUM,
                  async_op=False)``; each group's reduced shard is its part of ``output``

FP8 groups and groups split on a dim other than 0 keep their own collectives (``takes_custom``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import _native
from .collectives import ParamGroup


def takes_custom(g: ParamGroup) -> bool:
    """Whether a custom hook can carry the group's collectives (the others keep theirs)."""
    return g.world > 1 and not g.fp8 and not g.plan.staged


def _wait(work) -> None:
    if work is not None:
        work.wait()


def _rank_major(groups: Sequence[ParamGroup]) -> tuple[int, list[int]]:
    """(elements of one rank's part, each group's offset in it): the groups' shards back to back per rank."""
    offsets, n = [], 0
    for g in groups:
        offsets.append(n)
        n += g.layout.shard_numel
    return n, offsets


def _moved(offset: int, shard: int, base: int, n: int) -> int:
    """An offset into one group's rank-major buffer (rank r at r * shard) in the joint one (rank r at r * n)."""
    return (offset // shard) * n + base + offset % shard


class CustomAllGather:
    name = "custom"

    def __init__(self, comm: Any):
        self.comm = comm

    def __call__(self, g: ParamGroup) -> None:
        self._gather([g], end=False)  # ParamGroup.all_gather ends it

    def together_key(self, g: ParamGroup) -> Optional[tuple]:
        return id(self.comm), g.shard_group, g.compute_dtype

    def gather_together(self, groups: Sequence[ParamGroup]) -> None:
        self._gather(groups, end=True)

    def _gather(self, groups: Sequence[ParamGroup], end: bool) -> None:
        first = groups[0]
        n, bases = _rank_major(groups)
        output = self.comm.allocate((first.world * n,), dtype=first.compute_dtype, device=first.device)
        own = output[first.rank * n : (first.rank + 1) * n]
        for g, base in zip(groups, bases):
            g.unsharded.alloc()
            g.write_shard(own[base : base + g.layout.shard_numel])
        _wait(self.comm(output_tensor=output, input_tensor=own, group=first.shard_group, async_op=False))
        for g, base in zip(groups, bases):
            offsets = [_moved(o, g.layout.shard_numel, base, n) for o in g.plan.rank_major_offsets]
            with torch.autograd._unsafe_preserve_version_counter(g.unsharded.data):
                _native.unpack(output, offsets, g.plan.unsharded_pieces)
            if end:
                g.gather_end()


class CustomReduceScatter:
    name = "custom"

    def __init__(self, comm: Any):
        self.comm = comm

    def __call__(self, g: ParamGroup, scale: float) -> torch.Tensor:
        return self._scatter([g], scale)[0]  # GroupGradients.reduce_scatter counts it

    def together_key(self, g: ParamGroup) -> Optional[tuple]:
        return id(self.comm), g.shard_group, g.reduce_dtype

    def scatter_together(self, groups: Sequence[ParamGroup], scales: list[float]) -> list[torch.Tensor]:
        if len(set(scales)) > 1:  # one packing launch takes one scale
            return [self.scatter_together([g], [s])[0] for g, s in zip(groups, scales)]
        for g in groups:
            g.stats.reduces += 1
        return self._scatter(groups, scales[0])

    def _scatter(self, groups: Sequence[ParamGroup], scale: float) -> list[torch.Tensor]:
        first = groups[0]
        n, bases = _rank_major(groups)
        packed = self.comm.allocate((first.world * n,), dtype=first.reduce_dtype, device=first.device)
        tensors: list = []
        pieces = []
        for g, base in zip(groups, bases):
            for t, start, count, offset in g.plan.pieces:
                pieces.append((len(tensors) + t, start, count, _moved(offset, g.layout.shard_numel, base, n)))
            tensors += g.grads.local_grads()
        _native.pack_pieces(tensors, torch.tensor(pieces, dtype=torch.int64).reshape(-1, 4), packed, scale)
        reduced = self.comm.allocate((n,), dtype=first.reduce_dtype, device=first.device)
        _wait(self.comm(output_tensor=reduced, input_tensor=packed, group=first.shard_group, op=dist.ReduceOp.SUM,
                        async_op=False))
        return [reduced[base : base + g.layout.shard_numel] for g, base in zip(groups, bases)]
