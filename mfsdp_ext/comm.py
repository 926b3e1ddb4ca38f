"""Collectives for the flat buffers: the torch.distributed path (the native symmetric path lives in symm_mem.py).

All-gathers are grouped: one call gathers every parameter of a group, each into its own place in the param-major
buffer (one NCCL group, as ``ncclGroupStart/End``), so nothing is copied out afterwards. Reduce-scatters are flat:
one rank-major input whose output is the shard itself.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single``; use what exists.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import _align_up
from .symm_mem import ALIGNMENT, SymmetricComm  # pure Python: the native part loads on first use

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """outputs[i] (world * n_i) <- every rank's inputs[i] (n_i) in rank order, for all i as one grouped collective,
    on the current stream. An input may be this rank's slot of its output (in place)."""
    if len(inputs) == 1:
        _all_gather_flat(outputs[0], inputs[0], group=group)
    elif _gloo_lacks(_probe_grouped_all_gather, group):
        for output, input in zip(outputs, inputs):
            _all_gather_flat(output, input, group=group)
    else:
        group.allgather_into_tensor_coalesced(outputs, inputs).wait()


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """output (n) <- SUM over ranks of this rank's n-element slice of input (world * n)."""
    if _gloo_lacks(_probe_reduce_scatter, group):
        dist.all_reduce(input, group=group)
        rank = dist.get_rank(group)
        output.copy_(input[rank * output.numel() : (rank + 1) * output.numel()])
        return
    _reduce_scatter_flat(output, input, group=group)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM) -> None:
    dist.all_reduce(tensor, op=op, group=group)


def _probe_grouped_all_gather(group: dist.ProcessGroup) -> None:
    world = dist.get_world_size(group)
    group.allgather_into_tensor_coalesced([torch.zeros(world), torch.zeros(world)],
                                          [torch.zeros(1), torch.zeros(1)]).wait()


def _probe_reduce_scatter(group: dist.ProcessGroup) -> None:
    _reduce_scatter_flat(torch.zeros(1), torch.zeros(dist.get_world_size(group)), group=group)


_GLOO_SUPPORT: dict[tuple, bool] = {}  # (probe, id(group)) -> whether gloo ran it


def _gloo_lacks(probe, group: dist.ProcessGroup) -> bool:
    """Some gloo builds lack a grouped all-gather or a flat reduce-scatter (NCCL has both): run the small probe
    collective once per group (every rank does, in the same order), then take the fallback where it failed."""
    key = (probe, id(group))
    if key not in _GLOO_SUPPORT:
        supported = True
        if dist.get_backend(group) == "gloo":
            try:
                probe(group)
            except (RuntimeError, NotImplementedError, AttributeError):
                supported = False
        _GLOO_SUPPORT[key] = supported
    return not _GLOO_SUPPORT[key]


class SymmetricCollectives:
    """Native NCCL symmetric-memory collectives for one shard group, through two staging buffers.

    NCCL picks its symmetric kernels only when both buffers lie in registered windows and the group call holds
    one collective, so both collectives are flat, on rank-major pool buffers: the all-gather takes this rank's
    shard in its slot of the stage, gathers in place, and the caller unpacks the stage into its param-major
    buffer; gradients are packed straight into the reduce-scatter stage and reduced into a pool buffer. Both
    stages are used on one stream each (all-gather / reduce-scatter), so one of each suffices. Memory: the
    largest unit's gathered bytes plus its packed-gradient bytes (+ shard), whatever the number of units; a
    stage that no unit uses is not allocated (0 bytes).
    """

    def __init__(self, group: dist.ProcessGroup, ag_bytes: int, rs_bytes: int):
        ag_bytes, rs_bytes = _align_up(ag_bytes, ALIGNMENT), _align_up(rs_bytes, ALIGNMENT)
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

    def all_gather_in_place(self, stage: torch.Tensor, slot: torch.Tensor) -> None:
        self.comm.all_gather_into(stage, slot)

    def reduce_scatter_buffers(self, rank_major_numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed input of rank_major_numel, output of rank_major_numel / world), both in the pool."""
        size, out_at = dtype.itemsize, _rs_output_offset(rank_major_numel, dtype)
        packed = self.rs_stage[: rank_major_numel * size].view(dtype)
        out = self.rs_stage[out_at : out_at + rank_major_numel // self.world * size].view(dtype)
        return packed, out

    def reduce_scatter_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.comm.reduce_scatter_into(output, input)

    def close(self) -> None:
        self.comm.close()


def _rs_output_offset(rank_major_numel: int, dtype: torch.dtype) -> int:
    return _align_up(rank_major_numel * dtype.itemsize, ALIGNMENT)


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
