"""ParamGroup: the parameters of one FSDP unit that share (dtype, requires_grad), in flat buffers.

Buffers (laid out by FlatLayout: every parameter split as torch.chunk splits it, so its DTensors are truthful):
  main_weight      shard        the optimizer's weights; module.parameters() are DTensor views of it while at rest
  model_weight     shard        compute-dtype copy, written by the fused cast once per optimizer step
                                (cache_model_weight; by default made only when the same weights are gathered a third
                                time: microbatches)
  unsharded        param-major  gathered compute-dtype weights; the module's parameters are views into it in compute
  main_grad        shard        the optimizer's gradients (grads.py: the group's ``grads``)
With ``offload`` (offload.py: FSDP2's CPUOffloadPolicy on a CUDA mesh) main_weight and main_grad are in host memory;
the compute-dtype shard is made on the host once per weights version (the group's own HostOffload holds it) and copied
into this rank's slots at each gather, or into a kept model_weight with cache_model_weight=True; ``device`` is where
the module computes and the collectives run.

Its parts: ``versions`` (versions.py: when the main weights changed), ``plan`` (gather_plan.py: the collectives' index
lists and views), ``grads`` (grads.py), ``collectives`` (comm/policy.py gives them at lazy init), and ``cast`` (how the
compute-dtype shard is made). rows.py converts between full parameters and a rank's rows.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .. import _native
from ..comm.collectives import AllGather, GroupCollectives
from ..comm.policy import plain_collectives
from ..core import placements, registry
from ..core.flat_buffer import FlatBuffer
from ..core.layout import FlatLayout
from ..core.mixed_precision import GroupDtypes
from . import replaced, rows
from .gather_plan import GatherPlan
from .grads import GroupGradients
from .offload import HostOffload
from .versions import WeightVersions


def owner_of(param: torch.Tensor) -> Optional[tuple[ParamGroup, int]]:
    """(group, index) when ``param`` is (or was: check ``group.infos[index].sharded is param``) the sharded
    parameter of a live ParamGroup; None for any other tensor."""
    entry = registry.GROUP_OF_PARAM.get(param)
    group = entry[0]() if entry is not None else None
    return None if group is None else (group, entry[1])


@dataclass
class ParamPlace:
    """Where the module tree references a parameter: ``module.<name>``. A tied parameter has several."""

    module: nn.Module
    name: str
    fqn: str = ""  # relative to ``holder``, as its state_dict names it
    holder: Optional[nn.Module] = None  # the module given to fully_shard (one of the list) whose subtree holds it


@dataclass
class ParamInfo:
    fqn: str
    places: list[ParamPlace]
    shape: torch.Size  # the global shape
    tp_spec: Optional[DTensorSpec] = None  # a tensor-parallel parameter's own spec; the group holds its local tensor
    dim: int = 0  # the dim it is sharded on (FSDP2's shard_placement_fn: Shard(dim))
    spmd: Optional[placements.SpmdDims] = None  # tp_spec is on a full SPMD mesh with these data-parallel dims
    sharded: nn.Parameter = None  # DTensor view of main_weight
    unsharded: nn.Parameter = None  # view of the unsharded buffer
    grad_ref: Optional[weakref.ref] = None  # the DTensor view of main_grad attached as sharded.grad (grads.py)
    specs: dict = field(default_factory=dict)  # dtype -> its DTensor spec as a shard (as_dtensor)

    @property
    def sharded_grad(self) -> Optional[DTensor]:
        return None if self.grad_ref is None else self.grad_ref()


@dataclass
class GroupStats:
    """Counters that tests and benchmarks read."""

    weight_syncs: int = 0  # casts of the main weight into the model-weight dtype
    casts_ahead_taken: int = 0  # offload: of those, the casts made ahead on the offload worker that a gather took
    scale_syncs: int = 0  # FP8 groups: amax + all-reduce + scales (once per weights version)
    all_gathers: int = 0
    all_gather_bytes: int = 0  # bytes the all-gathers received (the gathered chunks of every rank; 0 on one rank)
    reduces: int = 0


@dataclass(frozen=True)
class GroupMesh:
    """The mesh a group is sharded over and its process groups: ``shard`` (None: replicated, no_shard) and
    ``replicate`` (HSDP's replicas, or a replicated group's whole mesh; None otherwise)."""

    mesh: DeviceMesh
    shard: Optional[dist.ProcessGroup]
    replicate: Optional[dist.ProcessGroup] = None


@dataclass
class CastState:
    """How the compute-dtype shard is made (``cache_model_weight``'s rule) and which weights it was made from."""

    in_slot: bool  # no kept copy: each gather casts this rank's chunks straight into its slots
    keep: Optional[bool]  # a kept compute-dtype shard (model_weight), cast once per weights version; None: not yet
    keep_when_regathered: bool  # keep=None: start keeping it at the third gather of the same weights
    synced_version: Optional[tuple] = None  # the weights version the model weight was cast from


def _cast_state(needs_cast: bool, cache: Optional[bool], offloaded: bool) -> CastState:
    """``cache_model_weight``'s rule. An offloaded group's compute-dtype shard is made on the host (offload.py): each
    gather copies it into this rank's slots (the GPU holds no shard, as FSDP2's offload), or, with
    cache_model_weight=True, it is kept on the device, copied once per weights version."""
    if offloaded:
        return CastState(in_slot=not cache, keep=bool(cache), keep_when_regathered=False)
    return CastState(in_slot=needs_cast and not cache, keep=needs_cast and cache,  # None (auto): see note_gather
                     keep_when_regathered=needs_cast and cache is None)


def _new_main_weight(g: ParamGroup, device: torch.device) -> FlatBuffer:
    """The main weight's buffer: in host memory for an offloaded group (off the meta device), else on ``device``."""
    if g.offload is not None and device.type != "meta":
        return g.offload.buffer(g.layout, g.dtype, g.rank)
    return FlatBuffer(g.layout, g.dtype, device, rank=g.rank)


class ParamGroup:
    fp8 = False  # FP8 model weights (Fp8ParamGroup, fp8_group.py)

    def __init__(self, params: list[tuple[str, nn.Parameter, list[ParamPlace]]], *, mesh: GroupMesh,
                 dtypes: GroupDtypes, device: torch.device, cache_model_weight: Optional[bool] = None,
                 reduce_when_ready: bool = False, dims: Optional[dict[int, int]] = None,
                 spmd: Optional[placements.SpmdDims] = None, offload: Optional[HostOffload] = None):
        """``params``: (fqn, parameter, its places) of the same dtype and requires_grad. ``dims``: id(parameter) ->
        the dim it is sharded on, where not 0; ``spmd``: the full SPMD mesh the parameters are DTensors on
        (dp_mesh_dims; ``mesh.mesh`` is its data-parallel part); ``offload``: main weight and gradient in host
        memory (offload.py)."""
        first = params[0][1]
        self.dtype, self.requires_grad = first.dtype, first.requires_grad
        self.mesh, self.shard_group, self.replicate_group = mesh.mesh, mesh.shard, mesh.replicate
        self.world = dist.get_world_size(mesh.shard) if mesh.shard is not None else 1
        self.rank = dist.get_rank(mesh.shard) if mesh.shard is not None else 0
        self.device = device
        self.offload = offload  # this group's own: it also holds the compute-dtype shard in host memory
        self.compute_dtype, self.reduce_dtype = dtypes.compute, dtypes.reduce
        # the gradients' dtype on the wire: reduce_dtype (a reduce-scatter), or narrower (an all-to-all, then a sum in
        # reduce_dtype here: collectives.PlainReduceScatter)
        self.reduce_comm_dtype = dtypes.reduce_comm or dtypes.reduce
        self.stats = GroupStats()
        self.unit: Optional[weakref.ref] = None  # the FsdpUnit that owns the group (set by the unit)
        self.infos = [ParamInfo(fqn, places, p.shape, p._spec if isinstance(p, DTensor) else None,
                                (dims or {}).get(id(p), 0), spmd) for fqn, p, places in params]
        # the flat buffers hold each rank's local tensors: a tensor-parallel parameter's TP shard, split again here
        self.layout = FlatLayout([rows.local_tensor(p).shape for _, p, _ in params], self.world,
                                 dims=[info.dim for info in self.infos])
        self.plan = GatherPlan(self.layout, self.rank, self.world)
        self.versions = WeightVersions()
        self.grads = GroupGradients(self, dtype=dtypes.main_grad,
                                    reduce_when_ready=reduce_when_ready and self.requires_grad)
        storage_device = torch.device("meta") if first.device.type == "meta" else device
        self.main_weight = _new_main_weight(self, storage_device)
        if storage_device.type != "meta":
            rows.load_main_weight(self, [rows.local_tensor(p) for _, p, _ in params])
        self.cast = _cast_state(dtypes.compute != self.dtype, cache_model_weight, offload is not None)
        self.model_weight = self._make_model_weight(storage_device)
        self.unsharded = self._make_unsharded(storage_device)
        self.use_collectives(plain_collectives())  # lazy init gives each group its own (comm/policy.py)
        self._make_params()
        self.free_unsharded()

    @property
    def replicated(self) -> bool:
        """no_shard: every rank holds every row; gathered once, kept."""
        return self.shard_group is None

    @property
    def sums_on_arrival(self) -> bool:
        """The gradients travel narrower than they are summed (reduce_comm_dtype): an all-to-all over several
        ranks, then the sum in reduce_dtype here, instead of a reduce-scatter."""
        return self.reduce_comm_dtype != self.reduce_dtype and self.world > 1

    # ------------------------------------------------------------------ setup
    def _make_model_weight(self, device: torch.device) -> Optional[FlatBuffer]:
        """The kept compute-dtype shard (None when the group needs no cast or casts at every gather)."""
        if not self.cast.keep:
            return None
        return FlatBuffer(self.layout, self.compute_dtype, device, rank=self.rank)

    def _make_unsharded(self, device: torch.device) -> FlatBuffer:
        """The buffer the module computes with; a replicated group with no cast computes on its main weight (unless
        that is in host memory)."""
        if self.replicated and self.compute_dtype == self.dtype and self.offload is None:
            return self.main_weight
        return FlatBuffer(self.layout, self.compute_dtype, device)

    def as_dtensor(self, i: int, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's torch.chunk rows of parameter i) as the DTensor it is. Gradients are wrapped
        again at every step after zero_grad lets them go: the spec is made once per (parameter, dtype) and the
        DTensor built from it directly (as FSDP2 does; ~2 us against ~17 us for DTensor.from_local)."""
        info = self.infos[i]
        spec = info.specs.get(local.dtype)
        if spec is None:
            spec = info.specs[local.dtype] = placements.sharded_spec(self.mesh, self.replicated, info.tp_spec,
                                                                     info.shape, local.dtype, info.dim, info.spmd)
        return DTensor(local, spec, requires_grad=False)

    def _make_params(self) -> None:
        registry.bump_buffers_generation()
        for i, info in enumerate(self.infos):
            info.sharded = nn.Parameter(self.as_dtensor(i, self.main_weight.param_alias(i)),
                                        requires_grad=self.requires_grad)
            registry.GROUP_OF_PARAM[info.sharded] = (weakref.ref(self), i)
            if self.grads.dtype != self.dtype and hasattr(info.sharded, "grad_dtype"):
                info.sharded.grad_dtype = self.grads.dtype  # torch >= 2.13 checks .grad's dtype against it
            view = self.unsharded.param_view(i)
            if info.tp_spec is not None:  # the module computes with its tensor-parallel DTensor, gathered over dp
                view = DTensor(view, placements.with_dtype(info.tp_spec, view.dtype), requires_grad=False)
            info.unsharded = nn.Parameter(view, requires_grad=self.requires_grad)
            if self.grads.reduce_when_ready:
                info.unsharded.register_post_accumulate_grad_hook(self.grads.accumulated_hook())
        self._bind_plan()

    def _bind_plan(self) -> None:
        self.plan.bind(self.gather_source(), self.unsharded)

    def rebuild(self, device: torch.device, dtype: Optional[torch.dtype] = None,
                dtypes: Optional[GroupDtypes] = None) -> None:
        """New flat buffers and parameters: real (uninitialised) storage on ``device`` for a group still on meta
        (``to_empty``: values come from init), or the main weights cast to ``dtype`` with the group's dtypes now
        ``dtypes`` (``module.to(dtype)`` after fully_shard, as FSDP2 casts its sharded parameters). Gradients and
        casts of the old buffers are dropped; an optimizer holding the old parameters is refused at its step."""
        on_meta = self.main_weight.data.is_meta
        if not on_meta and dtype is None:
            return
        old = self.main_weight
        self.device, self.dtype = device, dtype or self.dtype
        self.main_weight = _new_main_weight(self, device)
        self.main_weight.data.zero_() if on_meta else self.main_weight.data.copy_(old.data)
        if dtypes is not None:
            self.compute_dtype, self.reduce_dtype = dtypes.compute, dtypes.reduce
            self.reduce_comm_dtype, self.grads.dtype = dtypes.reduce_comm or dtypes.reduce, dtypes.main_grad
            self.cast = _cast_state(self.compute_dtype != self.dtype, False, self.offload is not None)
            self.grads.replica_summed = False  # the new parameters have no .grad: the next reduction starts afresh
        self.model_weight = self._make_model_weight(device)
        if self.offload is not None:
            self.offload.forget_weight()
        self.versions.forget_gathers()
        self.unsharded = self._make_unsharded(device)
        self.cast.synced_version = None
        when = "on the meta device, before to_empty()" if on_meta else f"in {old.dtype}, before .to({self.dtype})"
        for info in self.infos:  # the parameters are replaced: an optimizer holding them is caught at its step
            replaced.note_replaced(info.sharded, f"'{info.fqn}'", when)
            info.specs.clear()
        self._make_params()
        self.free_unsharded()

    def use_collectives(self, collectives: GroupCollectives) -> None:
        """Communicate through ``collectives`` (comm/policy.py chooses them): the all-gather and reduce-scatter, and
        the transport of FP8 groups' own gather and scale all-reduce over the shard group."""
        self.collectives = collectives
        registry.bump_buffers_generation()

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
        """The version of this group's main weights ([Note: weights version] in versions.py). ``pending_step``:
        inside an optimizer step, the version the weights will have once that step is counted."""
        return self.versions.current(self.infos, self.main_weight.data, pending_step)

    def note_gather(self, version: tuple) -> None:
        """A training gather (not evaluation). cache_model_weight=None: start keeping the compute-dtype shard once
        the same weights are gathered a third time. From then on each further gather saves a cast; a run without
        microbatches never pays the copy's memory."""
        if not self.cast.keep_when_regathered or not self.versions.gathered_third_time(version):
            return
        self.cast = CastState(in_slot=False, keep=True, keep_when_regathered=False)
        self.model_weight = self._make_model_weight(self.device)
        self.plan.bind_source(self.gather_source())  # the all-gather now sends the copy

    def sync_model_weight(self, version: tuple) -> None:
        """Cast main_weight into model_weight (one fused kernel) unless it was cast at this weights_version().
        Offloaded: cast on the host (HostOffload.sync_weight), then copied into a kept model_weight (on this
        stream)."""
        if self.cast.synced_version == version or (self.model_weight is None and self.offload is None):
            return
        if self.offload is not None:
            self.stats.casts_ahead_taken += self.offload.sync_weight(self.main_weight, self.compute_dtype, version)
            if self.model_weight is not None:
                self.offload.upload(self.offload.weight.data, self.model_weight.data)
        else:
            _native.cast(self.main_weight.data, self.model_weight.data)
        self.cast.synced_version = version
        self.stats.weight_syncs += 1

    def gather_source(self) -> FlatBuffer:
        """The shard the all-gather sends: the compute-dtype copy, or the main weight when no cast is needed."""
        return self.model_weight if self.model_weight is not None else self.main_weight

    # ------------------------------------------------------------------ gathers
    def all_gather(self, op: Optional[AllGather] = None) -> None:
        """Gather every rank's compute-dtype shard into the param-major unsharded buffer, with this group's
        all-gather (or ``op``), on the current stream."""
        with torch.autograd._unsafe_preserve_version_counter(self.gather_targets()):
            self.unsharded.alloc()
            (op or self.collectives.all_gather)(self)
        self.gather_end()

    def gather_together_key(self) -> Optional[tuple]:
        """Groups with the same key share one all-gather call (their op's ``gather_together``: e.g. a unit's plain
        gathers over one transport and shard group); None: this group gathers by itself."""
        return self.collectives.all_gather.together_key(self)

    def gather_targets(self) -> tuple[torch.Tensor, ...]:
        """The buffers a gather writes: their autograd version counters must not move (the backward saved views)."""
        return (self.unsharded.data,)

    def gather_begin(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The plain all-gather up to its collective: the buffer allocated, this rank's chunks cast into their slots
        where no compute-dtype shard is kept; returns the collective's (outputs, inputs)."""
        self.unsharded.alloc()
        self.plan.staged_pending = self.plan.staged
        if self.cast.in_slot:
            self.cast_into_own_slots()
            return self.plan.gather_outputs, self.plan.own_unsharded_slots
        return self.plan.gather_outputs, self.plan.gather_inputs

    def gather_end(self) -> None:
        """After the all-gather's collective (issued, on this stream)."""
        if self.plan.staged_pending:  # the plain gather landed dim > 0 splits in the staging area
            self.plan.unstage(self.unsharded)
            self.plan.staged_pending = False
        self.stats.all_gathers += 1
        if not self.replicated:
            self.stats.all_gather_bytes += self.plan.gathered_bytes(self.compute_dtype)

    def write_shard(self, out: torch.Tensor, start: int = 0) -> None:
        """This rank's compute-dtype shard into ``out``, a flat buffer in the shard layout: from shard element
        ``start`` on, as many as ``out`` holds (the copy engines move a large shard in pieces)."""
        window = slice(start, start + out.numel())
        if self.cast.in_slot and self.offload is not None:
            self.offload.upload(self.offload.weight.data[window], out)
        elif self.cast.in_slot:
            _native.cast(self.main_weight.data[window], out)
            self.stats.weight_syncs += start == 0
        else:
            out.copy_(self.gather_source().data[window])

    def cast_into_own_slots(self) -> None:
        """This rank's compute-dtype chunks straight into its slots of the unsharded buffer (one native cast;
        offloaded: one copy per parameter from the host's compute-dtype shard)."""
        if self.offload is not None:
            self.offload.upload_slots(self.plan.gathered, self.plan.own_unsharded_slots)
            return
        _native.unpack(self.main_weight.data, self.plan.shard_offsets, self.plan.own_unsharded_slots)
        self.stats.weight_syncs += 1

    def free_unsharded(self) -> None:
        if not self.replicated:  # a replicated group keeps its gathered weights (its main weight, maybe)
            self.unsharded.free()
