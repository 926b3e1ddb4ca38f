"""The parameters a fully_shard call takes, and the checks on them: tied across units, scalar, integer, sparse,
on the wrong device, already FSDP2's, tensor-parallel placements."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as _FSDP2Module
from torch.distributed.tensor import DTensor

from ..core import placements, registry
from ..params.group import ParamPlace
from ..runtime.module import FsdpModule


def owned_params(modules: list[nn.Module], ignored=frozenset(), tied_elsewhere: Optional[list[str]] = None
                 ) -> list[tuple[str, nn.Parameter, list[ParamPlace]]]:
    """Unique parameters of the subtrees of ``modules`` (one module, or FSDP2's list) not owned by an inner unit,
    with every place they appear (a weight tied between two of the modules has a place in each); the ``ignored``
    ones (FSDP2's ignored_params) are left as they are, unchecked. A parameter another unit already took (a weight
    tied across two fully_shard calls) is left out and described in ``tied_elsewhere``: as FSDP2, the unit refuses
    at the first forward (lazy init), not here."""
    ignored_ids = {id(p) for p in ignored}
    found: dict[int, tuple[str, nn.Parameter, list[ParamPlace]]] = {}
    for holder in modules:
        stack = [("", holder)]
        while stack:
            prefix, m = stack.pop(0)
            if _is_fsdp2_module(m):
                raise ValueError(f"fully_shard: '{prefix[:-1] or type(m).__name__}' was sharded by PyTorch FSDP2's "
                                 "fully_shard; one model takes one of the two: apply mfsdp_ext.fully_shard to every "
                                 "unit")
            for name, p in m._parameters.items():
                if p is None or id(p) in ignored_ids:
                    continue
                fqn = f"{prefix}{name}"
                owner = registry.UNIT_OF_PARAM.get(p)
                if owner is not None:
                    if tied_elsewhere is not None:
                        tied_elsewhere.append(
                            f"Parameter '{fqn}' is shared with a parameter already managed by another FSDP group "
                            f"({owner}). For shared/tied parameters, use fully_shard([module_a, module_b]) to "
                            "place them in the same FSDP group (one unit over both modules)")
                    continue
                _check_param(fqn, p, m)
                place = ParamPlace(m, name, fqn, holder)
                if id(p) in found:
                    found[id(p)][2].append(place)
                else:
                    found[id(p)] = (fqn, p, [place])
            for child_name, child in m._modules.items():
                if child is not None and not isinstance(child, FsdpModule):
                    stack.append((f"{prefix}{child_name}.", child))
    return list(found.values())


def _check_param(fqn: str, p: nn.Parameter, holder: nn.Module) -> None:
    """FSDP2's refusals, with its exception types and messages (PyTorch's own FSDP2 tests check them)."""
    if p.dim() == 0:
        raise ValueError(f"fully_shard doesn't support scalar parameters. Change {fqn} to a 1D tensor with numel "
                         "equal to 1.")
    if not p.is_contiguous():
        raise NotImplementedError(f"FSDP does not support non-contiguous parameters yet: '{fqn}' {tuple(p.shape)} "
                                  f"stride {p.stride()} (e.g. channels_last): make it contiguous before fully_shard")
    if not p.is_floating_point():
        raise ValueError(f"fully_shard: parameter '{fqn}' has non-floating dtype {p.dtype}; only floating "
                         "parameters can be sharded (make it a buffer)")
    if getattr(holder, "sparse", False) and isinstance(holder, (nn.Embedding, nn.EmbeddingBag)):
        raise ValueError(f"fully_shard: parameter '{fqn}' belongs to an embedding with sparse=True; sparse "
                         "gradients cannot be reduce-scattered into flat shards: build it with sparse=False")


def check_tensor_parallel(params, mesh: DeviceMesh, placed: dict[int, tuple] | None = None,
                          spmd_of: dict[int, placements.SpmdDims] | None = None) -> None:
    """DTensor parameters (tensor parallelism applied before fully_shard) are taken when placed on a sibling
    sub-mesh of their data-parallel mesh (``mesh``, or the one shard_placement_fn gave them in ``placed``), as FSDP2
    takes them (placements.py); on a full SPMD mesh (``spmd_of``: dp_mesh_dims), every parameter is a DTensor on
    it, Replicate() on its data-parallel dims."""
    for fqn, p, _ in params:
        own = (placed or {}).get(id(p), (0, mesh))[1]
        spmd = (spmd_of or {}).get(id(own))
        problem = (placements.spmd_problem(fqn, p, spmd) if spmd is not None else
                   placements.tensor_parallel_problem(fqn, p, own) if isinstance(p, DTensor) else None)
        if problem is not None:
            raise ValueError(problem)


def check_devices(params, device: torch.device) -> None:
    """Parameters on the meta device (deferred init), on the mesh device, or on the CPU (copied to the mesh device,
    as FSDP2 moves them) are taken; parameters on another accelerator, or on another GPU than this rank's, are
    almost always a setup mistake that would otherwise surface at the first forward as a device mismatch."""
    for fqn, p, _ in params:
        problem = device_problem(fqn, p.device, device)
        if problem is not None:
            raise ValueError(problem)


def device_problem(fqn: str, found: torch.device, device: torch.device) -> Optional[str]:
    """What is wrong with a parameter on ``found`` for a mesh whose device on this rank is ``device`` (or None)."""
    if found.type in ("meta", "cpu") or found == device:
        return None
    if found.type != device.type:
        hint = ("the default mesh follows the process group's backend (gloo: cpu): init the process group with "
                f"nccl or pass mesh=init_device_mesh('{found.type}', ...)" if device.type == "cpu" else
                f"build the model on the CPU, on meta (then to_empty(device=...)) or on {device.type}")
        return (f"fully_shard: parameter '{fqn}' is on {found} but the mesh's device is {device}; {hint}. "
                "To train on the CPU, build the model on the CPU.")
    return (f"fully_shard: parameter '{fqn}' is on {found} but this rank's mesh device is {device} (the current "
            f"device): call torch.cuda.set_device(local_rank) before init_process_group and fully_shard, and build "
            "the model on that device (or on the CPU / meta)")


def _is_fsdp2_module(m: nn.Module) -> bool:
    """Sharded by torch's fully_shard (ours are torch FSDPModules too, with a unit of their own)."""
    return isinstance(m, _FSDP2Module) and not isinstance(m, FsdpModule)


def move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    """Buffers (e.g. rotary tables) of the unit's own modules follow the parameters to the mesh device."""
    stack = list(modules)
    while stack:
        m = stack.pop()
        for name, b in m._buffers.items():
            if b is not None and b.device.type != "meta" and b.device != device:
                m._buffers[name] = b.to(device)
        stack.extend(c for c in m.children() if not isinstance(c, FsdpModule))


def own_modules(module: nn.Module):
    """(fqn, module) of ``module``'s subtree, not entering inner units, in named_modules() order."""
    stack = [("", module)]
    while stack:
        fqn, m = stack.pop()
        yield fqn, m
        children = [(f"{fqn}.{n}" if fqn else n, c) for n, c in m._modules.items()
                    if c is not None and not isinstance(c, FsdpModule)]
        stack.extend(reversed(children))
