"""FlatLayout: where each parameter of a group lives, sharded exactly as DTensor's ``Shard(0)`` means.

Sharding is torch.chunk's split (FSDP2's): a parameter of R rows (a row is ``shape[1:].numel()`` elements) is cut
into chunks of ``c = ceil(R / W)`` rows, and rank r holds rows ``[r*c, min((r+1)*c, R))`` (none when r*c >= R).

Three arrangements of the same chunks:
  shard        one rank's flat buffer: each parameter's chunk slot (c rows) at an aligned offset that is the same on
               every rank; the rank's rows fill the front of the slot, the rest is zero padding. Main weight, model
               weight and main grad use it, so one kernel covers a whole group.
  unsharded    param-major: each parameter padded to W*c rows at an aligned offset; rank r's chunk lands at row r*c.
               A per-parameter all-gather of the chunk slots writes every parameter in place, and the module's
               parameters are plain views (no copy-out).
  rank-major   W shards back to back: the input of one flat reduce-scatter whose output is the shard itself.

A parameter sharded on a dim d > 0 (FSDP2's ``shard_placement_fn`` answering ``Shard(d)``) is split evenly on that
dim: rank r holds the contiguous tensor ``x.narrow(d, r*b, b)``, ``b = shape[d] / W``. Its chunk is not a range of
the whole parameter, so its unsharded extent is the parameter followed by a staging area of W chunks: the
all-gather lands there and one native copy puts each rank's columns in place (FSDP2 copies out the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Offsets are aligned to this many elements: 16 B for fp8 model weights, 32 B for bf16, 64 B for fp32.
ALIGN_ELEMS = 16


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class ParamSlot:
    """One parameter: its shape, its chunk size and where its chunks live in each arrangement."""

    shape: torch.Size
    row_numel: int
    chunk_rows: int  # c = ceil(rows / world) (dim 0)
    shard_offset: int  # start of its chunk slot in every rank's shard
    unsharded_offset: int  # start of the parameter in the param-major gathered buffer
    dim: int = 0  # the sharded dim (> 0: an even split, its gathers staged after the parameter)
    world: int = 1

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel if self.dim == 0 else self.numel // self.world

    @property
    def staging_offset(self) -> int:
        """dim > 0: where the all-gather of its chunks lands (W chunks back to back), after the parameter."""
        return self.unsharded_offset + self.numel

    @property
    def gathered_offset(self) -> int:
        """Where an all-gather of its chunks lands in the unsharded buffer: in place (dim 0) or staged."""
        return self.staging_offset if self.dim else self.unsharded_offset

    @property
    def unsharded_extent(self) -> int:
        return self.world * self.chunk_numel * (2 if self.dim else 1)

    def view(self, unsharded: torch.Tensor) -> torch.Tensor:
        """This parameter, shaped, inside a param-major (unsharded) flat buffer."""
        return unsharded[self.unsharded_offset : self.unsharded_offset + self.numel].view(self.shape)


class FlatLayout:
    """Placement of ``shapes`` for ``world_size`` ranks (see the module docstring)."""

    def __init__(self, shapes: Sequence[torch.Size], world_size: int, align: int = ALIGN_ELEMS,
                 dims: Sequence[int] | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.align = align
        self.slots: list[ParamSlot] = []
        shard_cursor = unsharded_cursor = 0
        for shape, dim in zip((torch.Size(s) for s in shapes), dims or [0] * len(shapes)):
            if len(shape) == 0:
                raise ValueError("FlatLayout cannot place a 0-d (scalar) parameter; reshape it to (1,)")
            dim = dim if world_size > 1 else 0  # one rank: its chunk is the whole parameter, in place
            if dim and shape[dim] % world_size:
                raise ValueError(f"sharding dim {dim} of a parameter of shape {tuple(shape)} needs it to divide by "
                                 f"{world_size} ranks (an even split, as FSDP2 requires for dims other than 0)")
            row_numel = shape[1:].numel()
            chunk_rows = -(-shape[0] // world_size)
            slot = ParamSlot(shape, row_numel, chunk_rows, align_up(shard_cursor, align),
                             align_up(unsharded_cursor, align), dim, world_size)
            self.slots.append(slot)
            shard_cursor = slot.shard_offset + slot.chunk_numel
            unsharded_cursor = slot.unsharded_offset + slot.unsharded_extent
        self.shard_numel = align_up(shard_cursor, align)
        self.unsharded_numel = align_up(unsharded_cursor, align)
        self._view_args: dict = {}  # view_args(rank), per rank
        self.validate()

    @property
    def total_numel(self) -> int:
        """Elements of the param-major gathered buffer (what one unit holds while it computes)."""
        return self.unsharded_numel

    @property
    def rank_major_numel(self) -> int:
        """Elements of the rank-major buffer: the reduce-scatter input, W shards back to back."""
        return self.world_size * self.shard_numel

    def local_rows(self, slot: ParamSlot, rank: int) -> tuple[int, int]:
        """[first_row, end_row) of the parameter that ``rank`` holds (torch.chunk's split; empty past the end)."""
        first = min(rank * slot.chunk_rows, slot.rows)
        return first, min(first + slot.chunk_rows, slot.rows)

    def local_numel(self, slot: ParamSlot, rank: int) -> int:
        if slot.dim:
            return slot.chunk_numel
        r0, r1 = self.local_rows(slot, rank)
        return (r1 - r0) * slot.row_numel

    def local_shape(self, slot: ParamSlot, rank: int) -> tuple:
        """The shape of what ``rank`` holds of the parameter."""
        if slot.dim:
            shape = list(slot.shape)
            shape[slot.dim] //= self.world_size
            return tuple(shape)
        r0, r1 = self.local_rows(slot, rank)
        return (r1 - r0, *slot.shape[1:])

    def view_args(self, rank: int | None) -> list[tuple[tuple, tuple, int]]:
        """Per parameter, the (shape, stride, offset) of its ``as_strided`` view: in ``rank``'s shard its rows
        (torch.chunk's split, possibly none), or (``rank=None``) the whole parameter in the param-major buffer.
        Computed once per rank and kept: gradient views are made again every step."""
        if rank not in self._view_args:
            args = []
            for slot in self.slots:
                if rank is None:
                    shape, offset = tuple(slot.shape), slot.unsharded_offset
                else:
                    shape, offset = self.local_shape(slot, rank), slot.shard_offset
                args.append((shape, contiguous_stride(shape), offset))
            self._view_args[rank] = args
        return self._view_args[rank]

    def rank_major_pieces(self) -> list[tuple[int, int, int, int]]:
        """Every rank's rows of every parameter as (parameter, first element in it, element count, offset in the
        rank-major buffer): where packing copies gradients before the flat reduce-scatter, and where unpacking
        copies a flat rank-major gather into the param-major buffer (at ``unsharded_offset + first``)."""
        S = self.shard_numel
        pieces = []
        for i, s in enumerate(self.slots):
            for r in range(self.world_size):
                if s.dim:  # rank r's columns of every outer index: runs of b * inner elements
                    b, inner = s.shape[s.dim] // self.world_size, s.shape[s.dim + 1:].numel()
                    base = r * S + s.shard_offset
                    pieces += [(i, (o * s.shape[s.dim] + r * b) * inner, b * inner, base + o * b * inner)
                               for o in range(s.shape[:s.dim].numel())]
                elif self.local_numel(s, r) > 0:
                    pieces.append((i, self.local_rows(s, r)[0] * s.row_numel, self.local_numel(s, r),
                                   r * S + s.shard_offset))
        return pieces

    def local_segments(self, rank: int) -> list[tuple[int, int]]:
        """Per parameter, [start, end) of the rows ``rank`` holds in its shard: the segment table of the FP8
        kernels (sorted, non-overlapping; a parameter with no rows here is the empty row (start, start))."""
        return [(s.shard_offset, s.shard_offset + self.local_numel(s, rank)) for s in self.slots]

    def validate(self) -> None:
        shard_end = unsharded_end = 0
        for s in self.slots:
            if s.shard_offset % self.align or s.unsharded_offset % self.align:
                raise AssertionError(f"FlatLayout: unaligned slot {s}")
            if s.shard_offset < shard_end or s.unsharded_offset < unsharded_end:
                raise AssertionError(f"FlatLayout: slot {s} overlaps the previous one")
            if s.dim == 0 and s.chunk_rows * self.world_size < s.rows:
                raise AssertionError(f"FlatLayout: chunks of {s} do not cover the parameter")
            shard_end = s.shard_offset + s.chunk_numel
            unsharded_end = s.unsharded_offset + s.unsharded_extent
        if shard_end > self.shard_numel or unsharded_end > self.unsharded_numel:
            raise AssertionError("FlatLayout: a slot ends past its buffer")

    def __repr__(self) -> str:
        params = sum(s.numel for s in self.slots)
        return (f"FlatLayout(params={len(self.slots)}, world_size={self.world_size}, shard_numel={self.shard_numel}, "
                f"unsharded_numel={self.unsharded_numel}, padding={self.unsharded_numel - params})")


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))
