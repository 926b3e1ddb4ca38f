"""FSDP2's full-SPMD form: ``fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``.

The mesh holds every parallel dimension (torchtitan's full_dtensor backend: ("dp_replicate", "dp_shard", "cp",
"tp")), the parameters are DTensors on it, and ``dp_mesh_dims`` names the dims data parallelism shards over and
replicates over. fully_shard communicates over those dims only, as FSDP2 does: one shard dim, or several flattened
into one (a new 1-D mesh), and HSDP's replicate dim(s) before it. No shard dim is FSDP2's DDP form: every
parameter replicated (mfsdp_ext's no_shard).
"""

from __future__ import annotations

from typing import Optional

from torch.distributed.device_mesh import DeviceMesh

from ..core.placements import SpmdDims


def resolve(mesh: DeviceMesh, dp_mesh_dims, dp_mesh: Optional[DeviceMesh] = None) -> SpmdDims:
    """The data-parallel dims of ``mesh`` that ``dp_mesh_dims`` names, and the mesh to communicate over (``dp_mesh``
    where FSDP2 made it already: a ShardPlacementResult's mesh info)."""
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None:
        raise ValueError("fully_shard(dp_mesh_dims=...): the mesh has no dim names; build it with "
                         "init_device_mesh(..., mesh_dim_names=(...))")
    shard, replicate = _names(dp_mesh_dims.shard), _names(dp_mesh_dims.replicate)
    if not shard and not replicate:
        raise ValueError("fully_shard(dp_mesh_dims=...): name a shard dim, a replicate dim or both")
    unknown = [n for n in shard + replicate if n not in names]
    if unknown:
        raise ValueError(f"fully_shard(dp_mesh_dims=...): the mesh has no dim '{unknown[0]}' (its dims: {names})")
    shard_dims = tuple(names.index(n) for n in shard)
    if shard_dims and shard_dims != tuple(range(shard_dims[0], shard_dims[0] + len(shard_dims))):
        raise ValueError(f"fully_shard(dp_mesh_dims=...): the shard dims {shard} must be neighbours in the mesh "
                         f"{names}, in its order (they are flattened into one)")
    if dp_mesh is None:
        dp_mesh = _data_parallel_mesh(mesh, shard, replicate)
    return SpmdDims(mesh, shard_dims, tuple(names.index(n) for n in replicate), dp_mesh)


def _names(field) -> tuple[str, ...]:
    if field is None:
        return ()
    return (field,) if isinstance(field, str) else tuple(field)


def _data_parallel_mesh(mesh: DeviceMesh, shard: tuple[str, ...], replicate: tuple[str, ...]) -> DeviceMesh:
    def submesh(names: tuple[str, ...]) -> DeviceMesh:
        return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))

    if not shard:
        return submesh(replicate)
    if not replicate:
        return submesh(shard)
    return DeviceMesh._concatenate([submesh(replicate), submesh(shard)])
