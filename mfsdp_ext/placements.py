"""How a sharded parameter is labelled: the DTensor spec of its shard, exactly as FSDP2 labels it.

A plain parameter is split over the data-parallel mesh by torch.chunk's rows: ``(Shard(0),)``, HSDP's
``(Replicate(), Shard(0))``, or all ``Replicate()`` for a replicated (no_shard) group. A parameter that is already
a DTensor on a tensor-parallel mesh (``parallelize_module`` before ``fully_shard``) is sharded the same way on its
local tensor, and its label spans both meshes: the data-parallel placements, then its own. Where tensor parallelism
also split dim 0 (a colwise layer), the data-parallel split of that dim is strided, ``_StridedShard(0, sf)``: each
tensor-parallel shard's rows are split again. The module then computes with the tensor-parallel DTensor, gathered
over the data-parallel mesh only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from .layout import contiguous_stride


def data_parallel_placements(mesh_ndim: int, replicated: bool, dim: int = 0) -> tuple:
    """The placements over the data-parallel mesh: 1-D shard, HSDP (replicate, shard), or replicated."""
    if replicated:
        return (Replicate(),) * mesh_ndim
    return (Replicate(), Shard(dim)) if mesh_ndim == 2 else (Shard(dim),)


def sharded_spec(dp_mesh: DeviceMesh, replicated: bool, tp_spec: Optional[DTensorSpec], shape: torch.Size,
                 dtype: torch.dtype, dim: int = 0) -> DTensorSpec:
    """The spec of a shard of a parameter of global ``shape`` split on ``dim`` (``tp_spec``: its
    tensor-parallel spec, or None)."""
    meta = TensorMeta(shape, contiguous_stride(shape), dtype)
    dp = data_parallel_placements(dp_mesh.ndim, replicated, dim)
    if tp_spec is None:
        return DTensorSpec(dp_mesh, dp, tensor_meta=meta)
    split = tp_spec.num_shards_map[dim]
    if not replicated and split > 1:
        dp = (*dp[:-1], _StridedShard(dim, split_factor=split))
    return DTensorSpec(DeviceMesh._concatenate([dp_mesh, tp_spec.mesh]), (*dp, *tp_spec.placements),
                       tensor_meta=meta)


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
