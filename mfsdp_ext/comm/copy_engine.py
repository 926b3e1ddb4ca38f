"""The all-gather through the GPUs' copy engines: ``fully_shard(copy_engine_all_gather=True)``.

Why: NCCL's all-gather kernels run on SMs, and a matmul running beside them loses those SMs: one block of config 1
gathered beside its q projection slows the projection 1.8-1.9x (benchmarks/overlap.py). Here each rank writes its
shard into a buffer of torch's symmetric memory (mapped into every peer of the shard group), one barrier kernel says
every shard is written, and every rank copies the pieces it needs from its peers' buffers straight into its
parameters with device-to-device copies, which the copy engines carry over NVLink. Where a group's pieces are small
(each copy's fixed cost would dominate), it copies each rank's whole shard into a rank-major staging buffer instead
and one kernel puts the pieces in place. All of it is issued on the all-gather stream and captures in a CUDA graph.

Two buffers, used in turn, make one barrier per gather enough: a rank writes a buffer again only two gathers later,
after the barrier of the gather between, which every peer reaches only once its copies out of that buffer are done.
That holds while every rank runs the same gathers in one stream order. It does not hold across the edges of a CUDA
graph: a replay repeats the captured buffer order whatever ran before it, and eager gathers after a replay do not
know which buffer it ended on. So the first gather of a capture, and every eager gather once the stage has been
captured, waits at a barrier first (``BufferTurns``).

What it needs: CUDA GPUs whose ranks of the shard group all reach each other's memory (one host, NVLink or PCIe
peer access), torch's symmetric memory. Two buffers per shard group, each the size of the largest group's shard,
held while the model lives. FP8 groups and groups split along dim > 0 keep the plain all-gather. The reduce-scatter
is unchanged.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
import torch.distributed as dist

from .. import _native
from .._native import current_capture_id
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


class BufferTurns:
    """Which of the two buffers the next gather writes, and whether it must first wait at a barrier (module
    docstring): at the first gather of a capture, and at every eager gather once some gather was captured."""

    def __init__(self):
        self.buffer = 1  # the one the last gather wrote
        self.capture = 0  # the capture the last gather ran in (0: eager)
        self.captured = False

    def next(self, capture: int) -> tuple[int, bool]:
        """(buffer, barrier first) for a gather in the capture ``capture`` (0: eager)."""
        fence = capture != self.capture or (capture == 0 and self.captured)
        self.capture, self.captured = capture, self.captured or capture != 0
        self.buffer ^= 1
        return self.buffer, fence


class CopyEngineStage:
    """This rank's two buffers in torch's symmetric memory over one shard group, and views of every peer's."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device, self.nbytes = device, nbytes
        self.buffer = symm_mem.empty(2 * nbytes, dtype=torch.uint8, device=device)
        try:
            self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        except Exception as e:  # e.g. a peer on another host: no peer access
            raise RuntimeError(f"fully_shard(copy_engine_all_gather=True): the shard group's GPUs cannot map each "
                               f"other's memory ({e}). Pass copy_engine_all_gather=False.") from e
        self.peers = [self.buffer if r == self.rank else self.handle.get_buffer(r, (2 * nbytes,), torch.uint8)
                      for r in range(self.world)]
        self.turns = BufferTurns()

    def view(self, rank: int, buffer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of ``rank``'s buffer ``buffer`` (0 or 1) as ``dtype``."""
        start = buffer * self.nbytes
        return self.peers[rank][start : start + numel * dtype.itemsize].view(dtype)

    def capture(self) -> int:
        """The CUDA graph capture the current stream belongs to (0: none)."""
        if not torch.cuda.is_current_stream_capturing():
            return 0
        return current_capture_id(self.device.index) or -1

    def next_buffer(self) -> int:
        """The buffer the next gather writes, once no peer may still read it."""
        buffer, fence = self.turns.next(self.capture())
        if fence:
            self.barrier()
        return buffer

    def barrier(self) -> None:
        """Every rank of the group reaches this point of its current stream (a kernel; no host wait)."""
        self.handle.barrier(channel=0)


# A copy engine copy costs a few microseconds before its first byte moves: pieces smaller than this on average go
# through one copy per rank into a staging buffer and one unpacking kernel instead (measured on H200, configs 1 and 3
# of benchmarks/step.py: 5.7 MB pieces are faster copied in place, 1.4 MB and 0.7 MB ones staged).
STAGE_PIECES_BELOW_BYTES = 2 << 20


class CopyEngineAllGather:
    """One group's gather: its shard into this rank's next buffer, a barrier, then every piece of every rank's shard
    copied from that rank's buffer into the parameters, or, where the pieces are small, each rank's whole shard into
    a rank-major staging buffer whose pieces one kernel puts in place. The views and the copy plan are made once:
    the group's pieces and the buffers keep their storage for the model's life."""

    name = "copy_engine"

    def __init__(self, stage: CopyEngineStage, g: ParamGroup):
        shard, dtype, world = g.layout.shard_numel, g.compute_dtype, stage.world
        self.stage, self.shard, self.dtype = stage, shard, dtype
        self.own = [stage.view(stage.rank, b, shard, dtype) for b in (0, 1)]
        self.sources = [[stage.view(r, b, shard, dtype) for r in range(world)] for b in (0, 1)]
        self.offsets, self.pieces = list(g.rank_major_offsets), list(g.unsharded_pieces)
        piece_bytes = sum(p.numel() for p in self.pieces) * dtype.itemsize / max(len(self.pieces), 1)
        self.staged = len(self.pieces) > world and piece_bytes < STAGE_PIECES_BELOW_BYTES
        # per buffer: (piece of the unsharded parameters, where it lies in its rank's buffer)
        self.in_place = [[(piece, self.sources[b][offset // shard][offset % shard :][: piece.numel()])
                          for offset, piece in zip(self.offsets, self.pieces)] for b in (0, 1)]

    def __call__(self, g: ParamGroup) -> None:
        buffer = self.stage.next_buffer()
        g.write_shard(self.own[buffer])
        self.stage.barrier()
        if not self.staged:
            for piece, source in self.in_place[buffer]:
                piece.copy_(source)
            return
        staged = torch.empty(self.stage.world * self.shard, dtype=self.dtype, device=self.own[0].device)
        for r, source in enumerate(self.sources[buffer]):
            staged[r * self.shard : (r + 1) * self.shard].copy_(source)
        _native.unpack(staged, self.offsets, self.pieces)


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
