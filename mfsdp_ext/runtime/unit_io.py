"""What a unit's hooks do to the module's inputs and outputs: cast floating inputs to the compute dtype, route the
inputs that need grad through ``PostBackward`` (its backward is the unit's post-backward), and hook the output tensors
for the pre-backward gather. Inputs and outputs are walked as FSDP2 walks them (core/tensor_tree.py)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch

from ..core import tensor_tree


class Unit(Protocol):
    """What this module needs of a unit (runtime/unit.py's FsdpUnit)."""

    name: str

    def post_backward(self) -> None: ...


class PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs once the unit's own backward is complete."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None,) + grads


def prepare_inputs(unit: Unit, args, kwargs, dtype: Optional[torch.dtype], hook: bool):
    """The forward inputs, floating-point ones cast to ``dtype`` (None: as they are), and (``hook``) those that need
    grads routed through PostBackward; one flatten of the inputs for both. Returns (args, kwargs, hooked)."""
    if dtype is None and not hook:
        return args, kwargs, False
    flat, rebuild = tensor_tree.flatten((args, kwargs))
    if dtype is not None:
        flat = [t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() and t.dtype != dtype else t
                for t in flat]
    idx = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad] if hook else []
    if idx:
        outs = PostBackward.apply(unit, *[flat[i] for i in idx])
        for i, t in zip(idx, outs):
            flat[i] = t
    args, kwargs = rebuild(flat)
    return args, kwargs, bool(idx)


def hook_outputs(output, hook: Callable) -> bool:
    """Register ``hook`` on the output tensors that require grad (the pre-backward gather); False if there are none."""
    hooked = False
    for t in tensor_tree.flatten(output)[0]:
        if torch.is_tensor(t) and t.requires_grad:
            t.register_hook(hook)
            hooked = True
    return hooked


def warn_no_grad_output(unit: Unit, output) -> None:
    warnings.warn(
        f"mfsdp_ext: unit '{unit.name}' has trainable parameters but its output ({type(output).__name__}) holds "
        "no tensor that requires grad where fully_shard looks (tensors in tuples, lists, dicts, dataclasses and "
        "pytree-registered classes). If its output tensors are inside another class, the backward cannot "
        "gather the weights again, so they stay gathered after this forward (more memory; gradients stay "
        "right). Return a supported container, or register the class with torch.utils._pytree. (Warned once "
        "per unit.)", stacklevel=3)


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    flat, rebuild = tensor_tree.flatten(tree)
    return rebuild([t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() and t.dtype != dtype else t
                    for t in flat])


def eager_hook(hook: Callable) -> Callable:
    """The hook, run outside any torch.compile'd region: ``torch.compile(module)`` traces the module's hooks too,
    and ours (collectives, stream and state bookkeeping) must run eagerly around the compiled forward, as FSDP2's
    do. Eager calls pay one flag read (no torch._dynamo import); a module compiled with ``module.compile()``
    (before or after fully_shard) gets ``compiled_hook(hook)`` instead."""

    @functools.wraps(hook)
    def eager(*args, **kwargs):
        if torch.compiler.is_compiling():
            return torch._dynamo.disable(hook, recursive=True, reason="mfsdp_ext hooks run eagerly")(*args, **kwargs)
        return hook(*args, **kwargs)

    eager.mfsdp_hook = hook  # type: ignore[attr-defined]
    return eager


def compiled_hook(hook: Callable) -> Callable:
    """The hook as a dynamo-disabled function, for a module compiled with ``module.compile()``: its frame is one
    dynamo skips (as FSDP2's hooks), so it runs eagerly without a graph break, also under ``fullgraph=True``
    (torchtitan compiles each block so, before fully_shard). ``eager_hook``'s wrapper would be traced there, and
    its call to torch._dynamo.disable inside the trace is refused with fullgraph."""
    import torch._dynamo  # only for compiled modules: torch.compile imports it anyway

    hook = getattr(hook, "mfsdp_hook", hook)  # the hook itself, not eager_hook's wrapper
    return torch._dynamo.disable(hook, recursive=True, reason="mfsdp_ext hooks run eagerly")
