"""FSDP2's ``reshard_after_forward=N`` (an int): after forward a unit keeps its gathered weights sharded over groups of
N ranks instead of freeing them, so the backward gathers within such a group (e.g. one host's GPUs) rather than over
the whole shard group.

The groups are FSDP2's: the mesh viewed as (-1, N), N consecutive ranks each (on an HSDP mesh, within a replica).
Member j of a group keeps, of every parameter's padded unsharded region (W chunk slots of torch.chunk rows), the W/N
slots [j * W/N, (j + 1) * W/N): a gather of those blocks within the group lays the region out again in place. Memory
between forward and backward: 1/N of the gathered weights (N = W is ``True``: a shard; N = 1 is ``False``).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from .. import _native
from ..comm import dist_ops
from ..core import registry


def check(value, mesh: DeviceMesh, groups: list) -> bool | int:
    """FSDP2's rules for an int: a factor of the shard dim's size; 1 is False, the size itself True. Groups this path
    does not take (FP8 weights, splits on a dim other than 0) are refused by name."""
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    world = mesh.size(mesh.ndim - 1)
    if value < 1 or value > world or world % value:
        raise ValueError(f"If passing reshard_after_forward as an int, it should be a factor of {world}, not {value}")
    if value in (1, world):
        return value == world
    for g in groups:
        if g.fp8 or g.plan.staged:
            raise ValueError(f"fully_shard(reshard_after_forward={value}): not supported for "
                             f"{'FP8 weights' if g.fp8 else 'parameters sharded on a dim other than 0'} (unit "
                             f"params '{g.infos[0].fqn}', ...): pass True or False for this unit")
    return value


def post_forward_group(mesh: DeviceMesh, n: int):
    """The process group of this rank's N consecutive ranks of ``mesh`` (made once per mesh and N: collective)."""
    key = (id(mesh), n)
    source, view = registry.POST_FORWARD_MESHES.get(key, (None, None))
    if source is None or source() is not mesh:  # new, or a dead mesh's id reused
        view = DeviceMesh(mesh.device_type, mesh.mesh.view(-1, n))
        registry.POST_FORWARD_MESHES[key] = (weakref.ref(mesh), view)
    return view.get_group(1)


class PostForwardShards:
    """A unit's weights kept between its forward and its backward, sharded over groups of ``n`` ranks."""

    def __init__(self, groups: list, n: int):
        self.n = n
        self.groups = [g for g in groups if not g.replicated and g.world > 1]
        self.process_group = post_forward_group(self.groups[0].mesh, n) if self.groups else None
        self.kept: Optional[list[torch.Tensor]] = None  # per group, its blocks back to back

    def _blocks(self, g) -> list[torch.Tensor]:
        """This rank's blocks of ``g``'s unsharded buffer (which must have storage now)."""
        span, j = g.world // self.n, g.rank % self.n
        out = []
        for i in g.plan.gathered:
            chunk = g.layout.slots[i].chunk_numel
            out.append(g.unsharded.padded_param(i)[j * span * chunk : (j + 1) * span * chunk])
        return out

    def keep(self) -> None:
        """After forward, before the unsharded storage is freed: this rank's blocks copied out (one native pack per
        group, on the current stream)."""
        self.kept = []
        for g in self.groups:
            blocks = self._blocks(g)
            offsets = [0]
            for b in blocks[:-1]:
                offsets.append(offsets[-1] + b.numel())
            flat = torch.empty(sum(b.numel() for b in blocks), dtype=g.compute_dtype, device=g.device)
            _native.pack(blocks, offsets, flat)
            self.kept.append(flat)

    def gather(self, device) -> None:
        """Before backward, on the current stream (the all-gather stream): each group's unsharded buffer gathered from
        the kept blocks within the small group (one grouped all-gather per group landing in place), then the kept
        blocks freed in stream order (``device``: the context's DeviceHandle)."""
        for g, flat in zip(self.groups, self.kept or ()):
            device.record_stream(flat, device.current_stream())  # made on the compute stream, read here
            with torch.autograd._unsafe_preserve_version_counter(g.unsharded.data):
                g.unsharded.alloc()
                outputs = [g.unsharded.padded_param(i) for i in g.plan.gathered]
                inputs = list(flat.split([b.numel() // self.n for b in outputs]))
                dist_ops.all_gather_into(outputs, inputs, self.process_group)
            g.stats.all_gathers += 1
            g.stats.all_gather_bytes += g.plan.gathered_bytes(g.compute_dtype)
        self.kept = None

    def drop(self) -> None:
        self.kept = None
