"""FSDP2's ``shard_placement_fn`` and ``dp_mesh_dims``: where each parameter is sharded (dim and mesh), and the
data-parallel mesh of a full SPMD mesh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..core.placements import SpmdDims
from ..core.states import Strategy
from . import spmd_mesh


def full_mesh(mesh: Optional[DeviceMesh], dp_mesh_dims, strategy: Strategy
               ) -> tuple[Optional[DeviceMesh], Strategy, dict[int, SpmdDims]]:
    """``mesh`` and the strategy as the rest of fully_shard takes them: with FSDP2's ``dp_mesh_dims``, the
    data-parallel mesh out of the full one (no shard dim: FSDP2's DDP form, every parameter replicated), and
    id(that mesh) -> its SpmdDims."""
    if dp_mesh_dims is None:
        return mesh, strategy, {}
    if not hasattr(dp_mesh_dims, "shard") or not hasattr(dp_mesh_dims, "replicate"):
        raise TypeError(f"fully_shard: dp_mesh_dims must be torch's DataParallelMeshDims, got {dp_mesh_dims!r:.80}")
    if mesh is None:
        raise ValueError("fully_shard(dp_mesh_dims=...): pass the full mesh the parameters are DTensors on as mesh=")
    spmd = spmd_mesh.resolve(mesh, dp_mesh_dims)
    return spmd.dp_mesh, strategy if spmd.shard_dims else Strategy.NO_SHARD, {id(spmd.dp_mesh): spmd}


def shard_placements(shard_placement_fn: Optional[Callable], params, mesh: DeviceMesh,
                      spmd_of: dict[int, SpmdDims]) -> dict[int, tuple]:
    """FSDP2's shard_placement_fn, per parameter: None or Shard(0) (torch.chunk's rows), Shard(d) for another dim
    (an even split, as FSDP2 requires), or FSDP2's ShardPlacementResult (a Shard on a mesh of its own: torchtitan's
    experts on the expert-data-parallel mesh; a full SPMD mesh's is added to ``spmd_of``). Returns id(parameter)
    -> (dim, mesh) where either differs from (0, ``mesh``)."""
    if shard_placement_fn is None:
        return {}
    out = {}
    for fqn, p, _ in params:
        placement, own_mesh = placement_and_mesh(fqn, shard_placement_fn(p), mesh, spmd_of)
        if placement is not None and not -p.dim() <= placement.dim < p.dim():  # FSDP2's refusal and its type
            raise AssertionError(f"Shard dim {placement.dim} is invalid for {p.dim()}D tensor: {tuple(p.shape)} "
                                 f"('{fqn}': shard_placement_fn placed it so)")
        dim = placement.dim % p.dim() if placement is not None else 0
        world = own_mesh.size(own_mesh.ndim - 1)  # the shard dim: 1-D, or HSDP's (replicate, shard)
        size = (p._local_tensor if isinstance(p, DTensor) else p).shape[dim]
        if dim and size % world:
            raise ValueError(f"fully_shard: shard_placement_fn places '{fqn}' as Shard({dim}), whose size {size} "
                             f"does not divide by the {world} ranks of the mesh (sharding a dim other than 0 needs "
                             "an even split, as in FSDP2)")
        if dim or own_mesh is not mesh:
            out[id(p)] = (dim, own_mesh)
    return out


def placement_and_mesh(fqn: str, answer, mesh: DeviceMesh, spmd_of: dict[int, SpmdDims]
                        ) -> tuple[Optional[Shard], DeviceMesh]:
    if answer is None or type(answer) is Shard:
        return answer, mesh
    info = getattr(answer, "mesh_info", None)  # FSDP2's ShardPlacementResult(placement, mesh_info)
    if info is not None and hasattr(answer, "placement") and (answer.placement is None or
                                                              type(answer.placement) is Shard):
        own = info.mesh
        if getattr(info, "is_spmd_mesh", False) and id(own) not in spmd_of:
            spmd_of[id(own)] = spmd_mesh.resolve(info.spmd_mesh, info.dp_mesh_dims, dp_mesh=own)
        if own.ndim != (1 if getattr(info, "replicate_mesh_dim", None) is None else 2) or \
                info.shard_mesh_dim != own.ndim - 1:
            raise ValueError(f"fully_shard: shard_placement_fn places '{fqn}' on a mesh whose shard dim is "
                             f"{info.shard_mesh_dim} of {own.ndim}; mfsdp_ext takes a 1-D mesh or a 2-D (replicate, "
                             "shard) mesh")
        return answer.placement, own
    raise ValueError(f"fully_shard: shard_placement_fn places '{fqn}' as {answer!r}; mfsdp_ext takes None, "
                     "Shard(dim) or FSDP2's ShardPlacementResult(Shard(dim) or None, mesh_info)")
