"""The leaves of a module's inputs or outputs, as FSDP2 walks them: pytree containers (tuples, lists, dicts and
registered classes such as HuggingFace's ModelOutput) and, inside them, dataclass instances field by field.

A tensor the walk misses is neither cast to the compute dtype nor hooked: a unit whose output tensor is hidden
from it would not be gathered again for its backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def flatten(tree: Any) -> tuple[list, Callable[[list], Any]]:
    """``(leaves, rebuild)``: the leaves in a fixed order, and ``rebuild(new_leaves)`` that makes the same structure
    over new leaves (dataclasses rebuilt with ``dataclasses.replace`` where a field changed)."""
    # the usual cases without pytree (its flatten + unflatten is ~20 us of host time per hook): a module returning
    # one tensor, and a module called with positional tensors or tuples of tensors only (the hooks flatten
    # ``(args, kwargs)``)
    if isinstance(tree, torch.Tensor):
        return [tree], lambda leaves: leaves[0]
    if type(tree) is tuple and len(tree) == 2 and type(tree[1]) is dict and not tree[1]:
        flat_args = _flatten_tensor_args(tree[0])
        if flat_args is not None:
            leaves, rebuild_args = flat_args
            return leaves, lambda new_leaves: (rebuild_args(new_leaves), {})
    flat, spec = tree_flatten(tree)
    if not any(_is_dataclass_instance(x) for x in flat):
        return flat, lambda leaves: tree_unflatten(leaves, spec)
    leaves, parts = [], []  # parts: per pytree leaf, (number of leaves it became, its rebuild or None)
    for x in flat:
        if _is_dataclass_instance(x):
            names = [f.name for f in dataclasses.fields(x) if f.init]
            sub, sub_rebuild = flatten([getattr(x, n) for n in names])
            leaves.extend(sub)
            parts.append((len(sub), _dataclass_rebuild(x, names, sub_rebuild)))
        else:
            leaves.append(x)
            parts.append((1, None))

    def rebuild(new_leaves: list) -> Any:
        out, i = [], 0
        for n, part_rebuild in parts:
            out.append(new_leaves[i] if part_rebuild is None else part_rebuild(new_leaves[i : i + n]))
            i += n
        return tree_unflatten(out, spec)

    return leaves, rebuild


def _flatten_tensor_args(args: Any) -> tuple[list, Callable[[list], tuple]] | None:
    """A tuple of tensors and tuples of tensors as (leaves, rebuild), in pytree's order; None for anything else."""
    if type(args) is not tuple:
        return None
    sizes: list[Optional[int]] = []  # per argument: None for a tensor, the length of a tuple of tensors
    for a in args:
        if isinstance(a, torch.Tensor):
            sizes.append(None)
        elif type(a) is tuple and all(isinstance(t, torch.Tensor) for t in a):
            sizes.append(len(a))
        else:
            return None
    leaves = [t for a, n in zip(args, sizes) for t in ((a,) if n is None else a)]

    def rebuild(new_leaves: list) -> tuple:
        out, i = [], 0
        for n in sizes:
            out.append(new_leaves[i] if n is None else tuple(new_leaves[i : i + n]))
            i += 1 if n is None else n
        return tuple(out)

    return leaves, rebuild


def _dataclass_rebuild(obj: Any, names: list[str], values_rebuild: Callable[[list], list]) -> Callable[[list], Any]:
    def rebuild(new_leaves: list) -> Any:
        values = values_rebuild(new_leaves)
        changed = {n: v for n, v in zip(names, values) if v is not getattr(obj, n)}
        return dataclasses.replace(obj, **changed) if changed else obj

    return rebuild
