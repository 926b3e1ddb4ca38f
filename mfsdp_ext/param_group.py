"""ParamGroup: the parameters of one FSDP unit that share (dtype, requires_grad), in flat buffers.

Buffers (S = shard size, W = shard-group size):
  main_weight      (S)   the optimizer's weights; module.parameters() are DTensor views of it while at rest
  model_weight     (S)   compute-dtype copy, written by the fused cast once per optimizer step
  unsharded        (W*S) gathered compute-dtype weights; the module's parameters are views into it in compute
  main_grad        (S)   the optimizer's gradients (fp32 by default); sharded params' .grad are views of it
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _native, comm
from .flat_buffer import FlatBuffer
from .layout import FlatLayout


# Optimizer steps update the main weights through DTensor ops, which do not bump the local tensor's version
# counter; a global step hook counts steps of every torch.optim optimizer instead. Writes to the local tensor
# itself (our init, load) do bump the version counter, so a group's weights are identified by both.
_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


@dataclass
class ParamPlace:
    """Where the module tree references a parameter: ``module.<name>``. A tied parameter has several."""

    module: nn.Module
    name: str
    fqn: str = ""  # relative to the unit's module, as its state_dict names it


@dataclass
class ParamInfo:
    fqn: str
    places: list[ParamPlace]
    shape: torch.Size
    sharded: nn.Parameter = None  # DTensor view of main_weight
    unsharded: nn.Parameter = None  # view of the unsharded buffer
    sharded_grad: DTensor = None  # DTensor view of main_grad, attached as sharded.grad


@dataclass
class GroupStats:
    """Counters that tests and benchmarks read."""

    weight_syncs: int = 0
    all_gathers: int = 0
    reduces: int = 0


class ParamGroup:
    def __init__(self, params: list[tuple[str, nn.Parameter, list[ParamPlace]]], mesh,
                 compute_dtype: torch.dtype, reduce_dtype: torch.dtype, main_grad_dtype: torch.dtype,
                 device: torch.device, shard_group: dist.ProcessGroup, replicate_group: dist.ProcessGroup | None,
                 cache_model_weight: bool = True):
        first = params[0][1]
        self.dtype = first.dtype
        self.requires_grad = first.requires_grad
        self.mesh = mesh
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.world = dist.get_world_size(shard_group) if shard_group is not None else 1
        self.rank = dist.get_rank(shard_group) if shard_group is not None else 0
        self.device = device
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.main_grad_dtype = main_grad_dtype
        self.stats = GroupStats()
        self.infos = [ParamInfo(fqn, places, p.shape) for fqn, p, places in params]
        self.layout = FlatLayout([p.shape for _, p, _ in params], self.world)
        self.on_meta = first.device.type == "meta"
        storage_device = torch.device("meta") if self.on_meta else device

        self.main_weight = FlatBuffer(self.layout, self.dtype, storage_device, rank=self.rank)
        if not self.on_meta:
            self._load_main_weight([p for _, p, _ in params])
        needs_cast = compute_dtype != self.dtype
        self.cast_in_slot = needs_cast and not cache_model_weight  # cast at every gather, no cached copy
        self.model_weight = (FlatBuffer(self.layout, compute_dtype, storage_device, rank=self.rank)
                             if needs_cast and cache_model_weight else None)
        self.unsharded = FlatBuffer(self.layout, compute_dtype, storage_device)
        self.main_grad = None  # allocated at the first reduction
        self.main_grad_replica_summed = False  # HSDP: main_grad holds a finished all-reduce over replicas
        self._synced_version = None  # weights_version() the model weight was cast from
        self._external_writes = 0
        self.use_symm_all_gather = False  # set at lazy init when use_symm_mem picks the native path
        self.use_symm_reduce_scatter = False
        self._make_params()
        self.unsharded.free()

    # ------------------------------------------------------------------ setup
    def local_rows(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of parameter i, out of its full tensor (a view, detached)."""
        slot = self.layout.slots[i]
        r0, r1 = self.layout.local_rows(slot, self.rank)
        return full.detach().reshape(slot.shape)[r0:r1]

    def _load_main_weight(self, params: list[torch.Tensor]) -> None:
        """Copy this rank's rows of each full parameter into main_weight (padding zeroed, one native pack)."""
        local, offsets = [], []
        for i, (slot, p) in enumerate(zip(self.layout.slots, params)):
            rows = self.local_rows(i, p)
            if rows.shape[0] > 0:
                local.append(rows.to(self.device, self.dtype).contiguous())
                lo, _ = self.layout.local_range(slot, self.rank)
                offsets.append(lo - self.rank * self.layout.shard_numel)
        _native.pack(local, offsets, self.main_weight.data)

    def _make_params(self) -> None:
        if self.mesh.ndim == 2:
            placements = [Replicate(), Shard(0)]  # HSDP
        else:
            placements = [Shard(0)] if self.shard_group is not None else [Replicate()]  # no_shard: replicated
        for i, info in enumerate(self.infos):
            local = self.main_weight.param_view(i)
            dt = DTensor.from_local(local, self.mesh, placements, run_check=False, shape=info.shape,
                                    stride=_contiguous_stride(info.shape))
            info.sharded = nn.Parameter(dt, requires_grad=self.requires_grad)
            _use_row_layout_methods(info.sharded, self, i, "main_weight")
            info.unsharded = nn.Parameter(self.unsharded.param_view(i), requires_grad=self.requires_grad)

    def materialize(self, device: torch.device) -> None:
        """Give a meta-device group real (uninitialised) storage on ``device``; values come from init."""
        if not self.on_meta:
            return
        self.device = device
        self.main_weight = FlatBuffer(self.layout, self.dtype, device, rank=self.rank)
        self.main_weight.data.zero_()
        if self.model_weight is not None:
            self.model_weight = FlatBuffer(self.layout, self.compute_dtype, device, rank=self.rank)
        self.unsharded = FlatBuffer(self.layout, self.compute_dtype, device)
        self.on_meta = False
        self._synced_version = None
        self._make_params()
        self.unsharded.free()

    # ------------------------------------------------------------------ parameter swapping
    def use_sharded_params(self) -> None:
        for info in self.infos:
            for place in info.places:
                place.module._parameters[place.name] = info.sharded

    def use_unsharded_params(self) -> None:
        for info in self.infos:
            for place in info.places:
                place.module._parameters[place.name] = info.unsharded

    # ------------------------------------------------------------------ weights
    def weights_version(self) -> tuple[int, int, int]:
        """Changes whenever the main weights may have changed: optimizer step, direct write, load. Frozen
        groups get no gradients, so no optimizer step changes them: they are not re-cast and re-gathered."""
        steps = _optimizer_steps if self.requires_grad else 0
        return (steps, self.main_weight.data._version, self._external_writes)

    def mark_main_weight_changed(self) -> None:
        self._external_writes += 1

    def needs_weight_sync(self) -> bool:
        return self.model_weight is not None and self._synced_version != self.weights_version()

    def sync_model_weight(self) -> None:
        """Cast main_weight into model_weight (one fused kernel) if the main weights changed since the last cast."""
        if not self.needs_weight_sync():
            return
        _native.cast(self.main_weight.data, self.model_weight.data)
        self._synced_version = self.weights_version()
        self.stats.weight_syncs += 1

    def gather_source(self) -> torch.Tensor:
        return (self.model_weight if self.model_weight is not None else self.main_weight).data

    def all_gather(self, symmetric: "comm.SymmetricCollectives | None" = None) -> None:
        """Gather every rank's model-weight shard straight into the unsharded buffer (no copy-in/out).

        ``symmetric``: gather through the NCCL symmetric-memory stage instead (use_symm_mem)."""
        self.unsharded.alloc()
        with torch.autograd._unsafe_preserve_version_counter(self.unsharded.data):
            if self.cast_in_slot:  # cast into this rank's slot and gather in place
                source = self.unsharded.shard_view(self.rank)
                _native.cast(self.main_weight.data, source)
                self.stats.weight_syncs += 1
            else:
                source = self.gather_source()
            if self.world == 1:
                if not self.cast_in_slot:  # with one rank the slot is the whole buffer
                    self.unsharded.data.copy_(source)
            elif symmetric is not None and self.use_symm_all_gather:
                symmetric.all_gather_into(self.unsharded.data, source)
            else:
                comm.all_gather_into(self.unsharded.data, source, self.shard_group)
        self.stats.all_gathers += 1

    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        """A new full flat buffer assembled from every rank's ``shard`` (a collective over the shard group)."""
        full = torch.empty(self.layout.total_numel, dtype=shard.dtype, device=shard.device)
        if self.world > 1:
            comm.all_gather_into(full, shard, self.shard_group)
        else:
            full.copy_(shard)
        return full

    def free_unsharded(self) -> None:
        self.unsharded.free()

    # ------------------------------------------------------------------ gradients
    def has_unsharded_grads(self) -> bool:
        return any(info.unsharded.grad is not None for info in self.infos)

    def pack_grads(self, out: torch.Tensor, scale: float) -> None:
        """Pack the unsharded grads (missing ones as zeros) into ``out`` (W*S) and drop them."""
        tensors, offsets = [], []
        for slot, info in zip(self.layout.slots, self.infos):
            if info.unsharded.grad is not None:
                tensors.append(info.unsharded.grad)
                offsets.append(slot.offset)
        _native.pack(tensors, offsets, out, scale)

    def drop_unsharded_grads(self) -> list[torch.Tensor]:
        grads = []
        for info in self.infos:
            if info.unsharded.grad is not None:
                grads.append(info.unsharded.grad)
                info.unsharded.grad = None
        return grads

    def grads_attached(self) -> bool:
        """True when the optimizer-visible grads still hold the last accumulation (not zeroed to None)."""
        return self.main_grad is not None and all(
            i.sharded_grad is not None and i.sharded.grad is i.sharded_grad for i in self.infos)

    def accumulate_main_grad(self, reduced: torch.Tensor, scale: float = 1.0) -> None:
        """main_grad (+)= scale * reduced, then make sure the sharded params' .grad point at main_grad."""
        if self.main_grad is None:
            self.main_grad = FlatBuffer(self.layout, self.main_grad_dtype, self.device, rank=self.rank)
        accumulate = self.grads_attached()
        _native.grad_accumulate(self.main_grad.data, reduced, scale, accumulate)
        self.attach_grads()

    def attach_grads(self) -> None:
        for i, info in enumerate(self.infos):
            if info.sharded_grad is None:
                local = self.main_grad.param_view(i)
                info.sharded_grad = DTensor.from_local(local, self.mesh, info.sharded.placements, run_check=False,
                                                       shape=info.shape, stride=_contiguous_stride(info.shape))
                _use_row_layout_methods(info.sharded_grad, self, i, "main_grad")
            if info.sharded.grad is not info.sharded_grad:
                info.sharded.grad = info.sharded_grad



def _use_row_layout_methods(dt: DTensor, group: "ParamGroup", index: int, buffer: str) -> None:
    """Our shards are split by whole rows, not as torch.chunk splits them, so DTensor's own full_tensor() /
    redistribute() would reassemble them wrongly. Give this DTensor a full_tensor() that gathers with the
    layout, and a redistribute() that says what to do instead."""

    def full_tensor(*, grad_placements=None) -> torch.Tensor:
        return group.layout.slots[index].view(group.gather_full(getattr(group, buffer).data))

    def redistribute(*args, **kwargs):
        raise NotImplementedError(
            "mfsdp_ext: sharded parameters and gradients are split by whole rows, not as torch.chunk splits "
            "them, so DTensor.redistribute() would misplace rows. Use .full_tensor() (layout-aware here) or "
            "module.state_dict(), whose DTensors are split as torch.chunk splits them.")

    dt.full_tensor = full_tensor
    dt.redistribute = redistribute


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))
