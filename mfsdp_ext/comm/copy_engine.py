"""Collectives through the GPUs' copy engines: ``fully_shard(copy_engine_all_gather=True)`` and
``fully_shard(copy_engine_reduce_scatter=True)``.

Why: NCCL's kernels run on SMs, and a kernel running beside them loses those SMs: one block of config 1 gathered
beside its q projection slows the projection 1.8-1.9x (benchmarks/overlap.py), and config 3's backward matmuls run
up to 2.5x slower beside NCCL's gradient exchange. Here each rank writes into a buffer of torch's symmetric memory
(mapped into every peer of the shard group), one barrier kernel says every rank has written, and every rank copies
what it needs out of its peers' buffers with device-to-device copies, which the copy engines carry over NVLink.

  all-gather     each rank's bf16 shard; the pieces copied straight into the parameters, or, where a group's pieces
                 are small (each copy's fixed cost would dominate), each rank's whole shard into a rank-major staging
                 buffer that one kernel unpacks
  reduce-scatter the gradients packed rank-major in the dtype they travel in (reduce_comm_dtype: the default bf16
                 wire), this rank's chunk copied from every rank, summed in fp32 as after NCCL's all-to-all: the same
                 bits. Groups whose reduce-scatter sums in flight (reduce_comm_dtype == reduce_dtype) keep NCCL's.

All of it is issued on the collective's stream and captures in a CUDA graph. Each rank copies from its peers in
turn starting at itself (``peer_order``): at every turn the ranks read from distinct peers, so no GPU's links serve
several readers while others idle.

Two buffers per direction, used in turn, make one barrier per collective enough: a rank writes a buffer again only
two collectives later, after the barrier of the one between, which every peer reaches only once its copies out of
that buffer are done. That holds while every rank runs the same collectives in one stream order. It does not hold
across the edges of a CUDA graph: a replay repeats the captured buffer order whatever ran before it, and eager
collectives after a replay do not know which buffer it ended on. So the first collective of a capture, and every
eager one once the stage has been captured, waits at a barrier first (``BufferTurns``).

What it needs: CUDA GPUs whose ranks of the shard group all reach each other's memory (one host, NVLink or PCIe
peer access), torch's symmetric memory. Per direction two buffers, held while the model lives. FP8 groups and
groups split along dim > 0 keep the plain all-gather. A group larger than its buffer goes through in windows of its
shard, each one round of write, barrier and copies; each round costs a barrier (every rank waits for the slowest)
and host work, so a model whose groups mostly need several rounds is slower than on NCCL (measured:
benchmarks/results/step_copy_engine_default_2xh200.md).

``fully_shard``'s default for both is "auto" (``plan_both``): on wherever they can run (``unavailable_reason`` is None),
the unit asks for no other transport (use_symm_mem, native_collectives), and buffers that keep the extra memory
under 1% of the resident training state take most groups in at most MAX_ROUNDS rounds, in both directions (one
alone gains little); the rest of the groups (a transformer's embedding and output) take more. With True the buffers
hold the largest group whole.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional

import torch
import torch.distributed as dist

from .. import _native
from ..core.device import DeviceHandle
from . import dist_ops
from .collectives import ArrivedShards, ParamGroup, SeparateCalls


def unavailable_reason(group: Optional[dist.ProcessGroup]) -> Optional[str]:
    """Why the copy engines cannot carry a unit's collectives over ``group``, or None when they can (checked at
    fully_shard time; whether every peer is reachable shows at the first forward)."""
    if group is None:
        return "no_shard has no all-gather or reduce-scatter"
    reason = dist_ops.cuda_nccl_reason(group)
    if reason is not None:
        return reason
    if not dist_ops.on_one_host(group):
        return "the shard group spans hosts; the copy engines reach the GPUs of one host"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as e:
        return f"torch's symmetric memory is not importable ({e})"
    return None


def gathers_by_copy_engine(g: ParamGroup) -> bool:
    """Whether the group's all-gather can go through the copy engines (the others keep theirs)."""
    return g.world > 1 and not g.fp8 and not any(slot.dim for slot in g.layout.slots)


def reduces_by_copy_engine(g: ParamGroup) -> bool:
    """Whether the group's gradient exchange can go through the copy engines: the all-to-all of gradients sent
    narrower than they are summed (reduce_comm_dtype, the bf16 wire: pure copies); a reduce-scatter that sums in
    flight keeps NCCL's."""
    return g.sums_on_arrival


# "auto": the copy engines' four buffers stay under this share of the resident training state (resident_bytes), and
# they are used only where the groups that need more than MAX_ROUNDS rounds carry at most OUTLIER_SHARE of the bytes
# (measured, 2 x H200: config 3's blocks in 1 and 2 rounds are faster than NCCL's collectives, config 2's in 3 and 6
# and config 4's in 6 and 11 are slower: benchmarks/results/step_copy_engine_default_2xh200.md).
BUDGET_SHARE = 1 / 100
MAX_ROUNDS = 2
OUTLIER_SHARE = 1 / 4
BUFFER_ENV = "MFSDP_EXT_COPY_ENGINE_BUFFER_MB"  # each buffer's size for True and "auto" alike (tuning and tests)


def resident_bytes(g: ParamGroup) -> int:
    """A lower bound of what a group keeps on the GPU through a training step: its fp32 main shard and gradient and
    AdamW's two moments for a trainable group on the GPU (16 bytes per shard element), its main shard for a frozen
    one, nothing for an offloaded one (kept on the host)."""
    if g.offload is not None:
        return 0
    per_element = 16 if g.trainable() else g.main_weight.data.dtype.itemsize
    return g.layout.shard_numel * per_element


def gather_need(g: ParamGroup) -> int:
    """Bytes of a group's shard in the compute dtype: what one all-gather round writes."""
    return g.layout.shard_numel * g.compute_dtype.itemsize


def reduce_need(g: ParamGroup) -> int:
    """Bytes of a group's gradients packed rank-major in the wire's dtype: what one exchange round writes."""
    return g.layout.rank_major_numel * g.reduce_comm_dtype.itemsize


def auto_buffer_bytes(resident: int) -> int:
    """The size of each of the four buffers (two per direction) "auto" allows: together BUDGET_SHARE of
    ``resident``."""
    return int(resident * BUDGET_SHARE / 4)


def plan(asked: list[tuple[object, ParamGroup]], need, auto_bytes: int) -> tuple[list[ParamGroup], int]:
    """Which groups of one direction go through the copy engines, and the size of each of its two buffers.

    Args:
        asked: (the unit's value, True or "auto"; the group) of each group that asks and can take them.
        need: gather_need or reduce_need.
        auto_bytes: the buffer size "auto" allows (auto_buffer_bytes).

    With a True the buffers hold the largest group whole. With "auto" alone, the groups that need more than
    MAX_ROUNDS rounds of auto_bytes must carry at most OUTLIER_SHARE of the bytes, else NCCL's collectives are
    faster: none. ``BUFFER_ENV`` sets the size for both."""
    groups = [g for _, g in asked]
    if not groups:
        return [], 0
    largest = max(map(need, groups))
    override = os.environ.get(BUFFER_ENV)
    if override:
        size = int(float(override) * 2**20)
    elif any(value is True for value, _ in asked):
        size = largest
    else:
        over = sum(need(g) for g in groups if need(g) > MAX_ROUNDS * auto_bytes)
        if over > OUTLIER_SHARE * sum(map(need, groups)):
            return [], 0
        size = min(largest, auto_bytes)
    return groups, -(-size // 256) * 256  # a multiple of 256 bytes: every dtype's view is aligned


def plan_both(gathers: list[tuple[object, ParamGroup]], reduces: list[tuple[object, ParamGroup]], auto_bytes: int
              ) -> tuple[tuple[list[ParamGroup], int], tuple[list[ParamGroup], int]]:
    """``plan`` of the all-gather (``gathers``) and of the gradient exchange (``reduces``). "auto" takes both
    directions or neither: the copy engines gain where no transfer of either direction runs on SMs beside the
    matmuls, and little with one direction alone (benchmarks/results/step_copy_engine_2xh200.md)."""
    gather, reduce = plan(gathers, gather_need, auto_bytes), plan(reduces, reduce_need, auto_bytes)
    forced = any(value is True for value, _ in gathers + reduces)
    if not forced and not (gather[0] and reduce[0]):
        return ([], 0), ([], 0)
    return gather, reduce


def windows(length: int, capacity: int) -> list[tuple[int, int]]:
    """``[start, stop)`` windows covering ``range(length)``, each at most ``capacity`` long (one for an empty
    length, so every rank still runs one round)."""
    return [(a, min(a + capacity, length)) for a in range(0, length, capacity)] or [(0, 0)]


def window_pieces(pieces: list[tuple[int, int, int, int]], shard: int, world: int, start: int, stop: int
                  ) -> torch.Tensor:
    """The gradient exchange's pack table (pack_pieces' rows: param, first element, count, offset) for one window:
    the parts of ``pieces`` (rank-major offsets) inside ``[start, stop)`` of each rank's shard, laid out rank-major
    in a buffer of ``world`` windows."""
    width, rows = stop - start, []
    for param, first, count, offset in pieces:
        rank, at = divmod(offset, shard)
        lo, hi = max(at, start), min(at + count, stop)
        if lo < hi:
            rows.append((param, first + lo - at, hi - lo, rank * width + lo - start))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)


def peer_order(rank: int, world: int) -> list[int]:
    """The ranks whose buffers ``rank`` copies from, in the order it copies: itself first (a local copy), then the
    next rank up, and so on around. At every position the ranks of the group read from distinct ranks."""
    return [(rank + step) % world for step in range(world)]


class BufferTurns:
    """Which of a stage's two buffers its next collective writes, and whether it must first wait at a barrier
    (module docstring): at the first collective of a capture, and at every eager one once some were captured."""

    def __init__(self):
        self.buffer = 1  # the one the last collective wrote
        self.capture = 0  # the capture the last collective ran in (0: eager)
        self.captured = False

    def next(self, capture: int) -> tuple[int, bool]:
        """(buffer, barrier first) for a collective in the capture ``capture`` (0: eager)."""
        fence = capture != self.capture or (capture == 0 and self.captured)
        self.capture, self.captured = capture, self.captured or capture != 0
        self.buffer ^= 1
        return self.buffer, fence


class CopyEngineStage:
    """This rank's two buffers in torch's symmetric memory over one shard group, and views of every peer's. The
    gathers (on the all-gather stream) and the gradient exchanges (on the reduce stream) have one stage each, with
    barriers on channels of their own."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, *, device: DeviceHandle, channel: int, flag: str):
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device, self.nbytes, self.channel = device, nbytes, channel
        self.buffer = symm_mem.empty(2 * nbytes, dtype=torch.uint8, device=device.device)
        try:
            self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        except Exception as e:  # e.g. a peer on another host: no peer access
            raise RuntimeError(f"mfsdp_ext: the copy engines ({flag}) need the shard group's GPUs to map each "
                               f"other's memory, which failed ({e}). Pass fully_shard(..., {flag}=False).") from e
        self.peers = [self.buffer if r == self.rank else self.handle.get_buffer(r, (2 * nbytes,), torch.uint8)
                      for r in range(self.world)]
        self.turns = BufferTurns()

    def view(self, rank: int, buffer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of ``rank``'s buffer ``buffer`` (0 or 1) as ``dtype``."""
        start = buffer * self.nbytes
        return self.peers[rank][start : start + numel * dtype.itemsize].view(dtype)

    def next_buffer(self) -> int:
        """The buffer the next collective writes, once no peer may still read it."""
        buffer, fence = self.turns.next(self.device.capture_id())
        if fence:
            self.barrier()
        return buffer

    def barrier(self) -> None:
        """Every rank of the group reaches this point of its current stream (a kernel; no host wait)."""
        self.handle.barrier(channel=self.channel)


# A copy engine copy costs a few microseconds before its first byte moves: pieces smaller than this on average go
# through one copy per rank into a staging buffer and one unpacking kernel instead (measured on H200, configs 1 and 3
# of benchmarks/step.py: 5.7 MB pieces are faster copied in place, 1.4 MB and 0.7 MB ones staged).
STAGE_PIECES_BELOW_BYTES = 2 << 20


class CopyEngineAllGather(SeparateCalls):
    """One group's gather, in windows of its shard as large as a buffer holds (one for most groups). Per window:
    that part of its shard into this rank's next buffer, a barrier, then every piece of every rank's window copied
    from that rank's buffer into the parameters, or, where the pieces are small, each rank's window into a rank-major
    staging buffer whose pieces one kernel puts in place at the end. The views and the copy plan are made once: the
    group's pieces and the buffers keep their storage for the model's life."""

    name = "copy_engine"

    def __init__(self, stage: CopyEngineStage, g: ParamGroup):
        shard, dtype, world = g.layout.shard_numel, g.compute_dtype, stage.world
        self.stage, self.shard, self.dtype = stage, shard, dtype
        self.windows = windows(shard, stage.nbytes // dtype.itemsize)
        # per buffer, per window: this rank's part, and every rank's
        self.own = [[stage.view(stage.rank, b, stop - start, dtype) for start, stop in self.windows] for b in (0, 1)]
        self.sources = [[[stage.view(r, b, stop - start, dtype) for r in range(world)] for start, stop in self.windows]
                        for b in (0, 1)]
        self.offsets, self.pieces = list(g.plan.rank_major_offsets), list(g.plan.unsharded_pieces)
        piece_bytes = sum(p.numel() for p in self.pieces) * dtype.itemsize / max(len(self.pieces), 1)
        self.staged = len(self.pieces) > world and piece_bytes < STAGE_PIECES_BELOW_BYTES
        # per buffer, per window, in peer order: (piece of the unsharded parameters, the part of it this window
        # holds or None for all of it, where that lies in its rank's buffer)
        turn = {r: i for i, r in enumerate(peer_order(stage.rank, world))}
        by_turn = sorted(zip(self.offsets, self.pieces), key=lambda op: turn[op[0] // shard])
        self.in_place = [[self._window_copies(by_turn, sources, start, stop)
                          for (start, stop), sources in zip(self.windows, self.sources[b])] for b in (0, 1)]

    def _window_copies(self, by_turn, sources, start: int, stop: int) -> list[tuple]:
        copies = []
        for offset, piece in by_turn:
            rank, at = divmod(offset, self.shard)
            lo, hi = max(at, start), min(at + piece.numel(), stop)
            if lo < hi:  # a part is sliced at the copy: the pieces have no storage between gathers
                part = None if hi - lo == piece.numel() else slice(lo - at, hi - at)
                copies.append((piece, part, sources[rank][lo - start : hi - start]))
        return copies

    def __call__(self, g: ParamGroup) -> None:
        staged = None
        if self.staged:
            staged = torch.empty(self.stage.world * self.shard, dtype=self.dtype, device=self.own[0][0].device)
        for k, (start, stop) in enumerate(self.windows):
            buffer = self.stage.next_buffer()
            g.write_shard(self.own[buffer][k], start)
            self.stage.barrier()
            if staged is None:
                for piece, part, source in self.in_place[buffer][k]:
                    (piece if part is None else piece.view(-1)[part]).copy_(source)
                continue
            for r in peer_order(self.stage.rank, self.stage.world):
                staged[r * self.shard + start : r * self.shard + stop].copy_(self.sources[buffer][k][r])
        if staged is not None:
            _native.unpack(staged, self.offsets, self.pieces)


class CopyEngineReduceScatter(SeparateCalls):
    """One group's gradient exchange (reduces_by_copy_engine): what PlainReduceScatter's all-to-all delivers, through
    the copy engines, in windows of the shard as wide as a buffer holds for every rank (one for most groups). Per
    window: its grads packed rank-major in their own dtype into this rank's next buffer, a barrier, then this rank's
    part copied out of every rank's buffer: the shards that arrived, summed where they go (ArrivedShards), with the
    same bits as NCCL's all-to-all."""

    name = "copy_engine"

    def __init__(self, stage: CopyEngineStage, g: ParamGroup):
        shard, dtype, world, rank = g.layout.shard_numel, g.reduce_comm_dtype, stage.world, stage.rank
        self.stage, self.shard, self.dtype = stage, shard, dtype
        self.windows = windows(shard, stage.nbytes // dtype.itemsize // world)
        self.tables = [window_pieces(g.plan.pieces, shard, world, start, stop) for start, stop in self.windows]
        # per buffer, per window: this rank's packed buffer, and its part of every rank's
        self.packed = [[stage.view(rank, b, world * (stop - start), dtype) for start, stop in self.windows]
                       for b in (0, 1)]
        self.chunks = [[[stage.view(r, b, world * (stop - start), dtype)[rank * (stop - start) :][: stop - start]
                         for r in range(world)] for start, stop in self.windows] for b in (0, 1)]

    def __call__(self, g: ParamGroup, scale: float) -> ArrivedShards:
        arrived = torch.empty(self.stage.world, self.shard, dtype=self.dtype, device=self.packed[0][0].device)
        for k, (start, stop) in enumerate(self.windows):
            buffer = self.stage.next_buffer()
            g.grads.pack(self.packed[buffer][k], 1.0, self.tables[k])
            self.stage.barrier()
            for r in peer_order(self.stage.rank, self.stage.world):
                arrived[r, start:stop].copy_(self.chunks[buffer][k][r])
        return ArrivedShards(arrived, scale)


def copy_engine_collectives(gathers: tuple[list[ParamGroup], int], reduces: tuple[list[ParamGroup], int],
                            device: DeviceHandle) -> tuple[list[CopyEngineStage], dict]:
    """The copy-engine all-gather of the groups in ``gathers`` and gradient exchange of those in ``reduces`` (each
    (groups, buffer bytes) from ``plan``): returns the stages they share (one per direction in use) and id(group)
    -> (all-gather or None, reduce-scatter or None). Collective over the shard group: every rank calls it alike."""
    stages: list[CopyEngineStage] = []
    ops: dict = {}
    for slot, (flag, (groups, nbytes), op) in enumerate((
            ("copy_engine_all_gather", gathers, CopyEngineAllGather),
            ("copy_engine_reduce_scatter", reduces, CopyEngineReduceScatter))):
        if not groups:
            continue
        shard_group = groups[0].shard_group
        if any(g.shard_group is not shard_group for g in groups):
            raise ValueError(f"{flag}: all units under one root must shard over the same group")
        stage = CopyEngineStage(shard_group, nbytes, device=device, channel=len(stages), flag=flag)
        for g in groups:
            pair = list(ops.get(id(g), (None, None)))
            pair[slot] = op(stage, g)
            ops[id(g)] = tuple(pair)
        stages.append(stage)
    return stages, ops
