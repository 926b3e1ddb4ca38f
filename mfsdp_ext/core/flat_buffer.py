"""FlatBuffer: one flat tensor laid out by a FlatLayout, either one rank's shard or the param-major gathered buffer.

Releasing storage resizes the untyped storage to 0 bytes and reallocating resizes it back, so parameter views
and tensors that autograd saved keep pointing at the same storage object and stay valid across the cycle.
"""

from __future__ import annotations

import math

import torch

from .layout import FlatLayout


class FlatBuffer:
    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, *, rank: int | None = None,
                 pin_memory: bool = False):
        """``rank=None`` makes the param-major unsharded buffer; otherwise that rank's shard. ``pin_memory``:
        page-locked host memory (``device`` the CPU), which copies to and from a GPU can overlap."""
        self.layout = layout
        self.rank = rank
        numel = layout.unsharded_numel if rank is None else layout.shard_numel
        self.data = torch.empty(numel, dtype=dtype, device=device, pin_memory=pin_memory)
        self._nbytes = self.data.untyped_storage().nbytes()
        self._view_args = layout.view_args(rank)  # param_view's as_strided arguments, made once per layout

    @property
    def sharded(self) -> bool:
        return self.rank is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def param_view(self, index: int) -> torch.Tensor:
        """The parameter's tensor: full shape when unsharded; in a shard, the ``(k, *shape[1:])`` rows this
        rank holds (torch.chunk's split, k possibly 0). One as_strided (gradients are viewed again every step)."""
        return self.data.as_strided(*self._view_args[index])

    def param_alias(self, index: int) -> torch.Tensor:
        """``param_view(index)``'s elements as a tensor at storage offset 0, on a slice of this buffer's storage
        (same memory; the slice keeps the buffer's allocation alive). A DTensor over it pickles: torch 2.13's
        torch.save fails on a DTensor whose local tensor starts inside its storage ("invalid python storage")."""
        if self.data.device.type == "meta":  # no storage to slice (a meta group gets real storage at materialize)
            return self.param_view(index)
        shape, stride, offset = self._view_args[index]
        size = self.data.element_size()
        storage = self.data.untyped_storage()[offset * size : (offset + math.prod(shape)) * size]
        return torch.empty(0, dtype=self.data.dtype, device=self.data.device).set_(storage, 0, shape, stride)

    def chunk_slot(self, index: int, rank: int | None = None) -> torch.Tensor:
        """Parameter ``index``'s chunk slot (``chunk_rows`` rows, padding included): in a shard, this rank's;
        in the unsharded buffer, where ``rank``'s chunk lands (for a dim > 0 split: in the staging area)."""
        slot = self.layout.slots[index]
        start = slot.shard_offset if self.sharded else slot.gathered_offset + rank * slot.chunk_numel
        return self.data[start : start + slot.chunk_numel]

    def padded_param(self, index: int) -> torch.Tensor:
        """Unsharded buffer only: where an all-gather of the parameter's chunks lands: the parameter padded to
        ``world * chunk_rows`` rows (dim 0), or its staging area (dim > 0; ``unstage`` puts it in place)."""
        slot = self.layout.slots[index]
        return self.data[slot.gathered_offset : slot.gathered_offset + self.layout.world_size * slot.chunk_numel]

    def param_region(self, index: int) -> torch.Tensor:
        """Unsharded buffer only: the parameter's own elements, flat (padding rows included for dim 0)."""
        slot = self.layout.slots[index]
        return self.data[slot.unsharded_offset : slot.unsharded_offset + slot.world * slot.chunk_numel]

    def unstage(self) -> None:
        """Unsharded buffer only: each dim > 0 parameter's gathered chunks, ``W`` slices ``[outer, b, inner]``
        back to back in its staging area, into place as ``[outer, W * b, inner]`` (one strided copy each)."""
        world = self.layout.world_size
        for slot in self.layout.slots:
            if slot.dim:
                outer = slot.shape[: slot.dim].numel()
                staged = self.data[slot.staging_offset : slot.staging_offset + slot.numel].view(world, outer, -1)
                placed = self.data[slot.unsharded_offset : slot.unsharded_offset + slot.numel].view(outer, world, -1)
                placed.copy_(staged.transpose(0, 1))

    # Storage lifetime: free after use, reallocate before the next all-gather.
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
