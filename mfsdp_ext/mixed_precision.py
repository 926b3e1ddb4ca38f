"""Precision policy: fp32 main weights, compute and reduction dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Same fields as FSDP2's policy, plus ``main_grad_dtype``.

    param_dtype: dtype the module computes in (None: the parameter's own dtype, no cast).
    reduce_dtype: dtype of the gradient reduction (None: param_dtype, as in FSDP2).
    output_dtype: dtype forward outputs are cast to (None: left as computed).
    cast_forward_inputs: cast floating-point forward inputs to param_dtype.
    main_grad_dtype: dtype of the sharded gradient the optimizer sees (fp32 by default).
    cache_model_weight: keep a compute-dtype copy of the main-weight shard, cast once per optimizer step
        (+2 bytes per parameter / world size for bf16), or cast into this rank's slot of the gathered buffer at
        every all-gather and gather in place (False: FSDP2's memory, a cast per all-gather). None (default):
        no copy until a group's weights are gathered a third time in training without changing (microbatches:
        forward and backward of each), then the copy from there on. Measured on 4 H200 (benchmarks/results/
        step_4gpu_no_weight_cache.md): without microbatches the copy buys nothing (70.9 vs 70.0 ms, 57.7 vs
        57.7 ms) and costs 0.4-0.9 GiB; with 4 microbatches it saves 2.5% (152.1 vs 155.9 ms). Strategies that
        keep the weights gathered (no_shard, optim, optim_grads) never need the copy.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    main_grad_dtype: torch.dtype = torch.float32
    cache_model_weight: Optional[bool] = None

    def __post_init__(self):
        if self.param_dtype is not None and self.param_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"param_dtype must be one of {COMPUTE_DTYPES} or None, got {self.param_dtype}; "
                             "FP8 weights are configured separately")
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {REDUCE_DTYPES} or None, got {self.reduce_dtype}")
        if self.cache_model_weight not in (None, True, False):
            raise ValueError(f"cache_model_weight must be None (auto), True or False, got {self.cache_model_weight!r}")
        if self.main_grad_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"main_grad_dtype must be float32 or bfloat16, got {self.main_grad_dtype}")

    def compute_dtype(self, main_dtype: torch.dtype) -> torch.dtype:
        return self.param_dtype or main_dtype

    def reduction_dtype(self, main_dtype: torch.dtype) -> torch.dtype:
        return self.reduce_dtype or self.compute_dtype(main_dtype)
