"""A unit's parameters grouped into flat-buffer groups: one ParamGroup per (mesh, dtype, requires_grad, no_shard mark,
FP8, used after the inner units). No collective: ranks that disagree are found at lazy init (runtime/same_model.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm import dist_ops
from ..core import placements, registry
from ..core.mixed_precision import MixedPrecisionPolicy
from ..core.states import Strategy
from ..params import replaced
from ..params.fp8_group import Fp8ParamGroup
from ..params.group import GroupMesh, ParamGroup
from ..params.offload import HostOffload, host_offload
from ..runtime.module import FsdpModule
from .fp8_weights import choose_fp8_weights
from .marks import is_marked
from .mesh import resolve_mesh, whole_mesh_group


def make_groups(modules: list[nn.Module], params, mesh: DeviceMesh, device: torch.device,
                mp_policy: MixedPrecisionPolicy, strategy: Strategy, placed: dict[int, tuple] | None = None,
                spmd_of: dict[int, placements.SpmdDims] | None = None, offload_policy=None) -> list[ParamGroup]:
    """One ParamGroup per (mesh, dtype, requires_grad, marked no_shard, FP8) of the parameters, which become the
    groups' DTensor shards (a marked group: replicated over the mesh, as the no_shard strategy holds everything; an
    FP8 group: Fp8ParamGroup, the weights of the linear layers ``mp_policy.fp8`` chooses). ``placed``: id(parameter)
    -> (dim, mesh) where shard_placement_fn moved it off (0, ``mesh``); ``spmd_of``: id(mesh) -> its full SPMD mesh
    (dp_mesh_dims); ``offload_policy``: FSDP2's CPUOffloadPolicy, or None (params/offload.py).

    Raises:
        ValueError: FP8 weights with offload, or on a dim other than 0.
    """
    placed, spmd_of = placed or {}, spmd_of or {}
    offload = host_offload(offload_policy, device, fp8=mp_policy.fp8 is not None)
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
                                      spmd_of.get(id(own)), offload)
    owner = "+".join(type(m).__name__ for m in modules)
    for fqn, p, _ in params:
        registry.UNIT_OF_PARAM[p] = owner  # the original Parameter: a use of it outside this unit is caught later
        replaced.note_replaced(p, f"'{fqn}' of a {owner}", "before fully_shard")
    for g in groups:
        for info in g.infos:
            registry.UNIT_OF_PARAM[info.sharded] = owner
        g.use_sharded_params()
    return groups


def reduces_early(device: torch.device) -> bool:
    """Whether a unit's parameters used after its inner units get a group reduced as soon as their gradients are
    ready: only where that overlaps the rest of the backward (CUDA streams). On the CPU every collective waits
    anyway, and one reduce-scatter per unit (FSDP2's count) costs less."""
    return device.type == "cuda"


def _groups_on_mesh(modules, params, mesh: DeviceMesh, device: torch.device, mp_policy: MixedPrecisionPolicy,
                    strategy: Strategy, fp8: set[int], dims: dict[int, int],
                    spmd: placements.SpmdDims | None = None, offload: HostOffload | None = None) -> list[ParamGroup]:
    mesh, mesh_device, shard_group, replicate_group = resolve_mesh(mesh, strategy)
    if mesh_device != device:
        raise ValueError(f"fully_shard: shard_placement_fn gives a mesh on {mesh_device}, the module's mesh is on "
                         f"{device}; every mesh of one module is on one device type")
    late = set().union(*(_used_after_inner_units(m, params) for m in modules)) if reduces_early(device) else set()
    groups: list[ParamGroup] = []
    kinds = _group_by_kind(params, fp8, late)
    narrow_wins = (any(mp_policy.sends_narrow_by_default(dtype) for dtype, *_ in kinds)
                   and _narrow_wire_wins(shard_group, device))
    for (dtype, _, marked, is_fp8, is_late), members in kinds.items():
        replicated = marked and shard_group is not None
        dtypes = mp_policy.group_dtypes(dtype, narrow_wins and not replicated)
        group_mesh = (GroupMesh(mesh, None, whole_mesh_group(mesh)) if replicated else
                      GroupMesh(mesh, shard_group, replicate_group))
        kwargs = dict(mesh=group_mesh, dtypes=dtypes, device=device, dims=dims, spmd=spmd, reduce_when_ready=is_late)
        # a copy of the model weight (bf16 or FP8 shard) saves a cast per gather: none where weights stay gathered
        cache = False if strategy.keeps_weights_gathered or marked else mp_policy.cache_model_weight
        if is_fp8:
            groups.append(Fp8ParamGroup(members, fp8_compute=mp_policy.fp8.compute, keep_fp8_shard=cache, **kwargs))
        else:
            groups.append(ParamGroup(members, **kwargs, cache_model_weight=cache,
                                     offload=offload.for_group() if offload is not None else None))
    return groups


def _narrow_wire_wins(shard_group, device: torch.device) -> bool:
    """Where MixedPrecisionPolicy(reduce_comm_dtype=None) sends bf16 gradients as they are (an all-to-all, summed in
    float32 on arrival) instead of a float32 reduce-scatter: NCCL shard groups of several ranks on one host, where
    it was measured to win. Collective (host names) only where torchrun does not say the world is one node."""
    return (shard_group is not None and device.type == "cuda" and dist.get_world_size(shard_group) > 1
            and "nccl" in str(dist.get_backend(shard_group)) and dist_ops.on_one_host(shard_group))


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


