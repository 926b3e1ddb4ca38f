"""Public entry points: fully_shard(), microbatch(), reset_parameters()."""

from __future__ import annotations

import contextlib
import zlib
from typing import Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from . import checkpoint
from .mixed_precision import MixedPrecisionPolicy
from .module import FsdpModule, FsdpUnit, Strategy
from .param_group import ParamGroup, ParamPlace
from .symm_path import check_available

_DEFAULT_MESH: dict[str, DeviceMesh] = {}
_FSDP_CLASSES: dict[type, type] = {}


def fully_shard(module: nn.Module, *, mesh: Optional[DeviceMesh] = None, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                sharding_strategy: Union[str, Strategy] = Strategy.OPTIM_GRADS_PARAMS,
                use_symm_mem: Union[bool, str] = False) -> nn.Module:
    """Shard ``module``'s parameters (those no inner ``fully_shard`` unit owns) over ``mesh``, in place.

    Apply bottom-up (blocks first, then the root). Afterwards ``module.parameters()`` are fp32 DTensor shards
    split as torch.chunk splits them, exactly as FSDP2's (``Shard(0)``; ``Replicate()`` for ``no_shard``;
    ``(Replicate(), Shard(0))`` on a 2-D HSDP mesh), so any ``torch.optim`` optimizer, DCP and
    ``torch.distributed.checkpoint.state_dict`` work. Returns the same module, whose class now also derives
    from FsdpModule.
    """
    if isinstance(module, FsdpModule):
        raise ValueError(f"fully_shard: {type(module).__name__} is already sharded; apply fully_shard once per module")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed: call dist.init_process_group(...) first "
                           "(gloo on CPU, nccl with device_id=... on GPUs)")
    strategy = Strategy(sharding_strategy)
    if use_symm_mem not in (False, True, "auto"):
        raise ValueError(f"use_symm_mem must be False, True or 'auto', got {use_symm_mem!r}")
    mesh = mesh if mesh is not None else _default_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard supports a 1-D mesh (shard) or a 2-D mesh (replicate, shard); got {mesh.ndim}-D")
    if mesh.ndim == 2 and strategy is Strategy.NO_SHARD:
        raise ValueError("no_shard takes a 1-D mesh (the data-parallel group)")
    device = _mesh_device(mesh)

    params = _owned_params(module)
    _check_same_on_all_ranks(module, params, mesh, device)
    _move_buffers(module, device)
    if mesh.ndim == 2:
        shard_group, replicate_group = mesh.get_group(1), mesh.get_group(0)
    elif strategy is Strategy.NO_SHARD:
        shard_group, replicate_group = None, mesh.get_group(0)
    else:
        shard_group, replicate_group = mesh.get_group(0), None
    use_symm_mem = check_available(use_symm_mem, shard_group)

    groups = []
    for (dtype, requires_grad), members in _group_by_kind(params).items():
        groups.append(ParamGroup(
            members, mesh, compute_dtype=mp_policy.compute_dtype(dtype),
            reduce_dtype=mp_policy.reduction_dtype(dtype), main_grad_dtype=mp_policy.main_grad_dtype
            if dtype == torch.float32 else dtype, device=device, shard_group=shard_group,
            replicate_group=replicate_group,
            cache_model_weight=mp_policy.cache_model_weight and not strategy.keeps_weights_gathered))
    for fqn, p, _ in params:
        p._mfsdp_owner = module  # the original Parameter: a use of it outside this unit is caught later
    for g in groups:
        for info in g.infos:
            info.sharded._mfsdp_owner = module
        g.use_sharded_params()

    unit = FsdpUnit(module, type(module).__name__, groups, strategy, reshard_after_forward, mp_policy, device,
                    use_symm_mem)
    cls = module.__class__
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FsdpModule, cls), {})
    module.__class__ = _FSDP_CLASSES[cls]
    module._mfsdp_unit = unit
    module.register_forward_pre_hook(unit.pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(unit.post_forward, prepend=False)
    checkpoint.register_state_dict_hooks(module, groups)
    # Inner units now belong to this subtree's context (built lazily at the first forward).
    for m in module.modules():
        if isinstance(m, FsdpModule):
            m._mfsdp_unit.context = None
    return module


def _default_mesh() -> DeviceMesh:
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device_type not in _DEFAULT_MESH:
        _DEFAULT_MESH[device_type] = init_device_mesh(device_type, (dist.get_world_size(),))
    return _DEFAULT_MESH[device_type]


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    raise ValueError(f"fully_shard supports cpu and cuda meshes, got {mesh.device_type}")


def _owned_params(module: nn.Module) -> list[tuple[str, nn.Parameter, list[ParamPlace]]]:
    """Unique parameters of ``module``'s subtree not owned by an inner unit, with every place they appear."""
    found: dict[int, tuple[str, nn.Parameter, list[ParamPlace]]] = {}
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop(0)
        for name, p in m._parameters.items():
            if p is None:
                continue
            fqn = f"{prefix}{name}"
            owner = getattr(p, "_mfsdp_owner", None)
            if owner is not None:
                raise ValueError(
                    f"fully_shard: parameter '{fqn}' is shared with a module of an inner fully_shard unit "
                    f"({type(owner).__name__}); tied parameters must belong to one unit: shard the module that "
                    "contains every use of it, not the inner one")
            if isinstance(p, DTensor):
                raise ValueError(f"fully_shard: parameter '{fqn}' is already a DTensor (sharded by another API)")
            if p.dim() == 0:
                raise ValueError(f"fully_shard: parameter '{fqn}' is a 0-d scalar; rows cannot be sharded. "
                                 "Store it with shape (1,) instead")
            if not p.is_floating_point():
                raise ValueError(f"fully_shard: parameter '{fqn}' has non-floating dtype {p.dtype}; only floating "
                                 "parameters can be sharded (make it a buffer)")
            if id(p) in found:
                found[id(p)][2].append(ParamPlace(m, name, fqn))
            else:
                found[id(p)] = (fqn, p, [ParamPlace(m, name, fqn)])
        for child_name, child in m._modules.items():
            if child is not None and not isinstance(child, FsdpModule):
                stack.append((f"{prefix}{child_name}.", child))
    return list(found.values())


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """Buffers (e.g. rotary tables) of the unit's own modules follow the parameters to the mesh device."""
    stack = [module]
    while stack:
        m = stack.pop()
        for name, b in m._buffers.items():
            if b is not None and b.device.type != "meta" and b.device != device:
                m._buffers[name] = b.to(device)
        stack.extend(c for c in m.children() if not isinstance(c, FsdpModule))


def _group_by_kind(params):
    kinds: dict[tuple[torch.dtype, bool], list] = {}
    for item in params:
        p = item[1]
        kinds.setdefault((p.dtype, p.requires_grad), []).append(item)
    return kinds


def _check_same_on_all_ranks(module: nn.Module, params, mesh: DeviceMesh, device: torch.device) -> None:
    """One small all-reduce: every rank must shard the same parameters (names, shapes, dtypes) here."""
    desc = repr([(fqn, tuple(p.shape), str(p.dtype), p.requires_grad) for fqn, p, _ in params])
    h = zlib.crc32(desc.encode()) & 0x7FFFFFFF
    sig = torch.tensor([h, -h], dtype=torch.int64, device=device)
    for dim in range(mesh.ndim):
        dist.all_reduce(sig, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    if sig[0].item() != h or sig[1].item() != -h:
        raise RuntimeError(
            f"fully_shard({type(module).__name__}): the parameters differ across ranks (names, shapes or dtypes). "
            f"This rank has: {desc[:2000]}. Build the same model on every rank before sharding.")


# ---------------------------------------------------------------------------------------------- microbatches
def _roots(module: nn.Module) -> list[FsdpUnit]:
    """Top-most FSDP units under ``module`` (``module`` itself if it is one)."""
    if isinstance(module, FsdpModule):
        return [module._mfsdp_unit]
    roots = []
    for child in module.children():
        roots.extend(_roots(child))
    return roots


@contextlib.contextmanager
def microbatch(module: nn.Module, is_first: bool = True, is_last: bool = True) -> Iterator[None]:
    """Mark the forward/backward inside as one microbatch of a gradient-accumulation step.

    is_first=False: skip the main->model weight sync (weights only change at the optimizer step).
    is_last=False: strategies that defer a reduction (no_shard, optim, HSDP) accumulate locally.
    Previous flags are restored on exit, also on exceptions.
    """
    contexts = []
    for unit in _roots(module):
        ctx = unit.lazy_init()
        if ctx not in contexts:
            contexts.append(ctx)
    if not contexts:
        raise ValueError(f"microbatch: no fully_shard module found under {type(module).__name__}")
    saved = [(c.is_first_microbatch, c.is_last_microbatch, c.explicit_microbatch) for c in contexts]
    try:
        for c in contexts:
            c.is_first_microbatch, c.is_last_microbatch, c.explicit_microbatch = is_first, is_last, True
        yield
    finally:
        for c, (f, l, e) in zip(contexts, saved):
            c.is_first_microbatch, c.is_last_microbatch, c.explicit_microbatch = f, l, e


# ---------------------------------------------------------------------------------------------- meta init
@torch.no_grad()
def reset_parameters(module: nn.Module, init_fn: Optional[Callable[[nn.Module], None]] = None) -> None:
    """Initialise sharded parameters so every rank's shard is a slice of one consistent full tensor.

    Walks ``module.modules()`` in order (the order a single process initialises them in its constructor) and
    for each module with parameters of its own runs ``init_fn(m)`` (default: ``m.reset_parameters()``) on
    full-size temporaries of just that module's parameters, then keeps this rank's rows. Every rank draws the
    same random numbers, and no rank holds more than one module's full parameters at a time.
    """
    owners: dict[int, tuple[ParamGroup, int]] = {}
    for m in module.modules():
        if isinstance(m, FsdpModule):
            for g in m._mfsdp_unit.groups:
                for i, info in enumerate(g.infos):
                    owners[id(info.sharded)] = (g, i)
    for m in module.modules():
        direct = [(n, p) for n, p in m._parameters.items() if p is not None and id(p) in owners]
        if not direct:
            continue
        if init_fn is None and not hasattr(m, "reset_parameters"):
            raise ValueError(f"reset_parameters: {type(m).__name__} has parameters but no reset_parameters(); "
                             "pass init_fn=... to initialise it")
        temps = {}
        for n, p in direct:
            g, i = owners[id(p)]
            temps[n] = nn.Parameter(torch.empty(g.infos[i].shape, dtype=g.dtype, device=g.device),
                                    requires_grad=p.requires_grad)
            m._parameters[n] = temps[n]
        try:
            (init_fn or type(m).reset_parameters)(m)
        finally:
            for n, p in direct:
                g, i = owners[id(p)]
                g.main_weight.param_view(i).copy_(g.local_rows(i, temps[n]))
                m._parameters[n] = p
