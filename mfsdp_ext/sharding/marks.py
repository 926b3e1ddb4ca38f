"""``no_shard(module_or_param)``: parameters that stay replicated under fully_shard (e.g. a frozen vision tower).

The mark is kept on the parameter objects until fully_shard takes them: the unit that owns a marked parameter puts
it in a replicated group (no all-gather, never freed, its gradient all-reduced once per step, a frozen one never
communicated), and fully_shard on a module whose parameters are all marked makes no unit and registers no hooks
(the enclosing unit, e.g. the root's, holds them).
"""

from __future__ import annotations

from typing import TypeVar

import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..core import registry

T = TypeVar("T", nn.Module, nn.Parameter)


def no_shard(obj: T) -> T:
    """Mark ``obj`` to stay replicated (no all-gather, gradients all-reduced once per step). Call it before
    fully_shard.

    Args:
        obj: a module (all its parameters) or one parameter.

    Returns:
        ``obj``.

    Raises:
        TypeError: not a module or a parameter.
        ValueError: the parameters are already sharded.
    """
    if isinstance(obj, nn.Parameter):
        params = [obj]
    elif isinstance(obj, nn.Module):
        params = list(obj.parameters())
    else:
        raise TypeError(f"no_shard takes an nn.Module or an nn.Parameter, got {type(obj).__name__}")
    if any(isinstance(p, DTensor) for p in params):
        raise ValueError("no_shard: the parameters are already sharded; mark them before calling fully_shard")
    for p in params:
        registry.NO_SHARD_MARKS[p] = True
    return obj


def is_marked(p: nn.Parameter) -> bool:
    return p in registry.NO_SHARD_MARKS
