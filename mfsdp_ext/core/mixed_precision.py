"""Precision policy: fp32 main weights, compute and reduction dtypes, and FP8 weights (Fp8Policy)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy as _TorchMixedPrecisionPolicy

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NARROW_WIRE_DTYPES = (torch.bfloat16, torch.float16)  # gradients that may travel narrower than they are summed


@dataclass(frozen=True)
class Fp8Policy:
    """FP8 (e4m3) model weights for the chosen linear layers: cast from the fp32 main weights once per optimizer
    step with per-parameter current scaling, all-gathered in FP8 (half the bytes of bf16).

    compute: True: the layers compute with the gathered FP8 weight (FP8 GEMMs, ``fp8_linear``); no bf16 copy of
        these weights is gathered. False: the gathered FP8 weights are dequantized into the bf16 gathered buffer
        and the layers compute in ``param_dtype`` as before (communication savings only).
    modules: which ``nn.Linear`` layers (their ``weight``): None chooses every nn.Linear (or Fp8Linear) of a unit
        whose in and out features are multiples of 16, except the output head: a linear layer whose weight is
        tied (used by another module, e.g. an embedding), and, in a unit that encloses other fully_shard units
        or owns an ``nn.Embedding`` (the root of a language model), the last linear layer it owns directly
        (``named_modules()`` order). Or a callable ``fn(fqn, linear) -> bool``, ``fqn`` relative to the module
        given to fully_shard. Tied weights and ``no_shard``-marked parameters are never FP8.
    linear_config: the ``Fp8LinearConfig`` of the FP8 layers (compute=True; default: Fp8LinearConfig()).
    """

    compute: bool = True
    modules: Optional[Callable[[str, Any], bool]] = None
    linear_config: Any = None

    def __post_init__(self):
        if not isinstance(self.compute, bool):
            raise TypeError(f"Fp8Policy.compute must be True or False, got {self.compute!r}")
        if self.modules is not None and not callable(self.modules):
            raise TypeError(f"Fp8Policy.modules must be None or a callable fn(fqn, module) -> bool, got "
                            f"{self.modules!r}")


@dataclass(frozen=True)
class GroupDtypes:
    """The dtypes of one parameter group, resolved from the policy (``MixedPrecisionPolicy.group_dtypes``)."""

    compute: torch.dtype  # what the module computes with (and the all-gather moves)
    reduce: torch.dtype  # what gradients are summed in
    reduce_comm: Optional[torch.dtype]  # what gradients travel in; None: the reduce dtype
    main_grad: torch.dtype  # the sharded gradient the optimizer sees


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
        forward and backward of each), then the copy from there on: without microbatches the copy would cost
        memory and save nothing, since each weights version is gathered only twice. Strategies that
        keep the weights gathered (no_shard, optim, optim_grads) never need the copy. FP8 groups follow the
        same rule for their FP8 shard (1 byte per parameter / world size): True keeps it, cast once per step;
        False casts it at every all-gather (with the scales computed once per step) and frees it after the
        gather; None does that until a third gather of the same weights, then keeps it
        (benchmarks/results/step_fp8_cache_1xh200.md measures the three).
    fp8: an ``Fp8Policy``: FP8 weights for the chosen linear layers (needs param_dtype bfloat16 or float16 and
        float32 main weights). None: no FP8.
    reduce_comm_dtype: the dtype gradients travel in during the reduction. With param_dtype bfloat16 / float16 and
        reduce_dtype float32, the gradients are made in param_dtype, so sending them in it loses nothing: one
        all-to-all over the shard group (half the bytes of a float32 reduce-scatter), then this rank's shards from
        every rank added in float32 in rank order where they arrive. No addition happens in the narrower dtype; on 2
        ranks the result equals the float32 reduce-scatter's to the bit. None (default): that, where it was
        measured to win (NCCL shard groups whose ranks share one host), else one reduce-scatter in
        reduce_dtype (gloo, shard groups spanning hosts, other dtypes). ``param_dtype``: the all-to-all on any
        group; ``reduce_dtype`` (float32): always the reduce-scatter. Other values are refused.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    main_grad_dtype: torch.dtype = torch.float32
    cache_model_weight: Optional[bool] = None
    fp8: Optional[Fp8Policy] = None
    reduce_comm_dtype: Optional[torch.dtype] = None

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
        if self.fp8 is not None:
            if not isinstance(self.fp8, Fp8Policy):
                raise TypeError(f"MixedPrecisionPolicy.fp8 must be an mfsdp_ext.Fp8Policy or None, got {self.fp8!r}")
            if self.param_dtype not in (torch.bfloat16, torch.float16):
                raise ValueError(f"MixedPrecisionPolicy(fp8=...) needs param_dtype=torch.bfloat16 (or torch.float16): "
                                 f"the FP8 layers' inputs, outputs and gradients are in it; got {self.param_dtype}")
        if self.reduce_comm_dtype is not None and self.reduce_comm_dtype != self.reduce_dtype and (
                self.reduce_comm_dtype != self.param_dtype or self.param_dtype not in NARROW_WIRE_DTYPES
                or self.reduce_dtype != torch.float32):
            raise ValueError(
                f"reduce_comm_dtype={self.reduce_comm_dtype} needs param_dtype of that dtype (bfloat16 or float16: the "
                f"gradients' own) and reduce_dtype=torch.float32, got param_dtype={self.param_dtype}, reduce_dtype="
                f"{self.reduce_dtype}; pass reduce_comm_dtype=reduce_dtype to always reduce-scatter in it, or None "
                "for the default")

    def compute_dtype(self, main_dtype: torch.dtype) -> torch.dtype:
        return self.param_dtype or main_dtype

    def reduction_dtype(self, main_dtype: torch.dtype) -> torch.dtype:
        return self.reduce_dtype or self.compute_dtype(main_dtype)

    def reduction_comm_dtype(self, main_dtype: torch.dtype, narrow_wins: bool = False) -> torch.dtype:
        """The dtype a group of ``main_dtype`` parameters sends its gradients in (see reduce_comm_dtype).
        ``narrow_wins``: the shard group is one where the default sends them in their own dtype."""
        if self.reduce_comm_dtype is not None:
            return self.reduce_comm_dtype
        if narrow_wins and self.sends_narrow_by_default(main_dtype):
            return self.compute_dtype(main_dtype)
        return self.reduction_dtype(main_dtype)

    def group_dtypes(self, main_dtype: torch.dtype, narrow_wins: bool = False) -> GroupDtypes:
        """The dtypes of a group of ``main_dtype`` parameters (``narrow_wins``: see reduction_comm_dtype)."""
        return GroupDtypes(compute=self.compute_dtype(main_dtype), reduce=self.reduction_dtype(main_dtype),
                           reduce_comm=self.reduction_comm_dtype(main_dtype, narrow_wins),
                           main_grad=self.main_grad_dtype if main_dtype == torch.float32 else main_dtype)

    def sends_narrow_by_default(self, main_dtype: torch.dtype) -> bool:
        """Whether the default (reduce_comm_dtype=None) sends this group's gradients in their own, narrower dtype
        on a shard group where that wins: bf16 / fp16 gradients summed in float32."""
        return (self.reduce_comm_dtype is None and self.reduction_dtype(main_dtype) == torch.float32
                and self.compute_dtype(main_dtype) in NARROW_WIRE_DTYPES)


def as_mfsdp_policy(policy) -> MixedPrecisionPolicy:
    """``policy`` as mfsdp_ext's policy: ours as it is, torch's ``MixedPrecisionPolicy`` (what frameworks pass to
    FSDP2) field by field: param_dtype, reduce_dtype, output_dtype, cast_forward_inputs have the same meaning, and
    the fields only ours has keep their defaults."""
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    if isinstance(policy, _TorchMixedPrecisionPolicy):
        return MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                                    output_dtype=policy.output_dtype, cast_forward_inputs=policy.cast_forward_inputs)
    raise TypeError(f"fully_shard: mp_policy must be an mfsdp_ext.MixedPrecisionPolicy or torch's "
                    f"torch.distributed.fsdp.MixedPrecisionPolicy, got {policy!r}")
