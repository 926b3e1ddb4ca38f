"""The all-gather through the GPUs' copy engines: ``fully_shard(copy_engine_all_gather=True)``.

Why: NCCL's all-gather kernels run on SMs, and a matmul running beside them loses those SMs: one block of config 1
gathered beside its q projection slows the projection 1.8-1.9x (benchmarks/overlap.py). Here each rank writes its
shard into a buffer of torch's symmetric memory (mapped into every peer of the shard group), and every rank copies
the pieces it needs straight from its peers' buffers into its parameters with device-to-device copies, which the
copy engines carry over NVLink. Two barriers (one small kernel each) frame the copies: the first says every shard
is written, the second that every rank has read them, so the buffer may take the next unit's shard. All of it is
issued on the all-gather stream and captures in a CUDA graph.

What it needs: CUDA GPUs whose ranks of the shard group all reach each other's memory (one host, NVLink or PCIe
peer access), torch's symmetric memory. One buffer per shard group, the size of the largest group's shard, held
while the model lives. The copies are one call each (world x parameters per group): more host time than one NCCL
call in eager steps, none once captured. FP8 groups and groups split along dim > 0 keep the plain all-gather.
The reduce-scatter is unchanged.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
import torch.distributed as dist

from . import dist_ops
from .collectives import ParamGroup


def unavailable_reason(group: Optional[dist.ProcessGroup]) -> Optional[str]:
    """Why ``copy_engine_all_gather=True`` cannot run over ``group``, or None when it can (checked at
    fully_shard time; whether every peer is reachable shows at the first forward)."""
    if group is None:
        return "no_shard has no all-gather"
    reason = dist_ops.cuda_nccl_reason(group)
    if reason is not None:
        return reason
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as e:
        return f"torch's symmetric memory is not importable ({e})"
    return None


def check_available(copy_engine_all_gather: bool, group: Optional[dist.ProcessGroup], use_symm_mem) -> bool:
    """fully_shard's check: an error that says what to do, or the setting."""
    if copy_engine_all_gather not in (False, True):
        raise ValueError(f"copy_engine_all_gather must be True or False, got {copy_engine_all_gather!r}")
    if not copy_engine_all_gather:
        return False
    if use_symm_mem:
        raise ValueError("fully_shard: copy_engine_all_gather=True and use_symm_mem are two all-gathers; pass one")
    reason = unavailable_reason(group)
    if reason is not None:
        raise RuntimeError(f"fully_shard(copy_engine_all_gather=True): {reason}. Pass copy_engine_all_gather=False "
                           "(the default: NCCL's all-gather).")
    return True


def gathers_by_copy_engine(g: ParamGroup) -> bool:
    """Whether the group's all-gather can go through the copy engines (the others keep theirs)."""
    return g.world > 1 and not g.fp8 and not any(slot.dim for slot in g.layout.slots)


class CopyEngineStage:
    """This rank's buffer in torch's symmetric memory over one shard group, and views of every peer's."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        try:
            self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        except Exception as e:  # e.g. a peer on another host: no peer access
            raise RuntimeError(f"fully_shard(copy_engine_all_gather=True): the shard group's GPUs cannot map each "
                               f"other's memory ({e}). Pass copy_engine_all_gather=False.") from e
        self.peers = [self.buffer if r == self.rank else self.handle.get_buffer(r, (nbytes,), torch.uint8)
                      for r in range(self.world)]

    def view(self, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of ``rank``'s buffer as ``dtype``."""
        return self.peers[rank][: numel * dtype.itemsize].view(dtype)

    def barrier(self) -> None:
        """Every rank of the group reaches this point of its current stream (a kernel; no host wait)."""
        self.handle.barrier(channel=0)


class CopyEngineAllGather:
    """One group's gather: its shard into this rank's symmetric buffer, a barrier, every rank's pieces copied from
    the peers' buffers into the parameters, a barrier. The views are made once: the group's pieces and the buffers
    keep their storage for the model's life."""

    name = "copy_engine"

    def __init__(self, stage: CopyEngineStage, g: ParamGroup):
        shard, dtype = g.layout.shard_numel, g.compute_dtype
        self.stage = stage
        self.own = stage.view(stage.rank, shard, dtype)
        sources = [stage.view(r, shard, dtype) for r in range(stage.world)]
        self.copies = []  # (piece of the unsharded parameters, where it lies in its rank's buffer)
        for offset, piece in zip(g.rank_major_offsets, g.unsharded_pieces):
            rank, at = divmod(offset, shard)
            self.copies.append((piece, sources[rank][at : at + piece.numel()]))

    def __call__(self, g: ParamGroup) -> None:
        g.write_shard(self.own)
        self.stage.barrier()
        for piece, source in self.copies:
            piece.copy_(source)
        self.stage.barrier()


def use_copy_engine_all_gather(units) -> Optional[CopyEngineStage]:
    """Give the groups of units with copy_engine_all_gather=True the copy-engine all-gather; return the stage they
    share (None when no group uses it). Collective over the shard group: every rank calls it alike."""
    groups = [g for u in units if u.copy_engine_all_gather for g in u.groups if gathers_by_copy_engine(g)]
    if not groups:
        return None
    shard_group = groups[0].shard_group
    if any(g.shard_group is not shard_group for g in groups):
        raise ValueError("copy_engine_all_gather: all units under one root must shard over the same group")
    nbytes = max(g.layout.shard_numel * g.compute_dtype.itemsize for g in groups)
    stage = CopyEngineStage(shard_group, nbytes, groups[0].device)
    for g in groups:
        g.all_gather_op = CopyEngineAllGather(stage, g)
    return stage
