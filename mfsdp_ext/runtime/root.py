"""What the root unit does for its whole tree: build the shared context at its first forward (lazy init), end each
iteration after the backward (the final callback), and abandon an iteration whose backward never completed.

[Note: held units]
A unit is "held" by an ``mfsdp_ext.graphed`` step (``unit.held_by``) when that step's graph reads its weights gathered
at the start of every replay and the step's optimizer gathers them for the next one: a held unit never frees its
gathered storage (reshard only swaps the parameters back), and an iteration's end leaves it gathered.
"""

from __future__ import annotations

import torch

from ..comm.policy import assign_collectives
from ..core.states import TrainingState
from ..params import assigned, offload
from . import capture, finite_grads, same_model, summary
from .context import FsdpContext


def lazy_init(unit) -> FsdpContext:
    """The context of ``unit``'s tree, built at the first forward of its root (``unit``): every rank checks that it
    shards the same model (one collective, before any other), then the collectives are chosen (comm/policy.py)."""
    if unit.context is not None:
        return unit.context
    if unit.config.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise capture.CaptureError("mfsdp_ext: the first forward of a fully_shard model runs collectives and "
                                   "host checks (lazy initialisation) and cannot be captured: run one training "
                                   "step eagerly before capturing")
    if len(unit.modules) > 1:
        raise RuntimeError(f"FSDP requires a single root module but got {unit.name}: the unit over several modules "
                           "ran before a unit that contains them; apply fully_shard to the module that contains them "
                           "too (the root)")
    units, seen = [], set()
    for name, m in unit.module.named_modules():
        u = getattr(m, "_mfsdp_unit", None)
        if u is None or id(u) in seen:
            continue
        if u is not unit and u.context is not None:  # FSDP2's refusal: an inner unit already ran as a root
            raise RuntimeError(f"FSDP state has already been lazily initialized for {name}\nFSDP requires running "
                               "forward through the root module first")
        seen.add(id(u))
        units.append(u)
    refused = [u.refusal for u in units if u.refusal is not None]
    if refused:  # before any collective: every rank raises alike
        raise ValueError(refused[0])
    mesh = next((g.mesh for u in units for g in u.groups), None)
    if mesh is not None:  # first: every rank reaches it, before any other collective of the units
        same_model.check(unit.module, units, mesh, unit.config.device)
    for u in units:
        assigned.take_assigned(u.groups)  # parameters assigned after fully_shard (FSDP2 takes them up here too)
        if any(g.main_weight.data.is_meta for g in u.groups):
            raise RuntimeError(f"mfsdp_ext: unit '{u.name}' still has parameters on the meta device. Materialize "
                               "the model first: model.to_empty(device=...) then mfsdp_ext.reset_parameters(model).")
    inner = [u.name for u in units if u.config.check_finite_grads and u is not unit]
    if inner and not unit.config.check_finite_grads:
        raise ValueError(f"mfsdp_ext: check_finite_grads=True was given to the inner unit '{inner[0]}'; it "
                         "applies to a whole tree: pass it to fully_shard of the root module")
    ctx = FsdpContext(unit, units, unit.config.device)
    for u in units:
        u.context = ctx
    ctx.comm = assign_collectives([(u.config.comm, u.groups) for u in units], ctx.device)
    if summary.wanted(unit.config.verbose):
        summary.print_summary(unit.module, units)
    return ctx


def lazy_init_tree(unit) -> FsdpContext:
    """The context of ``unit``'s tree, initialised from its outermost unit when the first call comes before any
    forward (FSDP2's ``unshard()`` / ``reshard()`` may come first, on any unit: pipelining unshards every unit of a
    stage before its first forward): the unit joins its root's context instead of starting one of its own."""
    if unit.context is None:
        top = unit
        while top.parent is not None and top.parent() is not None:
            top = top.parent()
        lazy_init(top)
    return unit.context


def final_callback(root) -> None:
    """After the whole backward: finish every unit's reduction, wait for the streams, bring units to rest."""
    ctx = root.context
    # Freed in stream order below rather than by record_stream, whose lazy release would count the last
    # reductions' grads (the root's embedding and head) in the optimizer step's peak.
    ctx.iteration.grads_freed_at_end = []
    for unit in ctx.order.finish_order(ctx.units):
        state = unit.training_state
        if ctx.iteration.late_backward and state in (TrainingState.FORWARD, TrainingState.IDLE):
            continue  # not reached: its backward is still to come; as its forward left it (FSDP2's, too)
        unreduced = state is not TrainingState.POST_BACKWARD and (
            state is not TrainingState.IDLE or any(g.grads.has_unsharded() for g in unit.groups))
        if unreduced:  # e.g. no input needed grads, so no PostBackward ran; or grads from outside a forward
            unit.post_backward()
        else:
            unit.show_sharded_params()
    ctx.device.wait_stream(ctx.rs_stream)
    offload.drain()  # offloaded gradients are in their host shards (.grad complete when backward returns)
    if ctx.capture.capturing:  # a gather issued ahead for a unit whose backward did not come still joins the capture
        ctx.device.wait_stream(ctx.ag_stream)
    _end_iteration(ctx)
    if root.config.check_finite_grads:  # after the iteration ended: a caught error leaves every unit at rest
        finite_grads.check(root.module, ctx.units)


def abandon_iteration(root) -> None:
    """End an iteration whose backward did not complete (evaluation, or a forward or backward that raised):
    gradients not yet reduced are dropped (the training loop zeroes the rest, as after any failed step) and
    every unit is brought to rest, so the next iteration starts as if this one had not happened."""
    ctx = root.context
    for unit in ctx.units:
        if unit.training_state is TrainingState.PRE_BACKWARD:
            for g in unit.groups:
                g.grads.drop_unsharded()
        if unit.training_state is TrainingState.FORWARD and (
                (unit.is_root and not unit.controls.reshard_root) or not unit.controls.reshard_after_forward):
            continue  # as its forward left it (FSDP2's: a next forward, e.g. a pipeline's microbatch, finds it so)
        # a unit that stays gathered keeps the event of a gather the failed pass issued (e.g. a backward
        # prefetch) and not yet waited for: its next forward waits for it instead of reading the buffer early
        unit.show_sharded_params()
    ctx.device.wait_stream(ctx.rs_stream)  # reductions the failed backward started
    offload.drain()
    _end_iteration(ctx)


def _end_iteration(ctx: FsdpContext) -> None:
    ctx.end_iteration()
    for unit in ctx.units:
        unit.end_iteration()
