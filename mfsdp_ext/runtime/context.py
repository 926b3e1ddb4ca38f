"""FsdpContext: the data the units of one root subtree share.

The streams and the device handle, the execution order of the units (recorded each iteration and used by the
next one for prefetching), the microbatch flags, whether the backward has begun, and the symmetric-memory
stages. It holds data only: the root unit drives the iteration (see FsdpUnit).
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Optional, Protocol

import torch

from ..core.device import DeviceHandle

if TYPE_CHECKING:
    from ..comm.copy_engine import CopyEngineStage
    from ..comm.symmetric.collectives import SymmetricStages


class FsdpUnit(Protocol):
    """What the context needs of a unit (unit.py's FsdpUnit): it orders units and tells them apart."""

    name: str


class FsdpContext:
    _LIVE: "weakref.WeakSet[FsdpContext]" = weakref.WeakSet()
    _SERIALS = itertools.count()

    @classmethod
    def live(cls) -> list["FsdpContext"]:
        """The contexts of the roots alive in this process, oldest first (mfsdp_ext.graphed watches their modes and
        gathers their first units: in the same order on every rank, as a set's order is not)."""
        return sorted(cls._LIVE, key=lambda ctx: ctx.serial)

    def __init__(self, root: "FsdpUnit", units: list["FsdpUnit"], device: torch.device):
        self.serial = next(FsdpContext._SERIALS)
        FsdpContext._LIVE.add(self)
        self.root = root
        self.units = units
        self.device = DeviceHandle(device)
        self.ag_stream = self.device.new_stream()  # None on CPU: program order
        self.rs_stream = self.device.new_stream()
        # Execution order: recorded in this iteration's forward, used for prefetching in the next. Units are
        # recorded when their forward starts (forward prefetch) and when it ends: backward runs in the reverse
        # of the end order (the root's tail, e.g. the LM head, first; then the last block). An iteration starts
        # at the root's forward, so units run after it (a chunked loss's head, with backwards of its own) are
        # recorded with it.
        self.forward_order: list["FsdpUnit"] = []
        self.prev_forward_order: list["FsdpUnit"] = []
        self.forward_end_order: list["FsdpUnit"] = []
        self.prev_forward_end_order: list["FsdpUnit"] = []
        # Microbatch flags (see api.microbatch): first -> sync main->model weights; last -> finish reductions.
        self.is_first_microbatch = True
        self.is_last_microbatch = True
        self.explicit_microbatch = False
        self.in_backward = False  # from the first pre-backward hook to the final callback
        self.iteration_open = False  # from the root's forward to the end of a backward (or an abandoned iteration)
        self.iterations = 0  # root forwards so far (mfsdp_ext.graphed: which models a step uses)
        self.capture_id = 0  # the CUDA graph capture the root's forward last ran in; 0: none (capture.py)
        self.graphed = False  # some capture happened: replays, not our hooks, run those steps
        self.graph_steps: "weakref.WeakSet" = weakref.WeakSet()  # the mfsdp_ext.graphed steps whose graph runs it
        self.in_graphed_capture = None  # the mfsdp_ext.graphed step capturing it (None: none, or the user's graph)
        self.user_captured = False  # captured by torch.cuda.graph outside mfsdp_ext.graphed
        self.grads_kept = False  # a deferred reduction kept unsharded grads (reduced on the last microbatch)
        # During the root's final callback: the unsharded grads its reductions consumed, dropped only after the
        # compute stream has waited for them (so the optimizer step can reuse that memory at once); None otherwise
        self.grads_freed_at_end: Optional[list] = None
        self.symmetric: Optional["SymmetricStages"] = None  # when some unit uses NCCL symmetric memory
        self.copy_engines: list["CopyEngineStage"] = []  # where some unit's collectives use the copy engines
        self.weights_epoch = 0  # part of every gather's weights version: see note_forward_mode
        self.last_forward_training = True
        self.trained = False  # a training forward ran (the root's, with grad mode on)

    @property
    def capturing(self) -> bool:
        """Inside a CUDA graph capture of the root's forward and backward."""
        return self.capture_id != 0

    def begin_iteration(self, training: bool) -> None:
        """The root's forward starts an iteration: the last iteration's order becomes the one to prefetch by."""
        if self.forward_order:
            self.prev_forward_order = self.forward_order
            self.prev_forward_end_order = self.forward_end_order
        self.forward_order = []
        self.forward_end_order = []
        self.iteration_open = True
        self.iterations += 1
        self._note_forward_mode(training)

    def _note_forward_mode(self, training: bool) -> None:
        """The root's forward starts. In a model that trains, each evaluation forward and the first training
        forward after one start a new epoch of the weights' version, so no cast (kept compute-dtype copy, FP8
        scales) is reused across them: weights written where no version counter sees it (through ``.data``, e.g.
        EMA weights swapped in for an evaluation and back) are cast afresh. Training forwards in a row
        (microbatches) keep reusing casts, and so does a model that only evaluates (a frozen teacher)."""
        if training:
            if not self.last_forward_training:
                self.weights_epoch += 1
            self.trained = True
        elif self.trained:
            self.weights_epoch += 1
        self.last_forward_training = training

    def weight_sync_allowed(self) -> bool:
        """Inside microbatch(is_first=False) the main->model cast is skipped: the weights cannot have changed."""
        return not self.explicit_microbatch or self.is_first_microbatch

    # ------------------------------------------------------------------ execution order
    def record_forward(self, unit: "FsdpUnit") -> None:
        if unit not in self.forward_order:
            self.forward_order.append(unit)

    def next_in_forward(self, unit: "FsdpUnit") -> Optional["FsdpUnit"]:
        order = self.prev_forward_order or self.forward_order
        if unit in order:
            i = order.index(unit)
            return order[i + 1] if i + 1 < len(order) else None
        return None

    def record_forward_end(self, unit: "FsdpUnit") -> None:
        if unit not in self.forward_end_order:
            self.forward_end_order.append(unit)

    def next_in_backward(self, unit: "FsdpUnit") -> Optional["FsdpUnit"]:
        order = self.forward_end_order
        if unit in order:
            i = order.index(unit)
            return order[i - 1] if i > 0 else None
        return None

    def needed_first_in_backward(self, unit: "FsdpUnit") -> bool:
        """The unit whose forward ended last before the root's: backward needs it right after the root, so
        resharding it after forward would only gather it again at once (judged from the last iteration)."""
        order = self.prev_forward_end_order
        return len(order) >= 2 and order[-1] is self.root and order[-2] is unit

    def needed_first_in_next_microbatch(self, unit: "FsdpUnit") -> bool:
        """Inside microbatch(is_last=False), the first two units of the forward (the root and the unit it
        prefetches) keep their weights gathered after backward: the next microbatch's forward then starts without
        waiting for their all-gathers. Its weights are this step's (is_first=False casts nothing; a changed
        weights version gathers again), and that forward holds these two gathered at its start anyway."""
        return self.explicit_microbatch and not self.is_last_microbatch and unit in self.forward_order[:2]

    def units_in_finish_order(self) -> list["FsdpUnit"]:
        """Every unit, those that ran in reverse forward order first (the order their backward ran in)."""
        ran = list(reversed(self.forward_order or self.units))
        ran_ids = {id(u) for u in ran}
        return ran + [u for u in self.units if id(u) not in ran_ids]

    def end_iteration(self) -> None:
        """A backward ended (or an iteration was abandoned): the units are at rest. The recorded order stays until
        the root's next forward, for the backwards of units run after the root's forward."""
        self.iteration_open = False
        self.in_backward = False
        self.grads_freed_at_end = None  # after the streams joined (final callback, or an abandoned iteration)
