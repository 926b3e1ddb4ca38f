"""The NCCL symmetric-memory implementations of the collectives protocol (see ``mfsdp_ext.comm.collectives``).

NCCL picks its symmetric kernels only when both buffers lie in registered windows and the group call holds one
collective, so both collectives are flat, through two staging buffers in the symmetric pool (SymmetricStages):
the all-gather writes this rank's shard into its slot of the stage, gathers in place, and unpacks the rank-major
result into the param-major buffer (one native copy); gradients are packed straight into the reduce-scatter
stage and reduced into a pool buffer. Each stage is used on one stream (all-gather / reduce-scatter), so one of
each suffices. Memory: the largest unit's gathered bytes plus its packed-gradient bytes (+ shard), whatever the
number of units; a stage that no unit uses is not allocated (0 bytes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ... import _native
from ...core.layout import align_up
from ..collectives import ParamGroup, SeparateCalls
from .comm import ALIGNMENT, SymmetricComm


class SymmetricStages:
    """The two staging buffers of one shard group, in a symmetric pool of our own communicator."""

    def __init__(self, group: dist.ProcessGroup, ag_bytes: int, rs_bytes: int):
        ag_bytes, rs_bytes = align_up(ag_bytes, ALIGNMENT), align_up(rs_bytes, ALIGNMENT)
        # Our own communicator: the process group's may run other collectives on its own stream meanwhile.
        self.comm = SymmetricComm(group, pool_bytes=ag_bytes + rs_bytes, borrow=False)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.ag_stage = self.comm.alloc_tensor(ag_bytes, torch.uint8) if ag_bytes else None
        self.rs_stage = self.comm.alloc_tensor(rs_bytes, torch.uint8) if rs_bytes else None

    @staticmethod
    def reduce_scatter_stage_bytes(rank_major_numel: int, world: int, dtype: torch.dtype) -> int:
        """Bytes of the reduce-scatter stage for one group: its packed input (aligned), then its output."""
        return _rs_output_offset(rank_major_numel, dtype) + rank_major_numel // world * dtype.itemsize

    def all_gather_buffers(self, shard_numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank-major stage of world * shard_numel, this rank's slot in it), both in the pool."""
        stage = self.ag_stage[: self.world * shard_numel * dtype.itemsize].view(dtype)
        return stage, stage[self.rank * shard_numel : (self.rank + 1) * shard_numel]

    def reduce_scatter_buffers(self, rank_major_numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed input of rank_major_numel, output of rank_major_numel / world), both in the pool."""
        size, out_at = dtype.itemsize, _rs_output_offset(rank_major_numel, dtype)
        packed = self.rs_stage[: rank_major_numel * size].view(dtype)
        out = self.rs_stage[out_at : out_at + rank_major_numel // self.world * size].view(dtype)
        return packed, out

    def close(self) -> None:
        self.comm.close()


def _rs_output_offset(rank_major_numel: int, dtype: torch.dtype) -> int:
    return align_up(rank_major_numel * dtype.itemsize, ALIGNMENT)


class SymmetricAllGather(SeparateCalls):
    """Shard into the stage, one flat symmetric all-gather in place, one native unpack into the parameters."""

    name = "symmetric"

    def __init__(self, stages: SymmetricStages):
        self.stages = stages

    def __call__(self, g: ParamGroup) -> None:
        stage, slot = self.stages.all_gather_buffers(g.layout.shard_numel, g.compute_dtype)
        g.write_shard(slot)
        self.stages.comm.all_gather_into(stage, slot)
        _native.unpack(stage, g.plan.rank_major_offsets, g.plan.unsharded_pieces)


class SymmetricReduceScatter(SeparateCalls):
    """Pack straight into the stage, one flat symmetric reduce-scatter into the pool; returns the pool output."""

    name = "symmetric"

    def __init__(self, stages: SymmetricStages):
        self.stages = stages

    def __call__(self, g: ParamGroup, scale: float) -> torch.Tensor:
        packed, reduced = self.stages.reduce_scatter_buffers(g.layout.rank_major_numel, g.reduce_dtype)
        g.grads.pack(packed, scale)
        self.stages.comm.reduce_scatter_into(reduced, packed)
        return reduced
