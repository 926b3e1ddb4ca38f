"""CUDA graph capture of a root's forward and backward (``torch.cuda.graph`` around them, the optimizer outside, as
torchtitan captures FSDP2), and what a capture may not contain.

A captured region is replayed without running any of our Python, so everything the graph does must be decided
at capture as it must be at every replay:
  * the capture starts from rest: no gather issued outside it is waited for inside it (an event recorded outside
    a capture invalidates it), and every unit casts and gathers its current weights (a new weights epoch: a
    replay follows an optimizer step, so no cast of the last eager step may be reused); only under
    mfsdp_ext.graphed, whose graph ends with the optimizer step, the forward's first units are held instead: the
    graph reads them gathered and its optimizer step gathers them for the next replay (graphs.py);
  * the gradient shards the graph writes (made in the capture, or kept from before it) are kept alive by their
    groups, and their ``.grad`` views must stay in place between replays (group_grads.py);
  * work that waits on the host (the finite-gradients check, the unused-parameter mask) is refused by name, and so
    is CPU offload (its optimizer step and gradient sums run on the host);
  * lazy initialisation (communicators, the same-model check) happens before, in an eager step.
"""

from __future__ import annotations

from ..core.states import ShardedState
from ..fp8.linear import forget_last_input
from .context import FsdpContext


class CaptureError(RuntimeError):
    """What a CUDA graph capture of a fully_shard model may not contain, named."""


def enter(ctx: FsdpContext, capture_id: int) -> None:
    """The root's forward starts under the capture ``capture_id`` (once per captured region): bring the tree to
    the state every replay starts from. The capture's ``torch.cuda.graph`` synchronized the device, so dropping the
    events of earlier gathers and freeing their buffers waits for nothing."""
    refuse_offload(ctx, "captured in a CUDA graph")
    if ctx.microbatch.explicit and not ctx.microbatch.is_first:
        raise CaptureError("mfsdp_ext: a capture starts at microbatch(is_first=False); capture the whole "
                           "accumulation, from its first microbatch")
    if ctx.root.config.check_finite_grads:
        raise CaptureError("mfsdp_ext: check_finite_grads=True cannot be captured in a CUDA graph (it waits on the "
                           "host for the reduced gradients); check torch.isfinite of the grad norm after a replay "
                           "instead, or turn it off")
    held = _held_with_current_weights(ctx)
    for unit in ctx.units:
        if not unit.reduction.reduce_scatter_unused_params:
            raise CaptureError(f"mfsdp_ext: unit '{unit.name}' has set_reduce_scatter_unused_params(False), whose "
                               "mask of used parameters waits on the host; it cannot be captured in a CUDA graph "
                               "(keep the default, True)")
        for g in unit.groups:
            g.grads.keep_for_graph()  # gradients kept from before the capture: the graph accumulates into them
        unit.unshard_event = None
        if unit.sharded_state is not ShardedState.SHARDED and not unit.config.strategy.keeps_weights_gathered:
            unit.reshard()
    ctx.iteration.weights_epoch += 1  # every cast and gather is captured ...
    for unit, versions in held.items():  # ... but the held units': they hold this epoch's weights already
        now = unit.current_versions()
        for g, before, after in zip(unit.groups, versions, now):
            if g.cast.synced_version == before:
                g.cast.synced_version = after
        unit.gathered_versions = now
    ctx.capture.id, ctx.capture.graphed = capture_id, True
    ctx.capture.user_captured |= ctx.capture.graphed_step is None
    forget_last_input()


def refuse_offload(ctx: FsdpContext, what: str) -> None:
    """Raise CaptureError when a unit of ``ctx`` offloads its weights to the host (params/offload.py): the copies
    between host and device and the host's work on the gradients are not CUDA work a graph could replay."""
    unit = next((u for u in ctx.units if any(g.offload is not None for g in u.groups)), None)
    if unit is not None:
        raise CaptureError(f"mfsdp_ext: unit '{unit.name}' has offload_policy=CPUOffloadPolicy(), which cannot be "
                           f"{what}: its gradients are summed and its optimizer steps on the host. Train it eagerly, "
                           "or pass offload_policy=None (the default) to capture it")


def _held_with_current_weights(ctx: FsdpContext) -> dict:
    """The units held by the mfsdp_ext.graphed step capturing (it gathered them just before) -> their versions:
    its graph reads them as they are, and its optimizer step gathers them for the next replay. A unit another
    graphed step holds is gathered in this capture like any other (into the storage it keeps), and so is every
    unit in a capture of the user's: nothing in it would gather them for the next replay."""
    held = {}
    for unit in ctx.units:
        if not unit.is_held_by(ctx.capture.graphed_step):
            continue
        versions = unit.current_versions()
        if unit.sharded_state is ShardedState.UNSHARDED and unit.gathered_versions == versions:
            held[unit] = versions
        else:
            unit.held_by = None
    return held


def leave(ctx: FsdpContext) -> None:
    """The root's first forward outside the capture."""
    ctx.capture.id = 0
    forget_last_input()
