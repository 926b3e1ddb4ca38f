"""Which linear layers of a unit get FP8 weights (``MixedPrecisionPolicy(fp8=Fp8Policy(...))``), and the class swap
of those that compute in FP8."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..core.mixed_precision import MixedPrecisionPolicy
from ..core.states import Strategy
from ..fp8.linear import Fp8LinearConfig, Fp8LinearMixin, _fp8_class
from ..runtime.module import FsdpModule
from .marks import is_marked
from .params import own_modules


# ---------------------------------------------------------------------------------------------- FP8 weights
def _fp8_capable(m: nn.Module) -> bool:
    """An nn.Linear computing with nn.Linear's forward (or already an Fp8Linear): its forward can be FP8's."""
    return isinstance(m, nn.Linear) and (isinstance(m, Fp8LinearMixin) or type(m).forward is nn.Linear.forward)


def _output_head(modules: list[nn.Module], linears: list[tuple[str, nn.Module]]) -> Optional[nn.Module]:
    """The unit's output head (Fp8Policy's docstring): in a unit that encloses other units or owns an
    nn.Embedding, the last linear layer it owns directly; None elsewhere (tied heads are excluded before). A unit
    over a list of modules (FSDP2's ``[norm, output]``) counts as enclosing: it is the tail of a larger model."""
    encloses = len(modules) > 1 or any(isinstance(m, FsdpModule) for module in modules
                                       for m in module.modules() if m is not module)
    owns_embedding = any(isinstance(m, nn.Embedding) for module in modules for _, m in own_modules(module))
    return linears[-1][1] if linears and (encloses or owns_embedding) else None


def choose_fp8_weights(modules: list[nn.Module], params, mp_policy: MixedPrecisionPolicy, strategy) -> set[int]:
    """ids of the parameters that become FP8 weights (``mp_policy.fp8``); with compute=True their layers become
    Fp8Linear subclasses (class swap, as to_fp8_linear: parameters and state dict unchanged)."""
    policy = mp_policy.fp8
    if policy is None:
        return set()
    if strategy is Strategy.NO_SHARD:
        raise ValueError("MixedPrecisionPolicy(fp8=...) with sharding_strategy='no_shard': FP8 weights save the "
                         "all-gather's bytes, and no_shard gathers nothing; use a sharded strategy or no fp8")
    if policy.compute:
        _refuse_compiled(modules)
    config = policy.linear_config or Fp8LinearConfig()
    if not isinstance(config, Fp8LinearConfig):
        raise TypeError(f"Fp8Policy.linear_config must be an Fp8LinearConfig, got {config!r}")
    by_weight = {id(p): (fqn, p, places) for fqn, p, places in params}
    linears = [(fqn, m) for module in modules for fqn, m in own_modules(module) if _fp8_capable(m)
               and id(m._parameters.get("weight")) in by_weight]
    head = _output_head(modules, linears)
    chosen = set()
    for fqn, m in linears:
        _, p, places = by_weight[id(m.weight)]
        if len(places) > 1 or is_marked(p):
            continue  # tied (an embedding's table, a tied head) or replicated: never FP8
        if isinstance(p, DTensor) and (policy.modules(fqn, m) if policy.modules is not None else True):
            raise ValueError(f"MixedPrecisionPolicy(fp8=...): '{fqn or type(m).__name__}' is a tensor-parallel "
                             "layer, whose FP8 weights are not supported; leave it out with "
                             "Fp8Policy(modules=lambda fqn, m: ...)")
        default = m.in_features % 16 == 0 and m.out_features % 16 == 0 and m is not head
        if not (policy.modules(fqn, m) if policy.modules is not None else default):
            continue
        chosen.add(id(p))
        if policy.compute:
            if not isinstance(m, Fp8LinearMixin):
                m.__class__ = _fp8_class(type(m))
                m.fp8_config = config
            elif policy.linear_config is not None:  # an Fp8Linear keeps its own config unless the policy has one
                m.fp8_config = config
            m._fp8_name, m._fp8_weight_only = fqn or type(m).__name__, True
    return chosen


def _refuse_compiled(modules: list[nn.Module]) -> None:
    """FP8 compute inside a module torch.compile wraps (torchtitan compiles each block before sharding it): the FP8
    layers' native kernels are not torch operators, so dynamo cannot trace them (with fullgraph=True, the first
    forward fails deep inside the compiler). Refused here, by name."""
    compiled = [type(m).__name__ for module in modules for m in module.modules()
                if getattr(m, "_compiled_call_impl", None) is not None]
    if compiled:
        raise ValueError(f"MixedPrecisionPolicy(fp8=Fp8Policy(compute=True)) on a module compiled with torch.compile "
                         f"({compiled[0]}): the FP8 layers' native kernels cannot be traced by torch.compile; shard "
                         "it without compiling it (torchtitan: without --compile.enable), or use torchao's float8 "
                         "training (torchtitan's float8 converter), which torch.compile traces")
