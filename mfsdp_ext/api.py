"""Public entry points: fully_shard(), microbatch(), reset_parameters()."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from .comm.policy import CommPolicy
from .core import registry
from .core.mixed_precision import MixedPrecisionPolicy, as_mfsdp_policy
from .core.states import Strategy
from .interop import checkpoint, dtensor_norms
from .params import rows
from .params.group import ParamGroup
from .runtime import post_forward
from .runtime.context import SharedStreams
from .runtime.fsdp2_state import state as fsdp2_state
from .runtime.module import FsdpModule
from .runtime.unit import FsdpUnit, UnitConfig, resolve_reshard_after_forward
from .runtime.unit_io import compiled_hook, eager_hook
from .sharding import groups as unit_groups
from .sharding import mesh as unit_mesh
from .sharding import params as unit_params
from .sharding import placement_fn
from .sharding.marks import is_marked

_DEFAULT_MP_POLICY = MixedPrecisionPolicy()  # frozen: one instance serves as the default


def fully_shard(module: Union[nn.Module, list], *, mesh: Optional[DeviceMesh] = None,
                reshard_after_forward: Optional[bool | int] = None, shard_placement_fn: Optional[Callable] = None,
                mp_policy=_DEFAULT_MP_POLICY, offload_policy=None, ignored_params: Optional[set] = None,
                dp_mesh_dims=None, sharding_strategy: Union[str, Strategy] = Strategy.OPTIM_GRADS_PARAMS,
                use_symm_mem: Union[bool, str] = False, native_collectives: bool = False, verbose: bool = False,
                check_finite_grads: bool = False, copy_engine_all_gather: Union[bool, str] = "auto",
                copy_engine_reduce_scatter: Union[bool, str] = "auto") -> Union[nn.Module, list]:
    """Shard ``module``'s parameters (those no inner ``fully_shard`` unit owns) over ``mesh``, in place.

    Apply bottom-up (blocks first, then the root). Afterwards ``module.parameters()`` are fp32 DTensor shards
    split as torch.chunk splits them, exactly as FSDP2's (``Shard(0)``; ``Replicate()`` for ``no_shard``;
    ``(Replicate(), Shard(0))`` on a 2-D HSDP mesh), so any ``torch.optim`` optimizer, DCP and
    ``torch.distributed.checkpoint.state_dict`` work. The module is now also a ``torch.distributed.fsdp.FSDPModule``
    (an ``mfsdp_ext.FsdpModule``).

    Args:
        module: the module, or FSDP2's list of modules (e.g. torchtitan's ``[model.norm, model.output]``): one
            unit over all of them, one gather and one reduction, a weight tied between two of them held once.
        mesh: a 1-D mesh (shard) or a 2-D HSDP mesh (replicate, shard); default: one dim over the world.
        reshard_after_forward: FSDP2's: True (None) frees the gathered weights after forward, False keeps them, an
            int N keeps them sharded over groups of N ranks (a factor of the shard dim's size), whose backward
            gathers within the group.
        shard_placement_fn: FSDP2's, per parameter: None or ``Shard(d)`` (d > 0: an even split) or a
            ``ShardPlacementResult`` (a mesh of its own).
        mp_policy: torch's ``MixedPrecisionPolicy`` (mapped field by field) or ``mfsdp_ext.MixedPrecisionPolicy``.
        offload_policy: FSDP2's ``OffloadPolicy()`` or None (no offload), or ``CPUOffloadPolicy()`` (docs/api.md).
        ignored_params: left as they are (not sharded, not moved, gradients not reduced).
        dp_mesh_dims: FSDP2's full-SPMD form: ``mesh`` holds every parallel dim, the parameters are DTensors on
            it, Replicate() on the dims this names, and fully_shard shards and replicates over those.
        sharding_strategy: ``"optim_grads_params"`` (ZeRO-3, default), ``"optim_grads"``, ``"optim"`` or
            ``"no_shard"``.
        use_symm_mem: NCCL symmetric memory for the collectives: True, "auto" (per size, where it times faster)
            or False.
        native_collectives: issue the collectives through mfsdp_ext's own NCCL communicator instead of
            ProcessGroupNCCL: less host time per collective, but no watchdog timeout (``mfsdp_ext.comm.native``).
        verbose: on the root (or ``MFSDP_EXT_SUMMARY=1``): one line per unit at the first forward (rank 0).
        check_finite_grads: on the root: after each backward, raise ``NonFiniteGradError`` on every rank naming
            the first parameter whose reduced gradient holds NaN or inf.
        copy_engine_all_gather: move the weights with the copy engines through peer-mapped memory (GPUs of one
            host) instead of NCCL's kernels, leaving every SM to the compute beside them. "auto" (default): both
            directions where they can run (CUDA, NCCL, the shard group on one host, torch's symmetric memory),
            ``use_symm_mem`` and ``native_collectives`` are off, and buffers within 1% of the resident training
            state take most groups in at most two rounds (docs/api.md), else NCCL's; True: refused where they
            cannot run, buffers the size of the largest group; False: NCCL's all-gather.
        copy_engine_reduce_scatter: the same for the bf16 gradients' exchange (the default wire on one host).

    Returns:
        ``module`` (the list, for the list form).

    Raises:
        RuntimeError: torch.distributed is not initialised, or an option this build, backend or machine cannot
            give (the message names it).
        ValueError: a module sharded twice, by FSDP2 already, nested in the list; a 0-d, integer or sparse
            parameter; a parameter tied across units or on the wrong device; a mesh or placement fully_shard does
            not take.
        TypeError: arguments of the wrong kind (a module, a policy).
    """
    modules, offload = _checked_call(module, offload_policy)
    mp_policy = as_mfsdp_policy(mp_policy)
    reshard_root = reshard_after_forward is not None  # FSDP2's: only its default None keeps the root's weights
    reshard_after_forward = resolve_reshard_after_forward(reshard_after_forward, allow_int=True)
    mesh, strategy, spmd_of = placement_fn.full_mesh(mesh, dp_mesh_dims, Strategy(sharding_strategy))
    dtensor_norms.install()  # clip_grad_norm_(norm_type=inf) on ranks with empty shards
    mesh, device, shard_group, replicate_group = unit_mesh.resolve_mesh(mesh, strategy)
    tied_elsewhere: list[str] = []
    params = unit_params.owned_params(modules, ignored_params or (), tied_elsewhere)
    placed = placement_fn.shard_placements(shard_placement_fn, params, mesh, spmd_of)
    unit_params.check_tensor_parallel(params, mesh, placed, spmd_of)
    if params and all(is_marked(p) for _, p, _ in params):
        return module  # all no_shard: no unit, no hooks; the enclosing unit (the root's) holds them
    unit_params.check_devices(params, device)
    unit_params.move_buffers(modules, device)
    comm = CommPolicy.checked(shard_group, native=native_collectives, symm_mem=use_symm_mem,
                              copy_engine_all_gather=copy_engine_all_gather,
                              copy_engine_reduce_scatter=copy_engine_reduce_scatter,
                              several_meshes=any(own is not mesh for _, own in placed.values()))
    groups = unit_groups.make_groups(modules, params, mesh, device, mp_policy, strategy, placed, spmd_of, offload)
    reshard_after_forward = post_forward.check(reshard_after_forward, mesh, groups)
    config = UnitConfig(strategy, mp_policy, device, comm, verbose=verbose, check_finite_grads=check_finite_grads)
    unit = FsdpUnit(modules, groups, config=config, reshard_after_forward=reshard_after_forward)
    unit.controls.reshard_root = reshard_root
    unit.refusal = tied_elsewhere[0] if tied_elsewhere else None  # raised at the first forward, as FSDP2
    for m in modules:
        _become_fsdp_module(m, unit)
    checkpoint.register_state_dict_hooks(modules, groups)
    return module


fully_shard.state = fsdp2_state  # type: ignore[attr-defined]  # FSDP2's fully_shard.state(module)


def _checked_call(module, offload_policy) -> tuple[list[nn.Module], Optional[CPUOffloadPolicy]]:
    """The modules of the call and its CPU offload policy (None: none), once the arguments that need no mesh and the
    process group are checked."""
    modules = _modules_of(module)
    offload = _check_offload(offload_policy)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed: call dist.init_process_group(...) first "
                           "(gloo on CPU, nccl with device_id=... on GPUs)")
    return modules, offload


def _modules_of(module) -> list[nn.Module]:
    """The modules of one fully_shard call: ``module``, or FSDP2's list of modules that do not contain each other."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fully_shard takes an nn.Module or a non-empty list of them, got {module!r:.80}")
    for m in modules:
        if isinstance(m, FsdpModule):
            raise ValueError(f"fully_shard: {type(m).__name__} is already sharded; apply fully_shard once per module")
    nested = [(a, b) for a in modules for b in modules if a is not b and any(m is b for m in a.modules())]
    if nested:
        raise ValueError(f"fully_shard([...]): {type(nested[0][1]).__name__} lies inside "
                         f"{type(nested[0][0]).__name__}; list modules that do not contain each other")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard([...]): a module is listed twice")
    return modules


def _check_offload(offload_policy) -> Optional[CPUOffloadPolicy]:
    """FSDP2's two policies: ``OffloadPolicy()`` (no offload, as None) and ``CPUOffloadPolicy`` (returned)."""
    if offload_policy is None or type(offload_policy) is OffloadPolicy:
        return None
    if isinstance(offload_policy, CPUOffloadPolicy):
        return offload_policy
    raise TypeError(f"fully_shard: offload_policy must be torch's OffloadPolicy(), CPUOffloadPolicy(...) or None, got "
                    f"{offload_policy!r}")


def _become_fsdp_module(module: nn.Module, unit: FsdpUnit) -> None:
    """Give the module the FsdpModule methods (a subclass made once per class) and the unit's hooks."""
    cls = module.__class__
    if cls not in registry.FSDP_CLASSES:
        # torch's FSDPModule.__new__ builds the original class, which it finds at this index of the MRO
        fsdp_cls = type(f"FSDP{cls.__name__}", (FsdpModule, cls), {})
        fsdp_cls._orig_cls_mro_index = fsdp_cls.__mro__.index(cls)  # type: ignore[attr-defined]
        registry.FSDP_CLASSES[cls] = fsdp_cls
    module.__class__ = registry.FSDP_CLASSES[cls]
    module._mfsdp_unit = unit  # type: ignore[assignment]
    for _, managed in unit_params.own_modules(module):  # as FSDP2 marks them (HF generate reads it; dynamo too)
        managed._is_fsdp_managed_module = True
        managed._fsdp_use_orig_params = True
    # compiled already (torchtitan compiles each block before sharding it): hooks that dynamo skips
    as_hook = compiled_hook if getattr(module, "_compiled_call_impl", None) is not None else eager_hook
    module.register_forward_pre_hook(as_hook(unit.pre_forward), prepend=True, with_kwargs=True)
    module.register_forward_hook(as_hook(unit.post_forward), prepend=False)
    for m in module.modules():  # inner units now belong to this subtree's context (built at the first forward)
        inner = m._mfsdp_unit if isinstance(m, FsdpModule) else None
        if inner is not None and inner is not unit:
            inner.context = None
            inner.parent = weakref.ref(unit)  # bottom-up: the last to set it is the outermost unit


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """FSDP2's ``register_fsdp_forward_method``: calls to ``module.<method_name>`` (e.g. ``generate`` or a scoring
    method that uses the module's own parameters outside ``forward``) run between the unit's forward hooks, so
    its weights are gathered for the call and gradients flow back as through ``forward``. A ``forward`` the
    method calls inside finds the unit gathered and leaves it so until the method returns; the units inside
    gather and reshard as in any forward.

    Args:
        module: a ``fully_shard``ed module.
        method_name: the name of one of its methods.

    Raises:
        ValueError: ``module`` is not sharded, or has no such method.
    """
    if not isinstance(module, FsdpModule):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} is not fully_shard'ed; call "
                         "mfsdp_ext.fully_shard(module) first")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method '{method_name}'")
    unit = module._mfsdp_unit
    enter, leave = eager_hook(unit.enter_forward_method), eager_hook(unit.exit_forward_method)

    @functools.wraps(method)
    def run_as_forward(*args, **kwargs):
        args, kwargs = enter(module, args, kwargs)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            unit.forward_method_depth -= 1
            raise
        return leave(module, args, output)

    setattr(module, method_name, run_as_forward)


def share_comm_ctx(modules: list) -> None:
    """FSDP2's ``share_comm_ctx``: the roots ``modules`` (e.g. the stages a pipeline rank holds) share one all-gather
    stream and one reduce-scatter stream, so memory freed in one's stream order is reused by the others without
    cross-stream fragmentation.

    Args:
        modules: ``fully_shard``ed modules (the roots of their trees).

    Raises:
        ValueError: a module is not sharded by mfsdp_ext.
    """
    if not modules:
        return
    for m in modules:
        if not isinstance(m, FsdpModule):
            raise ValueError(f"share_comm_ctx: expects fully_shard'ed modules, got {type(m).__name__}")
    units = [m._mfsdp_unit for m in modules]
    shared = SharedStreams()
    for unit in units:
        unit.shared_streams = shared
    made = [u.context for u in units if u.context is not None and u.is_root]
    if made:  # contexts made already: they take the first one's streams from now on
        shared.streams = (made[0].ag_stream, made[0].rs_stream)
        for ctx in made[1:]:
            ctx.ag_stream, ctx.rs_stream = shared.streams


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
    """Mark the forward/backward inside as one microbatch of a gradient-accumulation step. Previous flags are
    restored on exit, also on exceptions.

    Args:
        module: a sharded root, or a module holding sharded roots.
        is_first: False skips the main->model weight cast (weights only change at the optimizer step).
        is_last: False lets strategies that defer a reduction (no_shard, optim, HSDP) accumulate locally.

    Raises:
        ValueError: no ``fully_shard`` module under ``module``.
    """
    contexts = []
    for unit in _roots(module):
        ctx = unit.lazy_init()
        if ctx not in contexts:
            contexts.append(ctx)
    if not contexts:
        raise ValueError(f"microbatch: no fully_shard module found under {type(module).__name__}")
    saved = [(c.microbatch.is_first, c.microbatch.is_last, c.microbatch.explicit) for c in contexts]
    try:
        for c in contexts:
            c.microbatch.is_first, c.microbatch.is_last, c.microbatch.explicit = is_first, is_last, True
        yield
    finally:
        for c, (first, last, explicit) in zip(contexts, saved):
            c.microbatch.is_first, c.microbatch.is_last, c.microbatch.explicit = first, last, explicit


# ---------------------------------------------------------------------------------------------- meta init
@torch.no_grad()
def reset_parameters(module: nn.Module, init_fn: Optional[Callable[[nn.Module], None]] = None) -> None:
    """Initialise sharded parameters so every rank's shard is a slice of one consistent full tensor.

    Walks ``module.modules()`` in order (the order a single process initialises them in its constructor) and
    for each module with parameters of its own runs ``init_fn(m)`` on full-size temporaries of just that module's
    parameters, then keeps this rank's rows. Every rank draws the same random numbers, and no rank holds more than
    one module's full parameters at a time.

    Args:
        module: the sharded model (after ``to_empty(device=...)`` for a meta-built one).
        init_fn: ``init_fn(m)`` initialises module ``m``'s own parameters; default ``m.reset_parameters()``.

    Raises:
        ValueError: a module with parameters has no ``reset_parameters()`` and no ``init_fn`` was given.
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
            (init_fn or type(m).reset_parameters)(m)  # type: ignore[attr-defined]
        finally:
            for n, p in direct:
                g, i = owners[id(p)]
                g.main_weight.param_view(i).copy_(rows.local_of_full(g, i, temps[n]))
                m._parameters[n] = p
