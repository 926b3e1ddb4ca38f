"""ParamGroup: the parameters of one FSDP unit that share (dtype, requires_grad), in flat buffers.

Buffers (laid out by FlatLayout: every parameter split as torch.chunk splits it, so its DTensors are truthful):
  main_weight      shard        the optimizer's weights; module.parameters() are DTensor views of it while at rest
  model_weight     shard        compute-dtype copy, written by the fused cast once per optimizer step (cache_model_weight;
                                by default made only when the same weights are gathered a third time: microbatches)
  unsharded        param-major  gathered compute-dtype weights; the module's parameters are views into it in compute
  main_grad        shard        the optimizer's gradients (fp32 by default); sharded params' .grad are views of it and
                                own it: it is freed when the optimizer lets go of them (zero_grad to None), as FSDP2
                                frees its sharded grads, and made again at the next reduction (group_grads.py)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from .. import _native
from ..core import placements
from . import replaced
from ..comm import dist_ops
from ..comm.collectives import TORCH_TRANSPORT, AllGather, PlainAllGather, ReduceScatter
from ..core.flat_buffer import FlatBuffer
from .grads import GroupGradients
from ..core.layout import FlatLayout


class _OptimizerSteps:
    """Optimizer steps update the main weights through DTensor ops, which do not bump the local tensor's version
    counter; a step hook counts the steps of every torch.optim optimizer instead (registered by the first group).
    Writes to the local tensor itself (our init, load) do bump the version counter: a group's weights are
    identified by both."""

    count = 0
    last_step: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> count after its last step
    _handle = None

    @classmethod
    def watch(cls) -> None:
        if cls._handle is None:
            cls._handle = register_optimizer_step_post_hook(cls._count)

    @classmethod
    def _count(cls, optimizer, args, kwargs) -> None:
        cls.count += 1
        cls.last_step[optimizer] = cls.count

    @classmethod
    def stepped_since(cls, count: int) -> list:
        """The optimizers that stepped after the step count was ``count``."""
        return [opt for opt, last in list(cls.last_step.items()) if last > count]


# sharded parameter (info.sharded) -> (weak reference to its ParamGroup, its index): how mfsdp_ext.optim finds
# the flat buffers behind a parameter without walking modules. Filled by _make_params (again after materialize).
_OWNERS = WeakIdKeyDictionary()


_GENERATION = [0]  # bumped whenever some group's buffers or collectives are replaced


def optimizer_steps() -> int:
    """torch.optim steps counted so far (every optimizer's)."""
    return _OptimizerSteps.count


def optimizers_stepped_since(count: int) -> list:
    """The optimizers that stepped after optimizer_steps() was ``count``."""
    return _OptimizerSteps.stepped_since(count)


def buffers_generation() -> int:
    """Changes whenever a group's flat buffers or collectives are replaced (materialisation, the release of
    symmetric memory): what a captured CUDA graph addresses is then gone (mfsdp_ext.graphed captures again)."""
    return _GENERATION[0]


def _local(p: torch.Tensor) -> torch.Tensor:
    """What the flat buffers hold of ``p``: its local tensor when it is a (tensor-parallel) DTensor."""
    return p._local_tensor if isinstance(p, DTensor) else p


def owner_of(param: torch.Tensor) -> tuple[ParamGroup, int] | None:
    """(group, index) when ``param`` is (or was: check ``group.infos[index].sharded is param``) the sharded
    parameter of a live ParamGroup; None for any other tensor."""
    entry = _OWNERS.get(param)
    group = entry[0]() if entry is not None else None
    return None if group is None else (group, entry[1])


@dataclass
class ParamPlace:
    """Where the module tree references a parameter: ``module.<name>``. A tied parameter has several."""

    module: nn.Module
    name: str
    fqn: str = ""  # relative to ``holder``, as its state_dict names it
    holder: nn.Module = None  # the module given to fully_shard (one of the list) whose subtree holds this place


@dataclass
class ParamInfo:
    fqn: str
    places: list[ParamPlace]
    shape: torch.Size  # the global shape
    tp_spec: DTensorSpec | None = None  # a tensor-parallel parameter's own spec; the group holds its local tensor
    dim: int = 0  # the dim it is sharded on (FSDP2's shard_placement_fn: Shard(dim))
    spmd: placements.SpmdDims | None = None  # tp_spec is on a full SPMD mesh with these data-parallel dims
    sharded: nn.Parameter = None  # DTensor view of main_weight
    unsharded: nn.Parameter = None  # view of the unsharded buffer
    grad_ref: weakref.ref | None = None  # the DTensor view of main_grad attached as sharded.grad (weak: see main_grad)

    @property
    def sharded_grad(self) -> DTensor | None:
        return None if self.grad_ref is None else self.grad_ref()


@dataclass
class GroupStats:
    """Counters that tests and benchmarks read."""

    weight_syncs: int = 0  # casts of the main weight into the model-weight dtype
    scale_syncs: int = 0  # FP8 groups: amax + all-reduce + scales (once per weights version)
    all_gathers: int = 0
    all_gather_bytes: int = 0  # bytes the all-gathers received (the gathered chunks of every rank; 0 on one rank)
    reduces: int = 0


class ParamGroup(GroupGradients):
    fp8 = False  # FP8 model weights (Fp8ParamGroup, fp8/group.py)

    def __init__(self, params: list[tuple[str, nn.Parameter, list[ParamPlace]]], mesh,
                 compute_dtype: torch.dtype, reduce_dtype: torch.dtype, main_grad_dtype: torch.dtype,
                 device: torch.device, shard_group: dist.ProcessGroup, replicate_group: dist.ProcessGroup | None,
                 cache_model_weight: bool | None = None, reduce_when_ready: bool = False,
                 reduce_comm_dtype: torch.dtype | None = None, dims: dict[int, int] | None = None,
                 spmd: placements.SpmdDims | None = None):
        """``dims``: id(parameter) -> the dim it is sharded on, where not 0; ``spmd``: the full SPMD mesh the
        parameters are DTensors on (dp_mesh_dims; ``mesh`` is its data-parallel part)."""
        first = params[0][1]
        self.dtype = first.dtype
        self.requires_grad = first.requires_grad
        self.mesh = mesh
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.replicated = shard_group is None  # no_shard: every rank holds every row; gathered once, kept
        self.world = dist.get_world_size(shard_group) if shard_group is not None else 1
        self.rank = dist.get_rank(shard_group) if shard_group is not None else 0
        self.device = device
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        # the gradients' dtype on the wire: reduce_dtype (a reduce-scatter), or narrower (an all-to-all, then a sum in
        # reduce_dtype here: collectives.PlainReduceScatter)
        self.reduce_comm_dtype = reduce_comm_dtype or reduce_dtype
        self.main_grad_dtype = main_grad_dtype
        self.stats = GroupStats()
        # Reduced as soon as all its trainable parameters have their gradient (the unit sets on_grads_ready), not
        # at the unit's post-backward: parameters used after the unit's inner units (shard_init).
        self.reduce_when_ready = reduce_when_ready and self.requires_grad
        self.on_grads_ready = None
        self.grads_ready = 0
        self.unit = None  # weak reference to the FsdpUnit that owns the group (set by the unit)
        self.infos = [ParamInfo(fqn, places, p.shape, p._spec if isinstance(p, DTensor) else None,
                                (dims or {}).get(id(p), 0), spmd) for fqn, p, places in params]
        self._specs: dict[tuple[int, torch.dtype], DTensorSpec] = {}  # as_dtensor's, per (parameter, dtype)
        # the flat buffers hold each rank's local tensors: a tensor-parallel parameter's TP shard, split again here
        self.layout = FlatLayout([_local(p).shape for _, p, _ in params], self.world,
                                 dims=[info.dim for info in self.infos])
        self._plan_copies()
        self.on_meta = first.device.type == "meta"
        storage_device = torch.device("meta") if self.on_meta else device
        self.main_weight = FlatBuffer(self.layout, self.dtype, storage_device, rank=self.rank)
        if not self.on_meta:
            self._load_main_weight([_local(p) for _, p, _ in params])
        needs_cast = compute_dtype != self.dtype
        self.cast_in_slot = needs_cast and not cache_model_weight  # cast at every gather, no cached copy
        self.cache_model_weight = needs_cast and cache_model_weight  # None (auto): not yet, see note_gather
        self.model_weight = self._make_model_weight(storage_device)
        self.cache_when_regathered = needs_cast and cache_model_weight is None
        self._gathered_version, self._gathers_of_version = None, 0
        self.unsharded = self._make_unsharded(storage_device)
        self._main_grad_ref = None  # weak reference to main_grad: the .grad views own it (main_grad's docstring)
        self.graph_main_grads: list = []  # gradient buffers a captured CUDA graph writes: kept here (group_grads)
        self.main_grad_replica_summed = False  # HSDP: main_grad holds a finished all-reduce over replicas
        self._synced_version = None  # weights_version() the model weight was cast from
        self._external_writes = 0
        self._aliases: list[tuple[weakref.ref, int]] = []  # (tensor sharing main_weight's storage, its version)
        _OptimizerSteps.watch()
        self.use_transport(TORCH_TRANSPORT)  # lazy init may give the native one, or symmetric-memory collectives
        self._make_params()
        self.free_unsharded()

    # ------------------------------------------------------------------ setup
    def _make_model_weight(self, device: torch.device) -> FlatBuffer | None:
        """The cached compute-dtype shard (None when the group needs no cast or casts at every gather)."""
        if not self.cache_model_weight:
            return None
        return FlatBuffer(self.layout, self.compute_dtype, device, rank=self.rank)

    def gathered_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one all-gather of this group receives in ``dtype`` (every rank's chunk slots; 0 on one rank)."""
        if self.world == 1:
            return 0
        return sum(self.layout.slots[i].chunk_numel for i in self._gathered) * self.world * dtype.itemsize

    def _make_unsharded(self, device: torch.device) -> FlatBuffer:
        """The buffer the module computes with; a replicated group with no cast computes on its main weight."""
        if self.replicated and self.compute_dtype == self.dtype:
            return self.main_weight
        return FlatBuffer(self.layout, self.compute_dtype, device)

    def _plan_copies(self) -> None:
        """Index lists the collectives reuse on every call (they depend on the layout and the rank only)."""
        layout = self.layout
        self._gathered = [i for i, s in enumerate(layout.slots) if s.chunk_numel > 0]  # nothing to gather if empty
        self._shard_offsets = [layout.slots[i].shard_offset for i in self._gathered]
        self._pieces = layout.rank_major_pieces()
        self._grad_pieces = torch.tensor(self._pieces, dtype=torch.int64).reshape(-1, 4)  # pack_pieces' table
        self.rank_major_offsets = [offset for _, _, _, offset in self._pieces]
        self._staged = any(slot.dim for slot in layout.slots)  # dim > 0 splits: gathers land in a staging area
        self._staged_pending = False

    def _plan_views(self) -> None:
        """Views of the buffers that the collectives read and write (valid across free/alloc of the storage):
        per gathered parameter its chunk slot in the shard and its padded place in the unsharded buffer, this
        rank's slots there, and the unsharded pieces of a rank-major buffer."""
        self.gather_inputs = self._gather_inputs()
        self.gather_outputs = [self.unsharded.padded_param(i) for i in self._gathered]
        self.own_unsharded_slots = [self.unsharded.chunk_slot(i, self.rank) for i in self._gathered]
        self.unsharded_pieces = [self.unsharded.param_region(i)[first : first + n] for i, first, n, _ in self._pieces]

    def _unstage(self, buffer: FlatBuffer) -> None:
        """dim > 0 splits: each rank's slice, gathered into the staging area, into place."""
        if self._staged:
            with torch.autograd._unsafe_preserve_version_counter(buffer.data):
                buffer.unstage()

    def _gather_inputs(self) -> list[torch.Tensor]:
        return [self.gather_source().chunk_slot(i) for i in self._gathered]

    def local_rows(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of parameter i (torch.chunk's split), out of its unsharded local tensor (the whole
        parameter, or a tensor-parallel parameter's TP shard): a view, detached."""
        slot = self.layout.slots[i]
        full = full.detach().reshape(slot.shape)
        if slot.dim:  # an even split on that dim
            b = slot.shape[slot.dim] // self.world
            return full.narrow(slot.dim, self.rank * b, b)
        r0, r1 = self.layout.local_rows(slot, self.rank)
        return full[r0:r1]

    def local_of_full(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter i out of the full (global) tensor: its TP shard's rows for a
        tensor-parallel parameter (sliced locally, no communication)."""
        spec = self.infos[i].tp_spec
        if spec is not None:
            full = distribute_tensor(full.detach(), spec.mesh, spec.placements, src_data_rank=None)._local_tensor
        return self.local_rows(i, full)

    def full_of_local(self, i: int, local: torch.Tensor) -> torch.Tensor:
        """Parameter i's full tensor from its gathered local tensor (``gather_full``): for a tensor-parallel
        parameter, its TP shards gathered too (a collective over the tensor-parallel mesh)."""
        spec = self.infos[i].tp_spec
        if spec is None:
            return local
        return DTensor(local, placements.with_dtype(spec, local.dtype), requires_grad=False).full_tensor()

    def _load_main_weight(self, params: list[torch.Tensor]) -> None:
        """Copy this rank's rows of each full parameter into main_weight (padding zeroed, one native pack)."""
        local, offsets = [], []
        for i, (slot, p) in enumerate(zip(self.layout.slots, params)):
            rows = self.local_rows(i, p)
            if rows.numel() > 0:
                local.append(rows.to(self.device, self.dtype).contiguous())
                offsets.append(slot.shard_offset)
        _native.pack(local, offsets, self.main_weight.data)

    def as_dtensor(self, i: int, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's torch.chunk rows of parameter i) as the DTensor it is. Gradients are wrapped
        again at every step after zero_grad lets them go: the spec is made once per (parameter, dtype) and the
        DTensor built from it directly (as FSDP2 does; ~2 us against ~17 us for DTensor.from_local)."""
        spec = self._specs.get((i, local.dtype))
        if spec is None:
            info = self.infos[i]
            spec = self._specs[i, local.dtype] = placements.sharded_spec(self.mesh, self.replicated, info.tp_spec,
                                                                         info.shape, local.dtype, info.dim, info.spmd)
        return DTensor(local, spec, requires_grad=False)

    def _make_params(self) -> None:
        _GENERATION[0] += 1
        for i, info in enumerate(self.infos):
            info.sharded = nn.Parameter(self.as_dtensor(i, self.main_weight.param_alias(i)),
                                        requires_grad=self.requires_grad)
            _OWNERS[info.sharded] = (weakref.ref(self), i)
            if self.main_grad_dtype != self.dtype and hasattr(info.sharded, "grad_dtype"):
                info.sharded.grad_dtype = self.main_grad_dtype  # torch >= 2.13 checks .grad's dtype against it
            view = self.unsharded.param_view(i)
            if info.tp_spec is not None:  # the module computes with its tensor-parallel DTensor, gathered over dp
                view = DTensor(view, placements.with_dtype(info.tp_spec, view.dtype), requires_grad=False)
            info.unsharded = nn.Parameter(view, requires_grad=self.requires_grad)
            if self.reduce_when_ready:
                info.unsharded.register_post_accumulate_grad_hook(self._grad_accumulated_hook())
        self._plan_views()

    def _grad_accumulated_hook(self):
        """The hook holds the group weakly: a tensor's hooks live in C++, where the garbage collector cannot see a
        cycle through them, and a group kept alive keeps its process groups (and gloo's threads) alive at exit."""
        group = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            g = group()
            if g is not None:
                g._grad_accumulated(param)

        return hook

    def _grad_accumulated(self, param: torch.Tensor) -> None:
        if self.on_grads_ready is None:
            return
        self.grads_ready += 1
        if self.grads_ready == len(self.trainable()):
            self.on_grads_ready(self)

    def materialize(self, device: torch.device) -> None:
        """Give a meta-device group real (uninitialised) storage on ``device``; values come from init."""
        if not self.on_meta:
            return
        self.device = device
        self.main_weight = FlatBuffer(self.layout, self.dtype, device, rank=self.rank)
        self.main_weight.data.zero_()
        self.model_weight = self._make_model_weight(device)
        self._gathered_version, self._gathers_of_version = None, 0
        self.unsharded = self._make_unsharded(device)
        self.on_meta = False
        self._synced_version = None
        for info in self.infos:  # the meta parameters are replaced: an optimizer holding them is caught at its step
            replaced.note_replaced(info.sharded, f"'{info.fqn}'", "on the meta device, before to_empty()")
        self._make_params()
        self.free_unsharded()

    def use_transport(self, transport) -> None:
        """Issue the plain collectives through ``transport`` (comm/collectives.py): the all-gather and reduce-scatter,
        and FP8 groups' own gather and scale all-reduce over the shard group."""
        self.transport = transport
        _GENERATION[0] += 1
        self.all_gather_op: AllGather = transport.all_gather_op
        self.reduce_scatter_op: ReduceScatter = transport.reduce_scatter_op

    # ------------------------------------------------------------------ parameter swapping
    def use_sharded_params(self) -> None:
        for info in self.infos:
            for place in info.places:
                place.module._parameters[place.name] = info.sharded

    def use_unsharded_params(self) -> None:
        for info in self.infos:
            if info.unsharded.requires_grad != info.sharded.requires_grad:
                info.unsharded.requires_grad_(info.sharded.requires_grad)  # frozen (or unfrozen) after fully_shard
            for place in info.places:
                place.module._parameters[place.name] = info.unsharded

    def trainable(self) -> list[int]:
        """Indices of the parameters that require grad now (the user may freeze some after fully_shard)."""
        return [i for i, info in enumerate(self.infos) if info.sharded.requires_grad]

    # ------------------------------------------------------------------ weights
    def weights_version(self, pending_step: bool = False) -> tuple[int, int, int, int]:
        """Changes whenever the main weights may have changed: an optimizer step (its foreach kernels bump no
        version counter, hence the step count), an in-place op on a parameter (a hand-written update, copy_:
        the DTensor's own version counter), a write to the flat buffer (init, load), a load. Frozen groups get no
        gradients, so no optimizer step changes them: they are not re-cast and re-gathered. ``pending_step``:
        inside an optimizer step, the version the weights will have once that step is counted."""
        if self._aliases:
            self._count_alias_writes()
        params, trainable = 0, False
        for info in self.infos:
            params += info.sharded._version
            trainable = trainable or info.sharded.requires_grad
        steps = _OptimizerSteps.count + pending_step if trainable else 0
        return (steps, params, self.main_weight.data._version, self._external_writes)

    def mark_main_weight_changed(self) -> None:
        self._external_writes += 1

    def watch_alias(self, tensor: torch.Tensor) -> None:
        """``tensor`` shares main_weight's storage with a version counter of its own (the local tensor of a
        DTensor that state_dict() returned, which DCP loads into in place): count writes through it while it lives."""
        self._aliases.append((weakref.ref(tensor), tensor._version))

    def _count_alias_writes(self) -> None:
        live = []
        for ref, seen in self._aliases:
            tensor = ref()
            if tensor is None:
                continue
            if tensor._version != seen:
                self._external_writes += 1
            live.append((ref, tensor._version))
        self._aliases = live

    def _gathered_third_time(self, version: tuple) -> bool:
        """Count a training gather of ``version``: True at the third of the same weights (a step of one microbatch
        gathers twice: forward and backward)."""
        if version != self._gathered_version:
            self._gathered_version, self._gathers_of_version = version, 0
        self._gathers_of_version += 1
        return self._gathers_of_version > 2

    def note_gather(self, version: tuple) -> None:
        """A training gather (not evaluation). cache_model_weight=None: start keeping the compute-dtype shard once
        the same weights are gathered a third time. From then on each further gather saves a cast; a run without
        microbatches never pays the copy's memory."""
        if not self.cache_when_regathered or not self._gathered_third_time(version):
            return
        self.cache_model_weight = True
        self.model_weight = self._make_model_weight(self.device)
        self.cast_in_slot = self.cache_when_regathered = False
        self._synced_version = None
        self.gather_inputs = self._gather_inputs()  # the all-gather now sends the copy

    def sync_model_weight(self, version: tuple) -> None:
        """Cast main_weight into model_weight (one fused kernel) unless it was cast at this weights_version()."""
        if self.model_weight is None or self._synced_version == version:
            return
        _native.cast(self.main_weight.data, self.model_weight.data)
        self._synced_version = version
        self.stats.weight_syncs += 1

    def gather_source(self) -> FlatBuffer:
        """The shard the all-gather sends: the compute-dtype copy, or the main weight when no cast is needed."""
        return self.model_weight if self.model_weight is not None else self.main_weight

    def all_gather(self, op: AllGather | None = None) -> None:
        """Gather every rank's compute-dtype shard into the param-major unsharded buffer, with this group's
        all-gather (or ``op``), on the current stream."""
        with torch.autograd._unsafe_preserve_version_counter(self.gather_targets()):
            self.unsharded.alloc()
            (op or self.all_gather_op)(self)
        self.gather_end()

    def joins_grouped_gather(self) -> bool:
        """Whether this group's gather is the plain grouped all-gather over several ranks, whose collective can be
        one call with other such groups' (collectives.all_gather_together): gather_begin, the collective,
        gather_end."""
        return self.world > 1 and isinstance(self.all_gather_op, PlainAllGather)

    def gather_targets(self) -> tuple[torch.Tensor, ...]:
        """The buffers a gather writes: their autograd version counters must not move (the backward saved views)."""
        return (self.unsharded.data,)

    def gather_begin(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The plain all-gather up to its collective: the buffer allocated, this rank's chunks cast into their slots
        where no compute-dtype shard is kept; returns the collective's (outputs, inputs)."""
        self.unsharded.alloc()
        self._staged_pending = self._staged
        if self.cast_in_slot:
            self.cast_into_own_slots()
            return self.gather_outputs, self.own_unsharded_slots
        return self.gather_outputs, self.gather_inputs

    def gather_end(self) -> None:
        """After the all-gather's collective (issued, on this stream)."""
        if self._staged_pending:  # the plain gather landed dim > 0 splits in the staging area
            self._unstage(self.unsharded)
            self._staged_pending = False
        self.stats.all_gathers += 1
        if not self.replicated:
            self.stats.all_gather_bytes += self.gathered_bytes(self.compute_dtype)

    def write_shard(self, out: torch.Tensor) -> None:
        """This rank's compute-dtype shard into ``out``, a flat buffer in the shard layout."""
        if self.cast_in_slot:
            _native.cast(self.main_weight.data, out)
            self.stats.weight_syncs += 1
        else:
            out.copy_(self.gather_source().data)

    def cast_into_own_slots(self) -> None:
        """This rank's compute-dtype chunks straight into its slots of the unsharded buffer (one native cast)."""
        _native.unpack(self.main_weight.data, self._shard_offsets, self.own_unsharded_slots)
        self.stats.weight_syncs += 1

    def gather_full(self, shard: FlatBuffer) -> FlatBuffer:
        """A new param-major buffer assembled from every rank's ``shard`` (a collective over the shard group);
        its ``param_view(i)`` is parameter i."""
        full = FlatBuffer(self.layout, shard.dtype, shard.data.device)
        if self.world == 1:
            full.data.copy_(shard.data)
        else:
            dist_ops.all_gather_into([full.padded_param(i) for i in self._gathered],
                                 [shard.chunk_slot(i) for i in self._gathered], self.shard_group)
            self._unstage(full)
        return full

    def free_unsharded(self) -> None:
        if not self.replicated:  # a replicated group keeps its gathered weights (its main weight, maybe)
            self.unsharded.free()
