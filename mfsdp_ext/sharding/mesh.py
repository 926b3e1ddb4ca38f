"""The mesh a unit is sharded over, and its process groups: the default 1-D mesh, a 2-D HSDP mesh
(replicate, shard), no_shard's replicate-only group."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..core import registry
from ..core.states import Strategy


def resolve_mesh(mesh: Optional[DeviceMesh], strategy: Strategy
                 ) -> tuple[DeviceMesh, torch.device, Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """(mesh, device, shard group, replicate group) for the strategy: 1-D shard, 2-D (replicate, shard) HSDP,
    or no_shard's replicate-only group."""
    mesh = mesh if mesh is not None else _default_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: a 1-D mesh (shard) or a 2-D "
                         "mesh (replicate, shard)")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:  # FSDP2's refusal (an AssertionError there too)
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified, e.g. "
                             "init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))")
    if mesh.ndim == 2 and strategy is Strategy.NO_SHARD:
        raise ValueError("no_shard takes a 1-D mesh (the data-parallel group)")
    if mesh.ndim == 2:
        return mesh, _mesh_device(mesh), mesh.get_group(1), mesh.get_group(0)
    if strategy is Strategy.NO_SHARD:
        return mesh, _mesh_device(mesh), None, mesh.get_group(0)
    return mesh, _mesh_device(mesh), mesh.get_group(0), None


def default_device_type() -> str:
    """The device of fully_shard's default mesh, as FSDP2 chooses it: the accelerator when there is one, whatever the
    process group's backend (gloo, a threaded group, "cuda:nccl,cpu:gloo"), else the CPU."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


def _default_mesh() -> DeviceMesh:
    device_type = default_device_type()
    return registry.per_default_group(registry.DEFAULT_MESHES, device_type,
                                      lambda: init_device_mesh(device_type, (dist.get_world_size(),)))


def whole_mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup:
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
