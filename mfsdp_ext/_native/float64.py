"""The flat-buffer kernels for float64, as torch ops: the native kernels compute in float32 and take float32,
bfloat16 and float16 only, and a float64 model (``module.to(torch.float64)`` after fully_shard, as FSDP2 allows) must
stay exact in float64. Same contracts as the native kernels (``mfsdp_ext._native``), each a few torch ops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch


def involves(*tensors) -> bool:
    """Whether any of ``tensors`` (tensors, lists of them, None) is float64: those calls take this module's path."""
    for t in tensors:
        if isinstance(t, (list, tuple)):
            if involves(*t):
                return True
        elif isinstance(t, torch.Tensor) and t.dtype == torch.float64:
            return True
    return False


def pack(tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor, scale: float) -> None:
    out.zero_()
    for t, offset in zip(tensors, offsets):
        out[offset : offset + t.numel()].copy_(t.reshape(-1).to(out.dtype) * scale)


def pack_pieces(tensors: Sequence[Optional[torch.Tensor]], pieces: torch.Tensor, out: torch.Tensor,
                scale: float) -> None:
    out.zero_()
    for t, first, count, offset in pieces.tolist():
        if tensors[t] is not None:
            out[offset : offset + count].copy_(tensors[t].reshape(-1)[first : first + count].to(out.dtype) * scale)


def unpack(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    for out, offset in zip(outs, offsets):
        out.view(-1).copy_(flat[offset : offset + out.numel()])


def cast(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)


def grad_accumulate(main_grad: torch.Tensor, reduced: torch.Tensor, scale: float, accumulate: bool) -> None:
    rows = reduced.reshape(-1, main_grad.numel()).to(main_grad.dtype)
    if not accumulate:
        main_grad.zero_()
    for row in rows:  # in order, as the native kernel adds an all-to-all's shards
        main_grad.add_(row, alpha=scale)
