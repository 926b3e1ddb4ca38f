"""Collectives on flat buffers: the torch.distributed path (the native symmetric path lives in symm_mem.py).

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single``; use what exists.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import _align_up
from .symm_mem import ALIGNMENT, SymmetricComm  # pure Python: the native part loads on first use

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


class SymmetricCollectives:
    """Native NCCL symmetric-memory collectives for one shard group, through two staging buffers.

    NCCL picks its symmetric kernels only when both buffers lie in registered windows, so the all-gather
    copies this rank's shard into its slot of a pool buffer, gathers in place and copies the result out;
    gradients are packed straight into a pool buffer and reduce-scattered into a pool buffer. Both stages
    are used on one stream each (all-gather / reduce-scatter), so one of each suffices. Memory: the largest
    unit's gathered bytes plus its packed-gradient bytes (+ shard), whatever the number of units; a stage
    that no unit uses is not allocated (0 bytes).
    """

    def __init__(self, group: dist.ProcessGroup, ag_bytes: int, rs_bytes: int):
        ag_bytes, rs_bytes = _align_up(ag_bytes, ALIGNMENT), _align_up(rs_bytes, ALIGNMENT)
        # Our own communicator: the process group's may run other collectives on its own stream meanwhile.
        self.comm = SymmetricComm(group, pool_bytes=ag_bytes + rs_bytes, borrow=False)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.ag_stage = self.comm.alloc_tensor(ag_bytes, torch.uint8) if ag_bytes else None
        self.rs_stage = self.comm.alloc_tensor(rs_bytes, torch.uint8) if rs_bytes else None

    @staticmethod
    def reduce_scatter_stage_bytes(total_numel: int, world: int, dtype: torch.dtype) -> int:
        """Bytes of the reduce-scatter stage for one group: its packed input (aligned), then its output."""
        return _rs_output_offset(total_numel, dtype) + total_numel // world * dtype.itemsize

    def all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        stage = self.ag_stage[: output.numel() * output.element_size()].view(output.dtype)
        n = input.numel()
        slot = stage[self.rank * n : (self.rank + 1) * n]
        slot.copy_(input)
        self.comm.all_gather_into(stage, slot)
        output.copy_(stage)

    def reduce_scatter_buffers(self, total_numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed input of total_numel, output of total_numel / world), both in the pool."""
        size, out_at = dtype.itemsize, _rs_output_offset(total_numel, dtype)
        packed = self.rs_stage[: total_numel * size].view(dtype)
        out = self.rs_stage[out_at : out_at + total_numel // self.world * size].view(dtype)
        return packed, out

    def reduce_scatter_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.comm.reduce_scatter_into(output, input)

    def close(self) -> None:
        self.comm.close()


def _rs_output_offset(total_numel: int, dtype: torch.dtype) -> int:
    return _align_up(total_numel * dtype.itemsize, ALIGNMENT)


def time_collective(fn, iters: int = 10) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream (after two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
