"""GatherPlan: the index lists and buffer views a group's collectives reuse at every call.

They depend on the layout, the rank and which buffers the group holds, not on whether those buffers have storage
now: a view of a FlatBuffer stays valid across ``free()`` / ``alloc()`` (storage resized, never replaced), so the
views are made once (again only when a buffer is replaced: materialisation, a kept compute-dtype shard).
"""

from __future__ import annotations

import torch

from ..core.flat_buffer import FlatBuffer
from ..core.layout import FlatLayout


class GatherPlan:
    def __init__(self, layout: FlatLayout, rank: int, world: int):
        self.rank = rank
        # the elements one all-gather receives (every rank's chunk slots; 0 on one rank)
        self.gathered_numel = 0 if world == 1 else sum(s.chunk_numel for s in layout.slots) * world
        self.gathered = [i for i, s in enumerate(layout.slots) if s.chunk_numel > 0]  # nothing to gather if empty
        self.shard_offsets = [layout.slots[i].shard_offset for i in self.gathered]
        self.pieces = layout.rank_major_pieces()  # (param, first row element, numel, rank-major offset)
        self.grad_pieces = torch.tensor(self.pieces, dtype=torch.int64).reshape(-1, 4)  # pack_pieces' table
        self.rank_major_offsets = [offset for _, _, _, offset in self.pieces]
        self.staged = any(slot.dim for slot in layout.slots)  # dim > 0 splits: gathers land in a staging area
        self.staged_pending = False  # a plain gather landed in the staging area and was not unstaged yet
        self.gather_inputs: list[torch.Tensor] = []
        self.gather_outputs: list[torch.Tensor] = []
        self.own_unsharded_slots: list[torch.Tensor] = []
        self.unsharded_pieces: list[torch.Tensor] = []

    def gathered_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one all-gather receives in ``dtype``."""
        return self.gathered_numel * dtype.itemsize

    def bind(self, source: FlatBuffer, unsharded: FlatBuffer) -> None:
        """Views of the buffers the collectives read and write: per gathered parameter its chunk slot in the shard the
        all-gather sends (``source``) and its padded place in the unsharded buffer, this rank's slots there, and the
        unsharded pieces of a rank-major buffer."""
        self.bind_source(source)
        self.gather_outputs = [unsharded.padded_param(i) for i in self.gathered]
        self.own_unsharded_slots = [unsharded.chunk_slot(i, self.rank) for i in self.gathered]
        self.unsharded_pieces = [unsharded.param_region(i)[first : first + n] for i, first, n, _ in self.pieces]

    def bind_source(self, source: FlatBuffer) -> None:
        """The all-gather now sends ``source`` (e.g. a compute-dtype shard kept from now on)."""
        self.gather_inputs = [source.chunk_slot(i) for i in self.gathered]

    def unstage(self, buffer: FlatBuffer) -> None:
        """dim > 0 splits: each rank's slice, gathered into the staging area, into place (no-op otherwise)."""
        if self.staged:
            with torch.autograd._unsafe_preserve_version_counter(buffer.data):
                buffer.unstage()
