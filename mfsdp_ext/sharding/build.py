"""What fully_shard does before it builds a unit: resolve the mesh, find the parameters it owns, check them,
and group them into flat-buffer groups. No collective: ranks that disagree are found at lazy init (same_model.py)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ..comm import dist_ops
from ..core import placements, registry
from ..params import replaced
from ..params.fp8_group import Fp8ParamGroup
from ..fp8.linear import Fp8LinearConfig, Fp8LinearMixin, _fp8_class
from .marks import is_marked
from ..core.mixed_precision import GroupDtypes, MixedPrecisionPolicy
from ..runtime.module import FsdpModule
from ..core.states import Strategy
from ..params.group import GroupMesh, ParamGroup, ParamPlace

try:
    from torch.distributed.fsdp import FSDPModule as _FSDP2Module
except ImportError:  # a torch without FSDP2
    _FSDP2Module = None



def resolve_mesh(mesh: Optional[DeviceMesh], strategy: Strategy) -> tuple[DeviceMesh, torch.device, Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """(mesh, device, shard group, replicate group) for the strategy: 1-D shard, 2-D (replicate, shard) HSDP,
    or no_shard's replicate-only group."""
    mesh = mesh if mesh is not None else _default_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard supports a 1-D mesh (shard) or a 2-D mesh (replicate, shard); got {mesh.ndim}-D")
    if mesh.ndim == 2 and strategy is Strategy.NO_SHARD:
        raise ValueError("no_shard takes a 1-D mesh (the data-parallel group)")
    if mesh.ndim == 2:
        return mesh, _mesh_device(mesh), mesh.get_group(1), mesh.get_group(0)
    if strategy is Strategy.NO_SHARD:
        return mesh, _mesh_device(mesh), None, mesh.get_group(0)
    return mesh, _mesh_device(mesh), mesh.get_group(0), None


def make_groups(modules: list[nn.Module], params, mesh: DeviceMesh, device: torch.device,
                mp_policy: MixedPrecisionPolicy, strategy: Strategy, placed: dict[int, tuple] | None = None,
                spmd_of: dict[int, placements.SpmdDims] | None = None) -> list[ParamGroup]:
    """One ParamGroup per (mesh, dtype, requires_grad, marked no_shard, FP8) of the parameters, which become the
    groups' DTensor shards (a marked group: replicated over the mesh, as the no_shard strategy holds everything; an
    FP8 group: Fp8ParamGroup, the weights of the linear layers ``mp_policy.fp8`` chooses). ``placed``: id(parameter)
    -> (dim, mesh) where shard_placement_fn moved it off (0, ``mesh``); ``spmd_of``: id(mesh) -> its full SPMD mesh
    (dp_mesh_dims)."""
    placed, spmd_of = placed or {}, spmd_of or {}
    fp8 = choose_fp8_weights(modules, params, mp_policy, strategy)
    off_dim0 = [fqn for fqn, p, _ in params if id(p) in fp8 and placed.get(id(p), (0,))[0]]
    if off_dim0:
        raise ValueError(f"fully_shard: '{off_dim0[0]}' would hold FP8 weights sharded on a dim other than 0; FP8 "
                         "weights are sharded on dim 0: leave the layer out (Fp8Policy(modules=...)) or shard it on "
                         "dim 0")
    dims = {key: dim for key, (dim, _) in placed.items() if dim}
    by_mesh: dict[int, tuple[DeviceMesh, list]] = {id(mesh): (mesh, [])}
    for item in params:
        own = placed.get(id(item[1]), (0, mesh))[1]
        by_mesh.setdefault(id(own), (own, []))[1].append(item)
    groups = []
    for own, members in by_mesh.values():
        if members:
            groups += _groups_on_mesh(modules, members, own, device, mp_policy, strategy, fp8, dims,
                                      spmd_of.get(id(own)))
    owner = "+".join(type(m).__name__ for m in modules)
    for fqn, p, _ in params:
        registry.UNIT_OF_PARAM[p] = owner  # the original Parameter: a use of it outside this unit is caught later
        replaced.note_replaced(p, f"'{fqn}' of a {owner}", "before fully_shard")
    for g in groups:
        for info in g.infos:
            registry.UNIT_OF_PARAM[info.sharded] = owner
        g.use_sharded_params()
    return groups


def _groups_on_mesh(modules, params, mesh: DeviceMesh, device: torch.device, mp_policy: MixedPrecisionPolicy,
                    strategy: Strategy, fp8: set[int], dims: dict[int, int],
                    spmd: placements.SpmdDims | None = None) -> list[ParamGroup]:
    mesh, mesh_device, shard_group, replicate_group = resolve_mesh(mesh, strategy)
    if mesh_device != device:
        raise ValueError(f"fully_shard: shard_placement_fn gives a mesh on {mesh_device}, the module's mesh is on "
                         f"{device}; every mesh of one module is on one device type")
    late = set().union(*(_used_after_inner_units(m, params) for m in modules))
    groups = []
    kinds = _group_by_kind(params, fp8, late)
    narrow_wins = (any(mp_policy.sends_narrow_by_default(dtype) for dtype, *_ in kinds)
                   and _narrow_wire_wins(shard_group, device))
    for (dtype, requires_grad, marked, is_fp8, is_late), members in kinds.items():
        replicated = marked and shard_group is not None
        dtypes = GroupDtypes(compute=mp_policy.compute_dtype(dtype), reduce=mp_policy.reduction_dtype(dtype),
                             reduce_comm=mp_policy.reduction_comm_dtype(dtype, narrow_wins and not replicated),
                             main_grad=mp_policy.main_grad_dtype if dtype == torch.float32 else dtype)
        group_mesh = (GroupMesh(mesh, None, _whole_mesh_group(mesh)) if replicated else
                      GroupMesh(mesh, shard_group, replicate_group))
        kwargs = dict(mesh=group_mesh, dtypes=dtypes, device=device, dims=dims, spmd=spmd, reduce_when_ready=is_late)
        # a copy of the model weight (bf16 or FP8 shard) saves a cast per gather: none where weights stay gathered
        cache = False if strategy.keeps_weights_gathered or marked else mp_policy.cache_model_weight
        if is_fp8:
            groups.append(Fp8ParamGroup(members, fp8_compute=mp_policy.fp8.compute, keep_fp8_shard=cache, **kwargs))
        else:
            groups.append(ParamGroup(members, **kwargs, cache_model_weight=cache))
    return groups


def _narrow_wire_wins(shard_group, device: torch.device) -> bool:
    """Where MixedPrecisionPolicy(reduce_comm_dtype=None) sends bf16 gradients as they are (an all-to-all, summed in
    float32 on arrival) instead of a float32 reduce-scatter: NCCL shard groups of several ranks on one host, where
    it was measured to win. Collective (host names) only where torchrun does not say the world is one node."""
    return (shard_group is not None and device.type == "cuda" and dist.get_world_size(shard_group) > 1
            and "nccl" in str(dist.get_backend(shard_group)) and dist_ops.on_one_host(shard_group))


def _default_mesh() -> DeviceMesh:
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device_type not in registry.DEFAULT_MESHES:
        registry.DEFAULT_MESHES[device_type] = init_device_mesh(device_type, (dist.get_world_size(),))
    return registry.DEFAULT_MESHES[device_type]


def _whole_mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of every rank in the mesh, over which a no_shard-marked group all-reduces: the mesh's
    own group (1-D), the default group when a 2-D (HSDP) mesh covers the world, else the mesh flattened."""
    if mesh.ndim == 1:
        return mesh.get_group(0)
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return mesh._flatten().get_group()


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    raise ValueError(f"fully_shard supports cpu and cuda meshes, got {mesh.device_type}")


def owned_params(modules: list[nn.Module], ignored=frozenset()) -> list[tuple[str, nn.Parameter, list[ParamPlace]]]:
    """Unique parameters of the subtrees of ``modules`` (one module, or FSDP2's list) not owned by an inner unit,
    with every place they appear (a weight tied between two of the modules has a place in each); the ``ignored``
    ones (FSDP2's ignored_params) are left as they are, unchecked."""
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
    owner = registry.UNIT_OF_PARAM.get(p)
    if owner is not None:
        raise ValueError(
            f"fully_shard: parameter '{fqn}' is shared with a module of an inner fully_shard unit "
            f"({owner}); tied parameters must belong to one unit: shard the module that "
            "contains every use of it, not the inner one")
    if p.dim() == 0:
        raise ValueError(f"fully_shard: parameter '{fqn}' is a 0-d scalar; rows cannot be sharded. "
                         "Store it with shape (1,) instead")
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
    return _FSDP2Module is not None and isinstance(m, _FSDP2Module) and not isinstance(m, FsdpModule)


def move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    """Buffers (e.g. rotary tables) of the unit's own modules follow the parameters to the mesh device."""
    stack = list(modules)
    while stack:
        m = stack.pop()
        for name, b in m._buffers.items():
            if b is not None and b.device.type != "meta" and b.device != device:
                m._buffers[name] = b.to(device)
        stack.extend(c for c in m.children() if not isinstance(c, FsdpModule))


def _group_by_kind(params, fp8: set[int], late: set[int]):
    kinds: dict[tuple[torch.dtype, bool, bool, bool, bool], list] = {}
    for item in params:
        p = item[1]
        marked = is_marked(p)
        is_late = id(p) in late and p.requires_grad and not marked  # only trainable sharded ones are reduced early
        kinds.setdefault((p.dtype, p.requires_grad, marked, id(p) in fp8, is_late), []).append(item)
    return kinds


def _used_after_inner_units(module: nn.Module, params) -> set[int]:
    """ids of the unit's parameters whose module comes after its last inner unit (in module order): computed after
    every inner unit in forward, their gradients are ready first in backward (a language model's final norm and
    head). They form groups of their own, reduced as soon as their gradients are (ParamGroup.reduce_when_ready),
    under the backward of the inner units rather than after it."""
    inner_units = [m for m in module.modules() if m is not module and isinstance(m, FsdpModule)]
    if not inner_units:
        return set()
    order = {id(m): i for i, m in enumerate(module.modules())}
    last_inner_end = max(order[id(m)] for unit in inner_units for m in unit.modules())
    return {id(p) for _, p, places in params if order.get(id(places[0].module), -1) > last_inner_end}


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


def own_modules(module: nn.Module):
    """(fqn, module) of ``module``'s subtree, not entering inner units, in named_modules() order."""
    stack = [("", module)]
    while stack:
        fqn, m = stack.pop()
        yield fqn, m
        children = [(f"{fqn}.{n}" if fqn else n, c) for n, c in m._modules.items()
                    if c is not None and not isinstance(c, FsdpModule)]
        stack.extend(reversed(children))


def choose_fp8_weights(modules: list[nn.Module], params, mp_policy: MixedPrecisionPolicy, strategy) -> set[int]:
    """ids of the parameters that become FP8 weights (``mp_policy.fp8``); with compute=True their layers become
    Fp8Linear subclasses (class swap, as to_fp8_linear: parameters and state dict unchanged)."""
    policy = mp_policy.fp8
    if policy is None:
        return set()
    if strategy is Strategy.NO_SHARD:
        raise ValueError("MixedPrecisionPolicy(fp8=...) with sharding_strategy='no_shard': FP8 weights save the "
                         "all-gather's bytes, and no_shard gathers nothing; use a sharded strategy or no fp8")
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
