"""FlatLayout: where each parameter of a group lives in one flat buffer split evenly over the ranks.

Parameters sit contiguously (param-major), so a gathered buffer holds each parameter as a plain view and the
all-gather needs no copy-out. The buffer is cut into ``world_size`` equal shards; every shard boundary falls
on a row boundary of the parameter it cuts (a row is ``shape[1:].numel()`` elements), so each rank's part of
a parameter is a ``(k, *shape[1:])`` tensor. Padding is placed before a parameter where needed to make that
true, and the shard size is chosen as the smallest that admits such a placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

# Offsets are aligned to this many elements: 16 B for fp8 model weights, 32 B for bf16, 64 B for fp32.
ALIGN_ELEMS = 16


def _align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the flat buffer and its rows on each rank."""

    shape: torch.Size
    offset: int  # first element in the flat (unsharded) buffer
    numel: int
    row_numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel

    def view(self, full: torch.Tensor) -> torch.Tensor:
        """This parameter, shaped, inside a full (unsharded) flat buffer."""
        return full[self.offset : self.end].view(self.shape)


class _Retry(Exception):
    def __init__(self, new_shard_numel: int):
        self.new_shard_numel = new_shard_numel


class FlatLayout:
    """Placement of ``shapes`` in a flat buffer of ``world_size * shard_numel`` elements."""

    def __init__(self, shapes: Sequence[torch.Size], world_size: int, align: int = ALIGN_ELEMS):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.align = align
        shapes = [torch.Size(s) for s in shapes]
        for s in shapes:
            if len(s) == 0:
                raise ValueError("FlatLayout cannot place a 0-d (scalar) parameter; reshape it to (1,)")
        total = sum(_align_up(s.numel(), align) for s in shapes)
        shard = _align_up(max(1, math.ceil(total / world_size)), align)
        for _ in range(10_000):
            try:
                self.slots = self._place(shapes, shard)
                break
            except _Retry as r:
                shard = _align_up(max(r.new_shard_numel, shard + align), align)
        else:  # pragma: no cover - the search always terminates well before this
            raise RuntimeError("FlatLayout: could not find a shard size")
        self.shard_numel = shard
        self.validate()

    @property
    def total_numel(self) -> int:
        return self.shard_numel * self.world_size

    def _place(self, shapes: Sequence[torch.Size], shard: int) -> list[ParamSlot]:
        slots, cursor = [], 0
        for shape in shapes:
            numel = shape.numel()
            row = max(1, shape[1:].numel()) if len(shape) > 1 else 1
            offset = _align_up(cursor, self.align)
            boundary = (offset // shard + 1) * shard
            if numel > 0 and offset + numel > boundary:
                # The parameter crosses a shard boundary: start it so the boundary falls between two rows.
                step = row * (self.align // math.gcd(self.align, row))  # row multiple keeping alignment
                rows_before = (boundary - offset) // step * step
                offset = boundary - rows_before
                if offset + numel > boundary + shard and shard % row != 0:
                    # Crosses further boundaries too: the shard size itself must be a multiple of the row.
                    raise _Retry(_align_up(shard, math.lcm(row, self.align)))
            slots.append(ParamSlot(shape, offset, numel, row))
            cursor = offset + numel
        if cursor > shard * self.world_size:
            raise _Retry(math.ceil(cursor / self.world_size))
        return slots

    def validate(self) -> None:
        prev_end = 0
        for s in self.slots:
            if s.offset < prev_end or s.end > self.total_numel or s.offset % self.align:
                raise AssertionError(f"FlatLayout: bad slot {s} (previous end {prev_end})")
            for r in range(self.world_size):
                lo, hi = self.local_range(s, r)
                if hi > lo and ((lo - s.offset) % s.row_numel or (hi - s.offset) % s.row_numel):
                    raise AssertionError(f"FlatLayout: rank {r} does not own whole rows of {s}")
            prev_end = s.end

    def local_range(self, slot: ParamSlot, rank: int) -> tuple[int, int]:
        """[lo, hi) of ``slot`` that rank owns, in flat-buffer elements (empty when lo == hi)."""
        lo = max(slot.offset, rank * self.shard_numel)
        hi = min(slot.end, (rank + 1) * self.shard_numel)
        return (lo, hi) if hi > lo else (slot.offset, slot.offset)

    def local_rows(self, slot: ParamSlot, rank: int) -> tuple[int, int]:
        """[first_row, end_row) of the parameter that rank owns."""
        lo, hi = self.local_range(slot, rank)
        return (lo - slot.offset) // slot.row_numel, (hi - slot.offset) // slot.row_numel

    def local_segments(self, rank: int) -> list[tuple[int, int]]:
        """Per parameter, [start, end) of its local part relative to rank's shard start: the segment table of
        the FP8 kernels (sorted; a parameter with no local rows is the empty row (e, e) at its place)."""
        base = rank * self.shard_numel
        segs, prev_end = [], 0
        for s in self.slots:
            lo, hi = self.local_range(s, rank)
            if hi > lo:
                prev_end = hi - base
                segs.append((lo - base, prev_end))
            else:
                segs.append((prev_end, prev_end))
        return segs

    def __repr__(self) -> str:
        return (f"FlatLayout(params={len(self.slots)}, world_size={self.world_size}, "
                f"shard_numel={self.shard_numel}, padding={self.total_numel - sum(s.numel for s in self.slots)})")
