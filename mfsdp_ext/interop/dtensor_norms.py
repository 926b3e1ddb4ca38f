"""Norms of DTensors whose local shard is empty, so that ``torch.nn.utils.clip_grad_norm_`` works on any ranks.

torch.chunk's split (FSDP2's, and ours) leaves a rank no rows of a parameter with fewer rows than ranks (a (3, 8)
parameter on 4 ranks). DTensor computes a norm as the local norm of each shard, then reduces over the mesh
(``Partial("max")`` for the infinity norm); aten refuses the infinity norm of an empty tensor ("does not have an
identity"), so ``clip_grad_norm_(..., norm_type=inf)`` raises on those ranks (FSDP2 too). The grads' local views
cannot be made non-empty: they must be the shards the parameters' DTensors describe.

The fix: a DTensor op handler for ``aten._foreach_norm`` and ``aten.linalg_vector_norm`` (the two paths of
``clip_grad_norm_``) that stands a one-element local tensor holding the reduction's identity (0 for inf: norms
are >= 0; inf for -inf) in for an empty shard, then computes as DTensor always does. It changes only the
infinity norms of empty shards, which raised before; every other norm (p-norms of empty tensors are 0 in aten
already) goes through unchanged. Installed once, at the first fully_shard; it applies to every DTensor of the
process (FSDP2's included).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

_aten = torch.ops.aten
_OPS = (_aten._foreach_norm.Scalar, _aten.linalg_vector_norm.default)


def install() -> None:
    """Register the handler for both norm ops (idempotent; keeps any handler torch registers for them itself)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _OPS:
        handlers.setdefault(op, _norm_handler)


def _norm_handler(op_call, args, kwargs):
    ord = float(args[1]) if len(args) > 1 else float(kwargs.get("ord", 2.0))
    if math.isinf(ord):
        if op_call is _aten._foreach_norm.Scalar:
            args = ([_stand_in(t, ord) for t in args[0]],) + tuple(args[1:])
        else:
            args = (_stand_in(args[0], ord),) + tuple(args[1:])
    # Run DTensor's own dispatch: take this handler out for the call (DTensor ops run on one thread per process)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers.pop(op_call, None)
    try:
        return op_call(*args, **kwargs)
    finally:
        handlers[op_call] = _norm_handler


def _stand_in(t, ord: float):
    """``t``, or for an empty local shard the same DTensor (same global spec) over one identity element."""
    if not isinstance(t, DTensor) or t._local_tensor.numel() > 0:
        return t
    identity = 0.0 if ord > 0 else math.inf
    return DTensor(local_tensor=t._local_tensor.new_full((1,), identity), spec=t._spec, requires_grad=False)
