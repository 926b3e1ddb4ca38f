"""How a sharded parameter is labelled: the DTensor spec of its shard, exactly as FSDP2 labels it.

A plain parameter is split over the data-parallel mesh by torch.chunk's rows: ``(Shard(0),)``, HSDP's
``(Replicate(), Shard(0))``, or all ``Replicate()`` for a replicated (no_shard) group. A parameter that is already
a DTensor on a tensor-parallel mesh (``parallelize_module`` before ``fully_shard``) is sharded the same way on its
local tensor, and its label spans both meshes: the data-parallel placements, then its own. Where tensor parallelism
also split dim 0 (a colwise layer), the data-parallel split of that dim is strided, ``_StridedShard(0, sf)``: each
tensor-parallel shard's rows are split again. The module then computes with the tensor-parallel DTensor, gathered
over the data-parallel mesh only.

FSDP2's full-SPMD form (``dp_mesh_dims``): the parameters are DTensors on one mesh that holds every dimension,
``Replicate()`` on its data-parallel dims (SpmdDims). The label stays on that mesh: the data-parallel shard dim
becomes ``Shard(d)`` (strided where a mesh dim to its right splits the same tensor dim), several shard dims are
flattened into one; the module computes with the parameter's own DTensor, Replicate() on those dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from .layout import contiguous_stride


@dataclass(frozen=True)
class SpmdDims:
    """Where data parallelism lies in a full SPMD mesh (FSDP2's ``DataParallelMeshDims``): the indices of the dims
    sharded over and replicated over, and ``dp_mesh``, the mesh fully_shard communicates over (1-D, several
    shard dims flattened, or HSDP's (replicate, shard))."""

    mesh: DeviceMesh
    shard_dims: tuple[int, ...]
    replicate_dims: tuple[int, ...]
    dp_mesh: DeviceMesh

    @property
    def all_dims(self) -> frozenset[int]:
        return frozenset(self.shard_dims + self.replicate_dims)


def data_parallel_placements(mesh_ndim: int, replicated: bool, dim: int = 0) -> tuple:
    """The placements over the data-parallel mesh: 1-D shard, HSDP (replicate, shard), or replicated."""
    if replicated:
        return (Replicate(),) * mesh_ndim
    return (Replicate(), Shard(dim)) if mesh_ndim == 2 else (Shard(dim),)


def sharded_spec(dp_mesh: DeviceMesh, replicated: bool, tp_spec: Optional[DTensorSpec], shape: torch.Size,
                 dtype: torch.dtype, dim: int = 0, spmd: Optional[SpmdDims] = None) -> DTensorSpec:
    """The spec of a shard of a parameter of global ``shape`` split on ``dim`` (``tp_spec``: its
    tensor-parallel spec, or None; with ``spmd``, its own spec on the full SPMD mesh)."""
    meta = TensorMeta(shape, contiguous_stride(shape), dtype)
    if spmd is not None:
        return _spmd_sharded_spec(spmd, replicated, tp_spec, meta, dim)
    dp = data_parallel_placements(dp_mesh.ndim, replicated, dim)
    if tp_spec is None:
        return DTensorSpec(dp_mesh, dp, tensor_meta=meta)
    split = tp_spec.num_shards_map[dim]
    if not replicated and split > 1:
        dp = (*dp[:-1], _StridedShard(dim, split_factor=split))
    return DTensorSpec(DeviceMesh._concatenate([dp_mesh, tp_spec.mesh]), (*dp, *tp_spec.placements),
                       tensor_meta=meta)


def _spmd_sharded_spec(spmd: SpmdDims, replicated: bool, own: DTensorSpec, meta: TensorMeta, dim: int
                       ) -> DTensorSpec:
    """FSDP2's label on a full SPMD mesh (see the module's docstring)."""
    mesh, out = spmd.mesh, list(own.placements)
    if replicated or not spmd.shard_dims:
        return DTensorSpec(mesh, tuple(out), tensor_meta=meta)
    first = spmd.shard_dims[0]
    split = 1
    for j in range(first + 1, mesh.ndim):
        placement = out[j]
        if isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim:
            split *= mesh.size(j)
    out[first] = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    if len(spmd.shard_dims) == 1:
        return DTensorSpec(mesh, tuple(out), tensor_meta=meta)
    # several shard dims (consecutive): the data-parallel mesh in their place, with HSDP's replicate dim before
    hsdp = spmd.dp_mesh.ndim == 2
    meshes, flat = [], []
    for i, name in enumerate(mesh.mesh_dim_names):
        if i == first:
            meshes.append(spmd.dp_mesh)
            flat += [Replicate(), out[i]] if hsdp else [out[i]]
        elif i not in spmd.shard_dims and not (hsdp and i in spmd.replicate_dims):
            meshes.append(mesh[name])
            flat.append(out[i])
    return DTensorSpec(DeviceMesh._concatenate(meshes), tuple(flat), tensor_meta=meta)


def spmd_problem(fqn: str, p, spmd: SpmdDims) -> Optional[str]:
    """Why ``fully_shard(..., dp_mesh_dims=...)`` cannot take parameter ``p`` (None when it can)."""
    if not isinstance(p, DTensor):
        return (f"fully_shard(dp_mesh_dims=...): parameter '{fqn}' is a plain tensor; with dp_mesh_dims every "
                f"parameter is a DTensor on the full mesh {spmd.mesh} (distribute_module, torchtitan's "
                "full_dtensor backend), or pass the data-parallel mesh as mesh= without dp_mesh_dims")
    if p.device_mesh != spmd.mesh:
        return (f"fully_shard(dp_mesh_dims=...): parameter '{fqn}' is a DTensor on {p.device_mesh}, not on the "
                f"mesh given to fully_shard ({spmd.mesh})")
    names = spmd.mesh.mesh_dim_names
    for i in sorted(spmd.all_dims):
        if not isinstance(p.placements[i], Replicate):
            return (f"fully_shard(dp_mesh_dims=...): parameter '{fqn}' is placed {p.placements[i]!r} on the "
                    f"data-parallel dim '{names[i]}'; it must be Replicate() there (fully_shard shards it)")
    for q in p.placements:
        if isinstance(q, (Partial, _StridedShard)):
            return f"fully_shard: parameter '{fqn}' is placed {p.placements}; a parameter is Shard(d) or Replicate()"
    return None


def with_dtype(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    """``spec`` for a tensor of another dtype (the unsharded parameter in the compute dtype)."""
    meta = spec.tensor_meta
    return DTensorSpec(spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, dtype))


def tensor_parallel_problem(fqn: str, p: DTensor, dp_mesh: DeviceMesh) -> Optional[str]:
    """Why ``fully_shard`` cannot take the DTensor parameter ``p`` over ``dp_mesh`` (None when it can)."""
    placements, mesh = p.placements, p.device_mesh
    if len(placements) > 1:
        return (f"fully_shard: parameter '{fqn}' is a DTensor on a {len(placements)}-D mesh; tensor parallelism "
                "over one mesh dimension is supported")
    if any(isinstance(q, (Partial, _StridedShard)) for q in placements):
        return f"fully_shard: parameter '{fqn}' is placed {placements}; a parameter is Shard(d) or Replicate()"
    dp_root, tp_root = _root(dp_mesh), _root(mesh)
    if dp_root is None or dp_root != tp_root or set(mesh.mesh_dim_names or ()) & set(dp_mesh.mesh_dim_names or ()):
        return (f"fully_shard: parameter '{fqn}' is a DTensor on {mesh}, which is not a sibling sub-mesh of the "
                f"data-parallel mesh {dp_mesh}: make both from one mesh (mesh['dp'], mesh['tp'])")
    return None


def _root(mesh: DeviceMesh):
    getter = getattr(mesh, "_get_root_mesh", None)
    return getter() if getter is not None else None
