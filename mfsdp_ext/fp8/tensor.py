"""Per-tensor scaled FP8 tensors: what the native quantizer returns (FP8 data, the fp32 ``scale_inv`` and, when
asked for, the transpose made in the same pass), with the transpose also made on demand by the native kernel.

``data.float() * scale_inv`` approximates the source; ``torch._scaled_mm`` takes ``scale_inv`` as its
``scale_a`` / ``scale_b``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import _native as N

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
FP8_MAX = N.FP8_MAX


@dataclass
class Fp8Tensor:
    """FP8 ``data`` with its dequantization scale. ``data_t``: the transpose of ``data`` seen as 2-D (rows = all
    leading dimensions, cols = the last one), contiguous, shape (cols, rows); None until made."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    data_t: Optional[torch.Tensor] = None

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def transposed(self) -> torch.Tensor:
        """``data_t``, made by the native FP8 transpose on first use and kept."""
        if self.data_t is None:
            d2 = self.data.reshape(-1, self.data.shape[-1]) if self.data.dim() != 2 else self.data
            self.data_t = torch.empty(d2.shape[1], d2.shape[0], dtype=d2.dtype, device=d2.device)
            N.fp8_transpose(d2, self.data_t)
        return self.data_t

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``data * scale_inv`` in fp32, rounded once to ``dtype`` (the native fp8_dequantize's arithmetic)."""
        return (self.data.float() * self.scale_inv.float()).to(dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype = E4M3, *, transpose: bool = False, eps: float = 1e-12,
             algo: str = "auto") -> Fp8Tensor:
    """Quantize ``x`` (contiguous; float32 / bfloat16 / float16; CPU or CUDA) to FP8 with per-tensor current
    scaling in one native call (CUDA: two launches, or one with ``algo="fused"``): amax, scale
    ``fp8_max / max(amax, eps)``, saturating cast. ``transpose=True`` also writes ``data_t`` in the same pass."""
    if dtype not in FP8_DTYPES:
        raise TypeError(f"mfsdp_ext.quantize: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    data = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    data_t = None
    if transpose:
        cols = x.shape[-1] if x.dim() else 1
        rows = x.shape[:-1].numel() if x.dim() else 1
        data_t = torch.empty(cols, rows, dtype=dtype, device=x.device)
    N.fp8_quantize(x, data, scale_inv, None, data_t, eps, algo)
    return Fp8Tensor(data, scale_inv, data_t)
