"""FsdpUnit: the per-module state machine of one ``fully_shard``ed module, and its hooks.

Lifecycle of a unit in one iteration (ZeRO-3), with the training state each hook enters:
  pre-forward     FORWARD: make the model weights current, all-gather (or wait for the prefetch), prefetch the
                  next unit
  post-forward    swap back to sharded parameters and free the gathered storage (not the root)
  pre-backward    PRE_BACKWARD: gather again, prefetch the next unit in backward order
  post-backward   POST_BACKWARD: reduce the gradients (reduction.py), free the gathered storage
  final callback  (root) finish units that had no post-backward, wait for the reduce stream, all back to IDLE
A forward while the context is in backward is an activation-checkpoint recompute: gather, nothing else.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.autograd import Variable

from . import capture, finite_grads, same_model, summary
from ..core import tensor_tree
from ..comm.collectives import all_gather_together
from ..comm.copy_engine import use_copy_engines
from ..comm.native import use_native_collectives
from ..comm.symmetric.choose import choose_symmetric
from .context import FsdpContext
from ..params import fp8_group
from ..core.mixed_precision import MixedPrecisionPolicy
from ..params.group import ParamGroup
from .reduction import GradReduction
from ..core.states import ShardedState, Strategy, TrainingState


def resolve_reshard_after_forward(value) -> bool:
    """FSDP2's values: True / False, and None (FSDP2's default: reshard every unit but the root, which ours never
    reshards after forward anyway) as True. An int (FSDP2: reshard to a smaller group) is refused."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ValueError(f"reshard_after_forward must be True, False or None, got {value!r}; resharding to a "
                         "smaller group after forward (FSDP2's int form) is not supported")
    return value


def _autograd_is_running() -> bool:
    """Whether a backward is executing now. Asked only when the root's forward starts while the context is still
    in backward, to tell a recompute of the whole root (inside the backward) from a backward that raised."""
    return torch._C._current_graph_task_id() != -1


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs once the unit's own backward is complete."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None,) + grads


class FsdpUnit:
    """One ``fully_shard`` call's unit: its parameter groups, its states and its hooks, over one module or, as
    FSDP2's list form, several (``fully_shard([norm, head])``): one gather and one reduction for all of them.

    ``sharded_state`` changes in unshard() / reshard() only; ``training_state`` in the hooks, and back to IDLE
    when the root ends the iteration (in its final backward callback, or at the next forward after an
    evaluation). The root also builds the context at its first forward (lazy_init).
    """

    def __init__(self, modules: list[nn.Module], groups: list[ParamGroup], strategy: Strategy,
                 reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy, device: torch.device,
                 use_symm_mem: bool | str = False, native_collectives: bool = False, verbose: bool = False,
                 check_finite_grads: bool = False, copy_engine_all_gather: bool = False,
                 copy_engine_reduce_scatter: bool = False):
        self.modules = modules
        self.module = modules[0]  # a root unit is over one module (lazy_init)
        self.name = "+".join(type(m).__name__ for m in modules)
        self.groups = groups
        self.strategy = strategy
        self.reshard_after_forward = reshard_after_forward and not strategy.keeps_weights_gathered
        self.mp_policy = mp_policy
        self.device = device
        self.use_symm_mem = use_symm_mem  # False, True or "auto" (resolved at lazy init)
        self.native_collectives = native_collectives  # the groups get the native transport at lazy init
        # the groups get the copy-engine gather and gradient exchange at lazy init
        self.copy_engine_all_gather, self.copy_engine_reduce_scatter = copy_engine_all_gather, copy_engine_reduce_scatter
        self.verbose = verbose  # the root prints the unit summary at its first forward
        self.check_finite_grads = check_finite_grads  # the root's applies to its whole tree
        self.context: Optional[FsdpContext] = None
        self.reduction = GradReduction(strategy)  # with FSDP2's controls of the reduction (FsdpModule.set_*)
        # FSDP2's other per-module controls (FsdpModule.set_*)
        self.reshard_after_backward = True
        self.unshard_in_backward = True  # False: its backward needs no weights (an embedding): no gather there
        self.forward_method_depth = 0  # inside a registered forward method (register_fsdp_forward_method)
        self.post_optim_event = None  # FsdpModule.set_post_optim_event: the root's next gathers wait for it
        self.forward_prefetch: Optional[list["FsdpUnit"]] = None  # explicit prefetch lists replace the recorded order
        self.backward_prefetch: Optional[list["FsdpUnit"]] = None
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self.post_backward_hooked = False  # _PostBackward applied to this iteration's inputs
        self.to_run: set[int] = set()  # this forward pass's modules (ids) that have not run yet
        self.output_hooked = False  # some module's output of this pass got the pre-backward hook
        self.unshard_event = None  # the all-gather stream's event after this unit's gather
        self.gathered_versions: list[Optional[tuple]] = [None] * len(groups)  # weights_version() gathered
        # mfsdp_ext.graphed: the step whose whole-step graph keeps this unit (a first unit of the forward) gathered
        # across replays (its optimizer step gathers it for the next replay): never freed while that step lives
        self.held_by: Optional[weakref.ref] = None
        self._warned_no_grad_output = False
        for g in groups:
            g.unit = weakref.ref(self)
            if g.reduce_when_ready:
                g.on_grads_ready = self._reduce_early

    @property
    def is_root(self) -> bool:
        return self.context is not None and self.context.root is self

    # ------------------------------------------------------------------ lazy init
    def lazy_init(self) -> FsdpContext:
        if self.context is not None:
            return self.context
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise capture.CaptureError("mfsdp_ext: the first forward of a fully_shard model runs collectives and "
                                       "host checks (lazy initialisation) and cannot be captured: run one training "
                                       "step eagerly before capturing")
        if len(self.modules) > 1:
            raise RuntimeError(f"mfsdp_ext: the unit over several modules ({self.name}) ran before a unit that "
                               "contains them: apply fully_shard to the module that contains them too (the root)")
        units = list({id(m._mfsdp_unit): m._mfsdp_unit for m in self.module.modules()
                      if hasattr(m, "_mfsdp_unit")}.values())
        mesh = next((g.mesh for u in units for g in u.groups), None)
        if mesh is not None:  # first: every rank reaches it, before any other collective of the units
            same_model.check(self.module, units, mesh, self.device)
        for unit in units:
            for g in unit.groups:
                if g.on_meta:
                    raise RuntimeError(
                        f"mfsdp_ext: unit '{unit.name}' still has parameters on the meta device. Materialize "
                        "the model first: model.to_empty(device=...) then mfsdp_ext.reset_parameters(model).")
        inner = [u.name for u in units if u.check_finite_grads and u is not self]
        if inner and not self.check_finite_grads:
            raise ValueError(f"mfsdp_ext: check_finite_grads=True was given to the inner unit '{inner[0]}'; it "
                             "applies to a whole tree: pass it to fully_shard of the root module")
        ctx = FsdpContext(self, units, self.device)
        for unit in units:
            unit.context = ctx
        use_native_collectives(units)  # before the symmetric choice, which may replace them
        ctx.symmetric = choose_symmetric(units)
        ctx.copy_engines = use_copy_engines(units, ctx.device)
        if summary.wanted(self.verbose):
            summary.print_summary(self.module, units)
        return ctx

    # ------------------------------------------------------------------ unshard / reshard
    def unshard(self, *, after_step: bool = False) -> None:
        """Issue the all-gather of every group on the all-gather stream (does not wait for it); nothing when the
        gathered weights are those of the current main weights. ``after_step``: issued by an optimizer step for
        the next forward (step_prefetch.py): gathers the weights version the step will have once counted."""
        ctx = self.context
        gathered = self.sharded_state is ShardedState.UNSHARDED
        if gathered and not ctx.weight_sync_allowed():
            return
        # once per call: each walks the group's parameters (the epoch: FsdpContext._note_forward_mode)
        versions = [g.weights_version(pending_step=after_step) + (ctx.weights_epoch,) for g in self.groups]
        # (backward hooks run with grad mode off, and so does the optimizer step)
        training = after_step or torch.is_grad_enabled() or ctx.in_backward
        if gathered and versions == self.gathered_versions:
            return
        with ctx.device.label(f"mfsdp.unshard {self.name}"), ctx.device.use_stream(ctx.ag_stream):
            together: dict[tuple, list[ParamGroup]] = {}  # one all-gather call per (transport, shard group)
            for i, g in enumerate(self.groups):
                if g.replicated and self.gathered_versions[i] == versions[i]:
                    continue  # replicated groups stay gathered: refreshed only when their weights change
                if training:
                    g.note_gather(versions[i])
                if ctx.weight_sync_allowed() or g._synced_version is None:
                    if g.fp8 and g._synced_version != versions[i]:
                        self._sync_fp8_scales(g, versions[i], after_step)
                    g.sync_model_weight(versions[i])
                if g.joins_grouped_gather():
                    together.setdefault((g.transport, g.shard_group), []).append(g)
                else:
                    g.all_gather()
                self.gathered_versions[i] = versions[i]
            for groups in together.values():  # e.g. a unit's FP8 weights and its bf16 norms and biases
                all_gather_together(groups)
            self.unshard_event = ctx.device.record_event(ctx.ag_stream)
        self.sharded_state = ShardedState.UNSHARDED

    def _sync_fp8_scales(self, g: ParamGroup, version: tuple, after_step: bool) -> None:
        """The FP8 group ``g`` needs scales for a new weights version: sync those of every FP8 group of the tree that
        shares its collectives and needs new ones too, in one all-reduce (fp8_group.sync_scales): once per step
        rather than once per group. Every rank decides alike (the versions count the same ops on every rank); a
        group whose weights change after this (a user's write) syncs again by itself at its gather. Inside an
        optimizer step (``after_step``) only this unit's groups: the step has not yet updated the others."""
        ctx = self.context
        key = (g.shard_group, g.replicate_group, g.transport)
        groups, versions = [g], [version]
        for unit in [self] if after_step else ctx.units:
            for other in unit.groups:
                if other is g or not other.fp8 or (other.shard_group, other.replicate_group, other.transport) != key:
                    continue
                v = other.weights_version(pending_step=after_step) + (ctx.weights_epoch,)
                if other._synced_version != v and (ctx.weight_sync_allowed() or other._synced_version is None):
                    groups.append(other)
                    versions.append(v)
        fp8_group.sync_scales(groups, versions)

    def wait_unshard(self) -> None:
        """Make compute wait for this unit's all-gather only, then compute on the gathered parameters."""
        self.context.device.wait_event(self.unshard_event)
        self.unshard_event = None
        for g in self.groups:
            g.use_unsharded_params()

    def reshard(self) -> None:
        """Back to sharded parameters and free the gathered storage. Freed in stream order: the next all-gather,
        which may reuse it, first waits for the compute stream (DeviceHandle.use_stream). A unit held for a graph
        keeps its storage: the graph reads and writes it at every replay."""
        if self.held_for_graph:
            for g in self.groups:
                g.use_sharded_params()
            return
        with self.context.device.label(f"mfsdp.reshard {self.name}"):
            for g in self.groups:
                g.use_sharded_params()
                g.free_unsharded()
        self.sharded_state = ShardedState.SHARDED
        self.unshard_event = None

    @property
    def held_for_graph(self) -> bool:
        return self.held_by is not None and self.held_by() is not None

    def is_held_by(self, step) -> bool:
        """Whether the mfsdp_ext.graphed step ``step`` holds this unit (never when ``step`` is None)."""
        return step is not None and self.held_by is not None and self.held_by() is step

    def current_versions(self) -> list[tuple]:
        """The weights version each group's gather would have now (unshard's key)."""
        return [g.weights_version() + (self.context.weights_epoch,) for g in self.groups]

    def show_sharded_params(self) -> None:
        """The user sees the sharded parameters; the gathered storage is kept only where the strategy keeps it,
        set_reshard_after_backward(False) asked for it, or the next microbatch's forward needs it first (then
        that forward needs no all-gather)."""
        if (self.strategy.keeps_weights_gathered or not self.reshard_after_backward
                or self.context.needed_first_in_next_microbatch(self)):
            for g in self.groups:
                g.use_sharded_params()
        elif self.sharded_state is ShardedState.UNSHARDED:
            self.reshard()

    # ------------------------------------------------------------------ forward hooks
    def pre_forward(self, module, args, kwargs):
        if self.forward_method_depth:  # forward called by a registered method: the method's call holds the gather
            return args, kwargs
        ctx = self.lazy_init()
        if self.is_root:  # a new capture starts from rest, even one right after another (replays between)
            capture_id = ctx.device.capture_id()
            if capture_id != ctx.capture_id:
                capture.enter(ctx, capture_id) if capture_id else capture.leave(ctx)
        if self.is_root and ctx.in_backward and not _autograd_is_running():
            self.abandon_iteration()  # the last backward raised: its final callback never ran
        if ctx.in_backward:  # activation-checkpoint recompute: gather if needed, no prefetch, no reshard
            self.unshard()
            self.wait_unshard()
            return self._prepare_inputs(args, kwargs, cast=False)
        if self.to_run:  # another module of this unit already ran in this pass: the unit is gathered for it
            self.unshard()
            self.wait_unshard()
            return self._prepare_inputs(args, kwargs, cast=self.mp_policy.cast_forward_inputs)
        if self.is_root and ctx.iteration_open:
            self.abandon_iteration()  # the last forward had no backward (evaluation) or raised
        if self.is_root and ctx.explicit_microbatch and ctx.is_first_microbatch and ctx.grads_kept:
            for unit in ctx.units:  # a new accumulation: nothing kept from a sequence that failed midway
                for g in unit.groups:
                    g.drop_unsharded_grads()
            ctx.grads_kept = False
        if self.is_root:
            ctx.begin_iteration(torch.is_grad_enabled())
            ctx.device.wait_event(self.post_optim_event)
            self.post_optim_event = None
        self.to_run = {id(m) for m in self.modules}
        ctx.record_forward(self)
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_unshard()
        args, kwargs = self._prepare_inputs(args, kwargs, cast=self.mp_policy.cast_forward_inputs)
        # Prefetch last, right before this unit computes: the next gather then overlaps this unit's kernels
        # rather than the host's work in this hook.
        for nxt in self._prefetch_targets(self.forward_prefetch, ctx.next_in_forward(self)):
            nxt.unshard()
        return args, kwargs

    def _prefetch_targets(self, explicit: Optional[list["FsdpUnit"]], default: Optional["FsdpUnit"]) -> list:
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
        if ctx.in_backward:
            return output
        if torch.is_grad_enabled():
            self.output_hooked |= self._hook_pre_backward(output)
        self.to_run.discard(id(module))
        if not self.to_run:  # the last of the unit's modules in this pass
            self._end_forward(output)
        if self.is_root:  # a unit over several modules some of which did not run (a chunked loss's head)
            for unit in ctx.units:
                if unit.to_run:
                    unit.to_run.clear()
                    unit._end_forward(output)
        if self.mp_policy.output_dtype is not None:
            output = _cast_floating(output, self.mp_policy.output_dtype)
        return output

    def _end_forward(self, output) -> None:
        """The unit's forward pass is over: reshard where the settings say so."""
        ctx = self.context
        if not torch.is_grad_enabled():
            self.show_sharded_params()  # evaluation: nothing will need the gathered weights
            return
        ctx.record_forward_end(self)
        if self.reshard_after_forward and not self.is_root and not ctx.needed_first_in_backward(self):
            if self.output_hooked or not self._has_trainable_params():
                self.reshard()
            else:  # keep the weights: this unit's backward may still need them, with no hook to gather them
                self._warn_no_grad_output(output)
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
        """The forward inputs, floating-point ones cast to param_dtype (``cast``), and those that need grads routed
        through _PostBackward once per iteration; one flatten of the inputs for both."""
        dtype = self.mp_policy.param_dtype if cast else None
        hook = torch.is_grad_enabled() and not self.post_backward_hooked
        if dtype is None and not hook:
            return args, kwargs
        flat, rebuild = tensor_tree.flatten((args, kwargs))
        if dtype is not None:
            flat = [t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() and t.dtype != dtype else t
                    for t in flat]
        idx = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad] if hook else []
        if idx:
            outs = _PostBackward.apply(self, *[flat[i] for i in idx])
            for i, t in zip(idx, outs):
                flat[i] = t
            self.post_backward_hooked = True
        return rebuild(flat)

    def _hook_pre_backward(self, output) -> bool:
        """Hook the output tensors that require grad (gather again before this unit's backward); False if none.
        A call after the root's forward ended (a chunked loss's head, run and backpropagated chunk by chunk on
        detached hidden states) prefetches nothing in its backward: that backward does not reach the units before
        it, and a gather issued for them would be freed unused when it ends (FSDP2 prefetches none there either)."""
        ctx = self.context
        hook = functools.partial(self._pre_backward, prefetch=ctx.root not in ctx.forward_end_order)
        hooked = False
        for t in tensor_tree.flatten(output)[0]:
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(hook)
                hooked = True
        return hooked

    def _has_trainable_params(self) -> bool:
        return any(g.requires_grad and g.trainable() for g in self.groups)

    def _warn_no_grad_output(self, output) -> None:
        if self._warned_no_grad_output:
            return
        self._warned_no_grad_output = True
        warnings.warn(
            f"mfsdp_ext: unit '{self.name}' has trainable parameters but its output ({type(output).__name__}) holds "
            "no tensor that requires grad where fully_shard looks (tensors in tuples, lists, dicts, dataclasses and "
            "pytree-registered classes). If its output tensors are inside another class, the backward cannot "
            "gather the weights again, so they stay gathered after this forward (more memory; gradients stay "
            "right). Return a supported container, or register the class with torch.utils._pytree. (Warned once "
            "per unit.)", stacklevel=2)

    # ------------------------------------------------------------------ backward hooks
    def _pre_backward(self, grad, prefetch: bool = True):
        if self.training_state is TrainingState.PRE_BACKWARD:
            return grad
        # From POST_BACKWARD: a module called several times whose earlier call's inputs needed no grad carries its
        # _PostBackward on a later call's inputs, and autograd runs that before the earlier call's backward (and
        # accumulates the parameters' gradients once, after all uses). Gather again; the final callback reduces.
        self.training_state = TrainingState.PRE_BACKWARD
        ctx = self.context
        if not ctx.in_backward:
            ctx.in_backward = True
            Variable._execution_engine.queue_callback(ctx.root._final_callback)
        if self.unshard_in_backward:
            self.unshard()
            self.wait_unshard()
        if prefetch:
            for prev in self._prefetch_targets(self.backward_prefetch, ctx.next_in_backward(self)):
                if prev.unshard_in_backward and prev.training_state in (TrainingState.FORWARD,
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
        if self.context is not None and self.context.in_backward and g.has_unsharded_grads():
            with self.context.device.label(f"mfsdp.reduce {self.name} (ready early)"):
                self.reduction.reduce(self.context, g)

    # ------------------------------------------------------------------ the root ends the iteration
    def _final_callback(self) -> None:
        """After the whole backward: finish every unit's reduction, wait for the streams, bring units to rest."""
        ctx = self.context
        # Freed in stream order below rather than by record_stream, whose lazy release would count the last
        # reductions' grads (the root's embedding and head) in the optimizer step's peak.
        ctx.grads_freed_at_end = []
        for unit in ctx.units_in_finish_order():
            state = unit.training_state
            unreduced = state is not TrainingState.POST_BACKWARD and (
                state is not TrainingState.IDLE or any(g.has_unsharded_grads() for g in unit.groups))
            if unreduced:  # e.g. no input needed grads, so no _PostBackward ran; or grads from outside a forward
                unit.post_backward()
            else:
                unit.show_sharded_params()
        ctx.device.wait_stream(ctx.rs_stream)
        if ctx.capturing:  # a gather issued ahead for a unit whose backward did not come still joins the capture
            ctx.device.wait_stream(ctx.ag_stream)
        self._end_iteration()
        if self.check_finite_grads:  # after the iteration ended: a caught error leaves every unit at rest
            finite_grads.check(self.module, ctx.units)

    def abandon_iteration(self) -> None:
        """End an iteration whose backward did not complete (evaluation, or a forward or backward that raised):
        gradients not yet reduced are dropped (the training loop zeroes the rest, as after any failed step) and
        every unit is brought to rest, so the next iteration starts as if this one had not happened."""
        ctx = self.context
        for unit in ctx.units:
            if unit.training_state is TrainingState.PRE_BACKWARD:
                for g in unit.groups:
                    g.drop_unsharded_grads()
            # a unit that stays gathered keeps the event of a gather the failed pass issued (e.g. a backward
            # prefetch) and not yet waited for: its next forward waits for it instead of reading the buffer early
            unit.show_sharded_params()
        ctx.device.wait_stream(ctx.rs_stream)  # reductions the failed backward started
        self._end_iteration()

    def _end_iteration(self) -> None:
        ctx = self.context
        ctx.end_iteration()
        for unit in ctx.units:
            unit.training_state = TrainingState.IDLE
            unit.post_backward_hooked = False
            unit.to_run.clear()
            unit.output_hooked = False
            for g in unit.groups:
                g.grads_ready = 0


def eager_hook(hook: Callable) -> Callable:
    """The hook, run outside any torch.compile'd region: ``torch.compile(module)`` traces the module's hooks too,
    and ours (collectives, stream and state bookkeeping) must run eagerly around the compiled forward, as FSDP2's
    do. Eager calls pay one flag read (no torch._dynamo import); ``FsdpModule.compile()`` swaps in the
    dynamo-disabled hook itself, which dynamo skips without a graph break."""

    @functools.wraps(hook)
    def eager(*args, **kwargs):
        if torch.compiler.is_compiling():
            return torch._dynamo.disable(hook, recursive=True, reason="mfsdp_ext hooks run eagerly")(*args, **kwargs)
        return hook(*args, **kwargs)

    eager.mfsdp_hook = hook
    return eager


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    flat, rebuild = tensor_tree.flatten(tree)
    return rebuild([t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() and t.dtype != dtype else t
                    for t in flat])
