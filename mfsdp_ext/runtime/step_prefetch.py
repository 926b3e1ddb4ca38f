"""Gather the next forward's first units inside the optimizer step that changes their weights.

A step's forward starts with the all-gathers of its first two units (the root and the unit it prefetches), and
nothing else is on the GPU to hide them under (measured: ~1.3 ms of idle GPU at the start of configs 1 and 4).
mfsdp_ext's flat optimizers step those units' groups first, then issue their all-gathers on the all-gather stream,
where they run under the other groups' optimizer kernels. The next forward finds the weights gathered for the
version they will have once this step is counted, and waits only for the gather's event.

It applies when the optimizer steps every trainable group of a root's tree between iterations: a later step of
another optimizer would change the weights version and the forward would gather again (correct, but twice).
Anything that changes the weights after the step (a load, an in-place write, an evaluation forward's new
epoch) changes the version too, and the forward gathers again. Cost: the two units' gathered weights are held
from the step on instead of from the forward's start.

In mfsdp_ext.graphed's whole-step graph the same gathers are captured: its first units are held (never freed),
each replay's forward reads them and its optimizer step gathers them for the next replay (graphs.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.states import TrainingState

if TYPE_CHECKING:
    from ..params.group import ParamGroup
    from .unit import FsdpUnit

FIRST_UNITS = 2  # the root and the unit its forward prefetches


class NextForwardGather:
    """The units whose gathers a step issues, and their groups (stepped first)."""

    def __init__(self, units: list[FsdpUnit]):
        self.units = units
        self.groups = {g for u in units for g in u.groups}

    def order(self, stepped: list[ParamGroup]) -> tuple[list[ParamGroup], list[ParamGroup]]:
        """(the first units' groups, the others), each in the given order."""
        return [g for g in stepped if g in self.groups], [g for g in stepped if g not in self.groups]

    def issue(self) -> None:
        """After the first units' groups were stepped (kernels queued on the current stream): their all-gathers,
        on the all-gather stream once those kernels are done."""
        for unit in self.units:
            unit.unshard(after_step=True)


def plan(stepped: list[ParamGroup]) -> NextForwardGather | None:
    """The gathers to issue in a step over ``stepped`` groups, or None when the step covers no root's whole tree
    or a tree is not between iterations (the first forward has not run, or a backward is under way)."""
    covered = set(stepped)
    units, seen = [], set()
    for g in stepped:
        unit = g.unit() if g.unit is not None else None
        ctx = unit.context if unit is not None else None
        if ctx is None or ctx in seen:
            continue
        seen.add(ctx)
        order = ctx.order.forward or ctx.order.prev_forward  # the last iteration's
        if ctx.capture.graphed:
            # in mfsdp_ext.graphed's capture: the units its graph holds (their next replay reads them gathered);
            # any other captured forward gathers by itself at every replay: a gather ahead would be lost work
            if ctx.capture.graphed_step is not None:
                units += [u for u in ctx.units if u.is_held_by(ctx.capture.graphed_step)]
            continue
        if ctx.iteration.in_backward or ctx.iteration.open or not order:
            continue
        if any(u.training_state is not TrainingState.IDLE for u in ctx.units):
            continue
        if all(x in covered for u in ctx.units for x in u.groups if x.requires_grad and x.trainable()):
            units += order[:FIRST_UNITS]
    return NextForwardGather(units) if units else None
