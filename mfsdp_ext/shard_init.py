"""What fully_shard does before it builds a unit: resolve the mesh, find the parameters it owns, check them,
and group them into flat-buffer groups. No collective: ranks that disagree are found at lazy init (same_model.py)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from .marks import is_marked
from .mixed_precision import MixedPrecisionPolicy
from .module import FsdpModule, Strategy
from .param_group import ParamGroup, ParamPlace

try:
    from torch.distributed.fsdp import FSDPModule as _FSDP2Module
except ImportError:  # a torch without FSDP2
    _FSDP2Module = None

_DEFAULT_MESH: dict[str, DeviceMesh] = {}
# Parameters fully_shard has taken (the user's originals and our DTensor shards) -> the owning module's class
# name: a later fully_shard that meets one outside its owner reports the tie instead of sharding it twice.
_OWNER_NAMES = WeakIdKeyDictionary()


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


def make_groups(module: nn.Module, params, mesh: DeviceMesh, device: torch.device, shard_group, replicate_group,
                mp_policy: MixedPrecisionPolicy, strategy: Strategy) -> list[ParamGroup]:
    """One ParamGroup per (dtype, requires_grad, marked no_shard) of the parameters, which become the groups'
    DTensor shards (a marked group: replicated over the mesh, as the no_shard strategy holds everything)."""
    groups = []
    for (dtype, requires_grad, marked), members in _group_by_kind(params).items():
        replicated = marked and shard_group is not None
        if replicated and mesh.ndim != 1:
            raise ValueError(f"no_shard-marked parameters ({members[0][0]}, ...) on a 2-D (HSDP) mesh are not "
                             "supported yet; leave them unmarked there")
        groups.append(ParamGroup(
            members, mesh, compute_dtype=mp_policy.compute_dtype(dtype),
            reduce_dtype=mp_policy.reduction_dtype(dtype), main_grad_dtype=mp_policy.main_grad_dtype
            if dtype == torch.float32 else dtype, device=device,
            shard_group=None if replicated else shard_group,
            replicate_group=mesh.get_group(0) if replicated else replicate_group,
            cache_model_weight=False if strategy.keeps_weights_gathered or marked else mp_policy.cache_model_weight))
    owner = type(module).__name__
    for _, p, _ in params:
        _OWNER_NAMES[p] = owner  # the original Parameter: a use of it outside this unit is caught later
    for g in groups:
        for info in g.infos:
            _OWNER_NAMES[info.sharded] = owner
        g.use_sharded_params()
    return groups


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


def owned_params(module: nn.Module) -> list[tuple[str, nn.Parameter, list[ParamPlace]]]:
    """Unique parameters of ``module``'s subtree not owned by an inner unit, with every place they appear."""
    found: dict[int, tuple[str, nn.Parameter, list[ParamPlace]]] = {}
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop(0)
        if _is_fsdp2_module(m):
            raise ValueError(f"fully_shard: '{prefix[:-1] or type(m).__name__}' was sharded by PyTorch FSDP2's "
                             "fully_shard; one model takes one of the two: apply mfsdp_ext.fully_shard to every unit")
        for name, p in m._parameters.items():
            if p is None:
                continue
            fqn = f"{prefix}{name}"
            _check_param(fqn, p, m)
            if id(p) in found:
                found[id(p)][2].append(ParamPlace(m, name, fqn))
            else:
                found[id(p)] = (fqn, p, [ParamPlace(m, name, fqn)])
        for child_name, child in m._modules.items():
            if child is not None and not isinstance(child, FsdpModule):
                stack.append((f"{prefix}{child_name}.", child))
    return list(found.values())


def _check_param(fqn: str, p: nn.Parameter, holder: nn.Module) -> None:
    owner = _OWNER_NAMES.get(p)
    if owner is not None:
        raise ValueError(
            f"fully_shard: parameter '{fqn}' is shared with a module of an inner fully_shard unit "
            f"({owner}); tied parameters must belong to one unit: shard the module that "
            "contains every use of it, not the inner one")
    if isinstance(p, DTensor):
        raise ValueError(f"fully_shard: parameter '{fqn}' is already a DTensor (sharded by another API)")
    if p.dim() == 0:
        raise ValueError(f"fully_shard: parameter '{fqn}' is a 0-d scalar; rows cannot be sharded. "
                         "Store it with shape (1,) instead")
    if not p.is_floating_point():
        raise ValueError(f"fully_shard: parameter '{fqn}' has non-floating dtype {p.dtype}; only floating "
                         "parameters can be sharded (make it a buffer)")
    if getattr(holder, "sparse", False) and isinstance(holder, (nn.Embedding, nn.EmbeddingBag)):
        raise ValueError(f"fully_shard: parameter '{fqn}' belongs to an embedding with sparse=True; sparse "
                         "gradients cannot be reduce-scattered into flat shards: build it with sparse=False")


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
    return _FSDP2Module is not None and isinstance(m, _FSDP2Module)


def move_buffers(module: nn.Module, device: torch.device) -> None:
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
        kinds.setdefault((p.dtype, p.requires_grad, is_marked(p)), []).append(item)
    return kinds
