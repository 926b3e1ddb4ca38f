"""Loads the native extension ``mfsdp_ext._C`` and exposes its kernels to the Python layer.

TEMPORARY: until the native kernels land (issue 3), the functions below are plain-torch versions of the
contract. The kernels issue replaces each body with a call into ``_C`` and keeps these semantics exactly.

Contract (all buffers are 1-D, contiguous, on one device; nothing here allocates outputs):

pack(tensors, offsets, out, scale=1.0)
    out[offsets[i] : offsets[i] + tensors[i].numel()] = tensors[i].flatten() * scale, cast to out.dtype (RNE).
    Every element of ``out`` that no tensor covers is set to 0 (the whole output is written).
unpack(flat, offsets, outs)
    outs[i].view(-1)[:] = flat[offsets[i] : offsets[i] + outs[i].numel()], cast to outs[i].dtype.
cast(src, dst)
    dst[:] = src cast to dst.dtype (fp32 -> bf16 / fp16, round to nearest even).
segment_amax(src, segments, amax)
    segments: int64 (n, 2) of [start, end) element ranges into src, on src's device.
    amax[i] = max |src[start:end]| (0 for an empty segment; NaN if any element is NaN).
fp8_cast(src, segments, amax, dst, scale_inv, eps=1e-12)
    scale_i = fp8_max / max(amax[i], eps), or 1 where amax[i] is 0, inf or NaN.
    dst[start:end] = saturate(src[start:end] * scale_i) to +-fp8_max, NaN stays NaN; elements of dst in no
    segment are 0. scale_inv[i] = 1 / scale_i. dst dtype: float8_e4m3fn (max 448) or float8_e5m2 (57344).
fp8_dequantize(src, segments, scale_inv, dst)
    dst[start:end] = src[start:end].float() * scale_inv[i] cast to dst.dtype; elements in no segment are 0.
grad_accumulate(main_grad, reduced, scale, accumulate)
    main_grad[:] = (main_grad if accumulate else 0) + scale * reduced.float()  (fp32 arithmetic).
"""

from __future__ import annotations

from typing import Sequence

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def build_info() -> dict:
    return {"cpu": False, "cuda": False, "nccl": False, "native": False}


def pack(tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor, scale: float = 1.0) -> None:
    out.zero_()
    for t, off in zip(tensors, offsets):
        dst = out[off : off + t.numel()]
        dst.copy_(t.reshape(-1))
        if scale != 1.0:
            dst.mul_(scale)


def unpack(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    for t, off in zip(outs, offsets):
        t.view(-1).copy_(flat[off : off + t.numel()])


def cast(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)


def segment_amax(src: torch.Tensor, segments: torch.Tensor, amax: torch.Tensor) -> None:
    for i, (s, e) in enumerate(segments.tolist()):
        amax[i] = src[s:e].abs().max() if e > s else 0.0


def _scales(amax: torch.Tensor, fp8_max: float, eps: float) -> torch.Tensor:
    scale = fp8_max / torch.clamp(amax, min=eps)
    bad = (amax == 0) | ~torch.isfinite(amax)
    return torch.where(bad, torch.ones_like(scale), scale)


def fp8_cast(src, segments, amax, dst, scale_inv, eps: float = 1e-12) -> None:
    fp8_max = FP8_MAX[dst.dtype]
    scale = _scales(amax, fp8_max, eps)
    dst.view(torch.uint8).zero_()
    for i, (s, e) in enumerate(segments.tolist()):
        dst[s:e] = torch.clamp(src[s:e] * scale[i], -fp8_max, fp8_max).to(dst.dtype)
    scale_inv.copy_(1.0 / scale)


def fp8_dequantize(src, segments, scale_inv, dst) -> None:
    dst.zero_()
    for i, (s, e) in enumerate(segments.tolist()):
        dst[s:e] = src[s:e].float() * scale_inv[i]


def grad_accumulate(main_grad: torch.Tensor, reduced: torch.Tensor, scale: float, accumulate: bool) -> None:
    if accumulate:
        main_grad.add_(reduced.float(), alpha=scale)
    else:
        torch.mul(reduced.float(), scale, out=main_grad)
