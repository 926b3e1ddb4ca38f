"""FsdpUnit: the per-module state machine of one ``fully_shard``ed module, and its hooks.

Lifecycle of a unit in one iteration (ZeRO-3), with the training state each hook enters:
  pre-forward     FORWARD: make the model weights current, all-gather (or wait for the prefetch), prefetch the
                  next unit
  post-forward    swap back to sharded parameters and free the gathered storage (not the root)
  pre-backward    PRE_BACKWARD: gather again, prefetch the next unit in backward order
  post-backward   POST_BACKWARD: reduce the gradients (reduction.py), free the gathered storage
  final callback  (root) finish units that had no post-backward, wait for the reduce stream, all back to IDLE
A forward while the context is in backward is an activation-checkpoint recompute: gather, nothing else. What the root
does for the whole tree (lazy init, the final callback) is in root.py; the inputs' and outputs' plumbing in unit_io.py.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.autograd import Variable

from ..comm.policy import CommPolicy
from ..core.mixed_precision import MixedPrecisionPolicy
from ..core.states import ShardedState, Strategy, TrainingState
from ..params import fp8_group
from ..params.group import ParamGroup
from . import capture, root, unit_io
from .context import FsdpContext
from .post_forward import PostForwardShards
from .reduction import GradReduction


def resolve_reshard_after_forward(value, allow_int: bool = False) -> bool | int:
    """FSDP2's values: True / False, None (FSDP2's default: reshard every unit but the root; UnitControls.reshard_root)
    as True, and where ``allow_int`` (fully_shard; not the setter, as FSDP2) an int:
    reshard to groups of that many ranks (post_forward.py; checked against the mesh there)."""
    if value is None:
        return True
    if isinstance(value, bool) or (allow_int and isinstance(value, int)):
        return value
    raise ValueError(f"reshard_after_forward should be a bool{' or an int' if allow_int else ''}, got {value!r}"
                     f"{'' if allow_int else ' (an int, resharding to a smaller group, is given to fully_shard)'}")


def _autograd_is_running() -> bool:
    """Whether a backward is executing now. Asked only when the root's forward starts while the context is still
    in backward, to tell a recompute of the whole root (inside the backward) from a backward that raised."""
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True)
class UnitConfig:
    """What ``fully_shard`` fixed for a unit."""

    strategy: Strategy
    mp_policy: MixedPrecisionPolicy
    device: torch.device
    comm: CommPolicy = CommPolicy()
    verbose: bool = False  # the root prints the unit summary at its first forward
    check_finite_grads: bool = False  # the root's applies to its whole tree


@dataclass
class UnitControls:
    """FSDP2's per-module controls of the gather schedule (``FsdpModule.set_*``), read by the hooks; the reduction's
    are on GradReduction."""

    reshard_after_forward: bool = True
    # as the root too (FSDP2's: reshard_after_forward given, or set; its default None keeps the root's weights from
    # forward to backward, which needs them first)
    reshard_root: bool = False
    reshard_after_backward: bool = True  # False: keep the gathered storage after backward (show_sharded_params)
    unshard_in_backward: bool = True  # False: its backward needs no weights (an embedding): no gather there
    forward_prefetch: Optional[list] = None  # explicit prefetch lists replace the recorded order
    backward_prefetch: Optional[list] = None
    post_optim_event: Any = None  # set_post_optim_event: the root's next gathers wait for it


class FsdpUnit:
    """One ``fully_shard`` call's unit: its parameter groups, its states and its hooks, over one module or, as
    FSDP2's list form, several (``fully_shard([norm, head])``): one gather and one reduction for all of them.

    ``sharded_state`` changes in unshard() / reshard() only; ``training_state`` in the hooks, and back to IDLE
    when the root ends the iteration (in its final backward callback, or at the next forward after an
    evaluation). The root also builds the context at its first forward (root.lazy_init).
    """

    def __init__(self, modules: list[nn.Module], groups: list[ParamGroup], *, config: UnitConfig,
                 reshard_after_forward: bool | int = True):
        self.modules = modules
        self.module = modules[0]  # a root unit is over one module (lazy_init)
        self.name = "+".join(type(m).__name__ for m in modules)
        self.groups = groups
        self.config = config
        keeps = config.strategy.keeps_weights_gathered
        self.controls = UnitControls(reshard_after_forward=bool(reshard_after_forward) and not keeps)
        # FSDP2's int: the forward's gathered weights kept sharded over groups of N ranks (post_forward.py)
        self.post_forward_shards: Optional[PostForwardShards] = None
        if not keeps and not isinstance(reshard_after_forward, bool):
            self.post_forward_shards = PostForwardShards(groups, reshard_after_forward)
        self.context: Optional[FsdpContext] = None
        self.reduction = GradReduction(config.strategy)  # with FSDP2's controls of the reduction (FsdpModule.set_*)
        self.forward_method_depth = 0  # inside a registered forward method (register_fsdp_forward_method)
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self.post_backward_hooked = False  # PostBackward applied to this iteration's inputs
        self.to_run: set[int] = set()  # this forward pass's modules (ids) that have not run yet
        self.output_hooked = False  # some module's output of this pass got the pre-backward hook
        self.unshard_event: Any = None  # the all-gather stream's event after this unit's gather
        self.gathered_versions: list[Optional[tuple]] = [None] * len(groups)  # weights_version() gathered
        # mfsdp_ext.graphed: the step whose whole-step graph keeps this unit (a first unit of the forward) gathered
        # across replays (its optimizer step gathers it for the next replay): [Note: held units] in root.py
        self.held_by: Optional[weakref.ref] = None
        self.parent: Optional[weakref.ref] = None  # the unit of the closest enclosing fully_shard (api.py sets it)
        self.refusal: Optional[str] = None  # what the first forward raises (a weight tied across two units)
        self.shared_streams = None  # share_comm_ctx: SharedStreams (context.py) of the roots sharing theirs
        self._warned_no_grad_output = False
        for g in groups:
            g.unit = weakref.ref(self)
            if g.grads.reduce_when_ready:
                g.grads.on_ready = self._reduce_early

    @property
    def is_root(self) -> bool:
        return self.context is not None and self.context.root is self

    def lazy_init(self) -> FsdpContext:
        return root.lazy_init(self)

    def set_comm_policy(self, policy: CommPolicy) -> None:
        """Before the first forward (the collectives are chosen there): this unit communicates per ``policy``."""
        self.config = dataclasses.replace(self.config, comm=policy)

    # ------------------------------------------------------------------ unshard / reshard
    def unshard(self, *, after_step: bool = False) -> None:
        """Issue the all-gather of every group on the all-gather stream (does not wait for it); nothing when the
        gathered weights are those of the current main weights. ``after_step``: issued by an optimizer step for
        the next forward (step_prefetch.py): gathers the weights version the step will have once counted."""
        ctx = self.context
        gathered = self.sharded_state is ShardedState.UNSHARDED
        if gathered and not ctx.weight_sync_allowed():
            return
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD and self._gather_post_forward(after_step):
            return
        # once per call: each walks the group's parameters (the epoch: IterationRecord.note_forward_mode)
        versions = [g.weights_version(pending_step=after_step) + (ctx.iteration.weights_epoch,) for g in self.groups]
        # (backward hooks run with grad mode off, and so does the optimizer step)
        training = after_step or torch.is_grad_enabled() or ctx.iteration.in_backward
        if gathered and versions == self.gathered_versions:
            return
        with ctx.device.label(f"mfsdp.unshard {self.name}"), ctx.device.use_stream(ctx.ag_stream):
            together: dict[tuple, list[ParamGroup]] = {}  # one all-gather call per (transport, shard group)
            for i, g in enumerate(self.groups):
                if g.replicated and self.gathered_versions[i] == versions[i]:
                    continue  # replicated groups stay gathered: refreshed only when their weights change
                if training:
                    g.note_gather(versions[i])
                if ctx.weight_sync_allowed() or g.cast.synced_version is None:
                    if g.fp8 and g.cast.synced_version != versions[i]:
                        _sync_fp8_scales(self, g, versions[i], after_step)
                    g.sync_model_weight(versions[i])
                key = g.gather_together_key()
                if key is not None:
                    together.setdefault(key, []).append(g)
                else:
                    g.all_gather()
                self.gathered_versions[i] = versions[i]
            for groups in together.values():  # e.g. a unit's FP8 weights and its bf16 norms and biases
                groups[0].collectives.all_gather.gather_together(groups)
            self.unshard_event = ctx.device.record_event(ctx.ag_stream)
        self.sharded_state = ShardedState.UNSHARDED

    def _gather_post_forward(self, after_step: bool) -> bool:
        """reshard_after_forward=N: gather the weights kept after forward within the small group, if they are still
        the current ones (else the full gather follows). True when gathered."""
        ctx = self.context
        versions = [g.weights_version(pending_step=after_step) + (ctx.iteration.weights_epoch,) for g in self.groups]
        if versions != self.gathered_versions:
            self.post_forward_shards.drop()
            self.sharded_state = ShardedState.SHARDED
            return False
        with ctx.device.label(f"mfsdp.unshard {self.name} (post-forward)"), ctx.device.use_stream(ctx.ag_stream):
            self.post_forward_shards.gather(ctx.device)
            self.unshard_event = ctx.device.record_event(ctx.ag_stream)
        self.sharded_state = ShardedState.UNSHARDED
        return True

    def wait_unshard(self) -> None:
        """Make compute wait for this unit's all-gather only, then compute on the gathered parameters."""
        self.context.device.wait_event(self.unshard_event)
        self.unshard_event = None
        for g in self.groups:
            g.use_unsharded_params()

    def reshard(self, keep_post_forward: bool = False) -> None:
        """Back to sharded parameters and free the gathered storage. Freed in stream order: the next all-gather,
        which may reuse it, first waits for the compute stream (DeviceHandle.use_stream). A unit held for a graph
        keeps its storage: the graph reads and writes it at every replay ([Note: held units]).
        ``keep_post_forward``: after a forward with reshard_after_forward=N, keep this rank's part first."""
        if self.held_for_graph:
            for g in self.groups:
                g.use_sharded_params()
            return
        kept = (keep_post_forward and self.post_forward_shards is not None
                and self.sharded_state is ShardedState.UNSHARDED)
        with self.context.device.label(f"mfsdp.reshard {self.name}"):
            if kept:
                self.post_forward_shards.keep()
            elif self.post_forward_shards is not None:
                self.post_forward_shards.drop()
            for g in self.groups:
                g.use_sharded_params()
                g.free_unsharded()
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD if kept else ShardedState.SHARDED
        self.unshard_event = None

    @property
    def held_for_graph(self) -> bool:
        return self.held_by is not None and self.held_by() is not None

    def is_held_by(self, step) -> bool:
        """Whether the mfsdp_ext.graphed step ``step`` holds this unit (never when ``step`` is None)."""
        return step is not None and self.held_by is not None and self.held_by() is step

    def current_versions(self) -> list[tuple]:
        """The weights version each group's gather would have now (unshard's key)."""
        return [g.weights_version() + (self.context.iteration.weights_epoch,) for g in self.groups]

    def show_sharded_params(self) -> None:
        """After backward (or an evaluation forward): FSDP2's set_reshard_after_backward(False) keeps the gathered
        parameters the module's, as FSDP2 does (pipelining's split backward computes the weight gradients later,
        from the parameters the module holds then). Otherwise the user sees the sharded parameters, and the gathered
        storage is kept only where the strategy keeps it or the next microbatch's forward needs it first (then that
        forward needs no all-gather)."""
        if not self.controls.reshard_after_backward:
            return
        if self.config.strategy.keeps_weights_gathered or self.context.needed_first_in_next_microbatch(self):
            for g in self.groups:
                g.use_sharded_params()
        elif self.sharded_state is not ShardedState.SHARDED:
            self.reshard()

    # ------------------------------------------------------------------ forward hooks
    def pre_forward(self, module, args, kwargs):
        if self.forward_method_depth:  # forward called by a registered method: the method's call holds the gather
            return args, kwargs
        ctx = self.lazy_init()
        if self.is_root:  # a new capture starts from rest, even one right after another (replays between)
            capture_id = ctx.device.capture_id()
            if capture_id != ctx.capture.id:
                capture.enter(ctx, capture_id) if capture_id else capture.leave(ctx)
        if self.is_root and ctx.iteration.in_backward and not _autograd_is_running():
            root.abandon_iteration(self)  # the last backward raised: its final callback never ran
        if ctx.iteration.in_backward:  # activation-checkpoint recompute: gather if needed, no prefetch, no reshard
            self.unshard()
            self.wait_unshard()
            return self._prepare_inputs(args, kwargs, cast=False)
        if self.to_run:  # another module of this unit already ran in this pass: the unit is gathered for it
            self.unshard()
            self.wait_unshard()
            return self._prepare_inputs(args, kwargs, cast=self.config.mp_policy.cast_forward_inputs)
        if self.is_root:
            self._begin_root_forward(ctx)
        self.to_run = {id(m) for m in self.modules}
        ctx.order.record_forward(self)
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_unshard()
        args, kwargs = self._prepare_inputs(args, kwargs, cast=self.config.mp_policy.cast_forward_inputs)
        # Prefetch last, right before this unit computes: the next gather then overlaps this unit's kernels
        # rather than the host's work in this hook.
        for nxt in self._prefetch_targets(self.controls.forward_prefetch, ctx.order.next_in_forward(self)):
            nxt.unshard()
        return args, kwargs

    def _begin_root_forward(self, ctx: FsdpContext) -> None:
        """The root's forward opens an iteration (after ending one the last forward left open)."""
        if ctx.iteration.open:
            root.abandon_iteration(self)  # the last forward had no backward (evaluation) or raised
        if ctx.microbatch.explicit and ctx.microbatch.is_first and ctx.iteration.grads_kept:
            for unit in ctx.units:  # a new accumulation: nothing kept from a sequence that failed midway
                for g in unit.groups:
                    g.grads.drop_unsharded()
            ctx.iteration.grads_kept = False
        ctx.begin_iteration(torch.is_grad_enabled())
        ctx.device.wait_event(self.controls.post_optim_event)
        self.controls.post_optim_event = None

    def _prefetch_targets(self, explicit: Optional[list[FsdpUnit]], default: Any) -> list:
        """The units to gather ahead: the explicit list (set_modules_to_*_prefetch) or the one the recorded order
        names. An explicit unit must be under this unit's root (its gathers use this root's streams)."""
        if explicit is None:
            return [default] if default is not None and default is not self else []
        for u in explicit:
            if u.context is not self.context:
                raise RuntimeError(f"mfsdp_ext: unit '{self.name}' was told to prefetch '{u.name}', which is under "
                                   "another root module; prefetch only units of the same root")
        return [u for u in explicit if u is not self]

    def post_forward(self, module, args, output):
        if self.forward_method_depth:
            return output
        ctx = self.context
        if ctx.iteration.in_backward:
            return output
        if torch.is_grad_enabled():
            # a call after the root's forward ended (a chunked loss's head, run and backpropagated chunk by chunk on
            # detached hidden states) prefetches nothing in its backward: that backward does not reach the units
            # before it, and a gather issued for them would be freed unused (FSDP2 prefetches none there either)
            hook = functools.partial(self._pre_backward, prefetch=ctx.root not in ctx.order.forward_end)
            self.output_hooked |= unit_io.hook_outputs(output, hook)
        self.to_run.discard(id(module))
        if not self.to_run:  # the last of the unit's modules in this pass
            self._end_forward(output)
        if self.is_root:  # a unit over several modules some of which did not run (a chunked loss's head)
            for unit in ctx.units:
                if unit.to_run:
                    unit.to_run.clear()
                    unit._end_forward(output)
        if self.config.mp_policy.output_dtype is not None:
            output = unit_io.cast_floating(output, self.config.mp_policy.output_dtype)
        return output

    def _end_forward(self, output) -> None:
        """The unit's forward pass is over: reshard where the settings say so."""
        ctx = self.context
        if not torch.is_grad_enabled():
            self.show_sharded_params()  # evaluation: nothing will need the gathered weights
            return
        ctx.order.record_forward_end(self)
        if (self.controls.reshard_after_forward and (self.controls.reshard_root or not self.is_root)
                and not ctx.order.needed_first_in_backward(self, ctx.root)):
            if self.output_hooked or not any(g.requires_grad and g.trainable() for g in self.groups):
                self.reshard(keep_post_forward=True)
            elif not self._warned_no_grad_output:  # this unit's backward may still need the weights, with no hook
                self._warned_no_grad_output = True  # to gather them: keep them
                unit_io.warn_no_grad_output(self, output)
        self.output_hooked = False

    def enter_forward_method(self, module, args, kwargs):
        """A registered forward method (register_fsdp_forward_method) starts: the forward hooks run once around
        the whole call; a forward (or another registered method) it calls inside finds the unit gathered."""
        if self.forward_method_depth == 0:
            args, kwargs = self.pre_forward(module, args, kwargs)
        self.forward_method_depth += 1
        return args, kwargs

    def exit_forward_method(self, module, args, output):
        self.forward_method_depth -= 1
        return output if self.forward_method_depth else self.post_forward(module, args, output)

    def _prepare_inputs(self, args, kwargs, cast: bool):
        """The forward inputs, cast to param_dtype (``cast``) and routed through PostBackward once per iteration."""
        dtype = self.config.mp_policy.param_dtype if cast else None
        args, kwargs, hooked = unit_io.prepare_inputs(self, args, kwargs, dtype,
                                                      torch.is_grad_enabled() and not self.post_backward_hooked)
        self.post_backward_hooked |= hooked
        return args, kwargs

    # ------------------------------------------------------------------ backward hooks
    def _pre_backward(self, grad, prefetch: bool = True):
        if self.training_state is TrainingState.PRE_BACKWARD:
            return grad
        # From POST_BACKWARD: a module called several times whose earlier call's inputs needed no grad carries its
        # PostBackward on a later call's inputs, and autograd runs that before the earlier call's backward (and
        # accumulates the parameters' gradients once, after all uses). Gather again; the final callback reduces.
        self.training_state = TrainingState.PRE_BACKWARD
        ctx = self.context
        if not ctx.iteration.in_backward:
            ctx.iteration.in_backward = True
            ctx.iteration.late_backward = not prefetch
            Variable._execution_engine.queue_callback(functools.partial(root.final_callback, ctx.root))
        if self.controls.unshard_in_backward:
            self.unshard()
            self.wait_unshard()
        if prefetch:
            for prev in self._prefetch_targets(self.controls.backward_prefetch, ctx.order.next_in_backward(self)):
                if prev.controls.unshard_in_backward and prev.training_state in (TrainingState.FORWARD,
                                                                                 TrainingState.PRE_BACKWARD):
                    prev.unshard()
        return grad

    def post_backward(self) -> None:
        if self.training_state is TrainingState.POST_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        with self.context.device.label(f"mfsdp.reduce {self.name}"):
            self.reduction.reduce_groups(self.context, self.groups)
        self.show_sharded_params()

    def _reduce_early(self, g: ParamGroup) -> None:
        """A reduce_when_ready group has all its gradients: reduce it now, under the rest of the backward."""
        if self.context is not None and self.context.iteration.in_backward and g.grads.has_unsharded():
            with self.context.device.label(f"mfsdp.reduce {self.name} (ready early)"):
                self.reduction.reduce(self.context, g)

    def end_iteration(self) -> None:
        """The root ended the iteration (root.py): this unit is at rest."""
        self.training_state = TrainingState.IDLE
        self.post_backward_hooked = False
        self.to_run.clear()
        self.output_hooked = False
        for g in self.groups:
            g.grads.ready = 0


def _sync_fp8_scales(unit: FsdpUnit, g: ParamGroup, version: tuple, after_step: bool) -> None:
    """The FP8 group ``g`` needs scales for a new weights version: sync those of every FP8 group of the tree that
    shares its collectives and needs new ones too, in one all-reduce (fp8_group.sync_scales): once per step rather
    than once per group. Every rank decides alike (the versions count the same ops on every rank); a group whose
    weights change after this (a user's write) syncs again by itself at its gather. Inside an optimizer step
    (``after_step``) only this unit's groups: the step has not yet updated the others."""
    ctx = unit.context
    key = (g.shard_group, g.replicate_group, g.collectives.transport)
    groups: list = [g]
    versions = [version]
    for u in [unit] if after_step else ctx.units:
        for other in u.groups:
            if other is g or not other.fp8 or (other.shard_group, other.replicate_group,
                                               other.collectives.transport) != key:
                continue
            v = other.weights_version(pending_step=after_step) + (ctx.iteration.weights_epoch,)
            if other.cast.synced_version != v and (ctx.weight_sync_allowed() or other.cast.synced_version is None):
                groups.append(other)
                versions.append(v)
    fp8_group.sync_scales(groups, versions)
