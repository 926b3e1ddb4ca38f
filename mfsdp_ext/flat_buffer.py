"""FlatBuffer: one flat tensor laid out by a FlatLayout, either the whole (unsharded) buffer or one rank's shard.

Releasing storage resizes the untyped storage to 0 bytes and reallocating resizes it back, so parameter views
and tensors that autograd saved keep pointing at the same storage object and stay valid across the cycle.
"""

from __future__ import annotations

import torch

from .layout import FlatLayout


class FlatBuffer:
    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, *, rank: int | None = None):
        """``rank=None`` makes the unsharded buffer (all shards); otherwise that rank's shard."""
        self.layout = layout
        self.rank = rank
        numel = layout.total_numel if rank is None else layout.shard_numel
        self.data = torch.empty(numel, dtype=dtype, device=device)
        self._nbytes = self.data.untyped_storage().nbytes()

    @property
    def sharded(self) -> bool:
        return self.rank is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def param_view(self, index: int) -> torch.Tensor:
        """The parameter's tensor: full shape when unsharded, its ``(k, *shape[1:])`` local rows when sharded."""
        slot = self.layout.slots[index]
        if not self.sharded:
            return slot.view(self.data)
        lo, hi = self.layout.local_range(slot, self.rank)
        base = self.rank * self.layout.shard_numel
        rows = (hi - lo) // slot.row_numel
        return self.data[lo - base : hi - base].view((rows, *slot.shape[1:]) if len(slot.shape) else (rows,))

    def shard_view(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of the unsharded buffer (where its shard lands in an all-gather)."""
        n = self.layout.shard_numel
        return self.data[rank * n : (rank + 1) * n]

    # Storage lifetime: free after use, reallocate before the next all-gather.
    @property
    def is_allocated(self) -> bool:
        return self.data.untyped_storage().nbytes() > 0

    def free(self) -> None:
        storage = self.data.untyped_storage()
        if storage.nbytes() > 0 and self.data.device.type != "meta":
            storage.resize_(0)

    def alloc(self) -> None:
        storage = self.data.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._nbytes)

    def nbytes(self) -> int:
        return self.data.untyped_storage().nbytes()
