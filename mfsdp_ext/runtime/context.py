"""FsdpContext: what the units of one root share, in the parts it is made of.

  device, ag_stream, rs_stream   the device handle and the all-gather and reduce-scatter streams (None on CPU)
  order                          ExecutionOrder: the order the units ran in (prefetching)
  microbatch                     the flags of ``mfsdp_ext.microbatch`` (first: cast the weights; last: finish the
                                 reductions a strategy defers)
  iteration                      the current iteration's record: in backward, open, counts, the weights epoch
  capture                        CUDA graph capture state (capture.py, graphs.py)
  comm                           the collectives' shared resources (comm/policy.py): symmetric and copy-engine stages

It holds data only: the root unit drives the iteration (runtime/root.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..comm.policy import CommResources
from ..core import registry
from ..core.device import DeviceHandle
from .order import ExecutionOrder, Unit


@dataclass
class MicrobatchFlags:
    """``mfsdp_ext.microbatch``'s flags (api.py): ``explicit`` while inside one."""

    is_first: bool = True
    is_last: bool = True
    explicit: bool = False


@dataclass
class IterationRecord:
    """The current iteration of a root: from its forward to the end of its backward (or until it is abandoned)."""

    open: bool = False  # from the root's forward to the end of a backward (or an abandoned iteration)
    in_backward: bool = False  # from the first pre-backward hook to the final callback
    # this backward began at a call made after the root's forward ended (a chunked loss's head, backpropagated
    # chunk by chunk on detached hidden states): the units it does not reach have their own backward still to come
    late_backward: bool = False
    count: int = 0  # root forwards so far (mfsdp_ext.graphed: which models a step uses)
    grads_kept: bool = False  # a deferred reduction kept unsharded grads (reduced on the last microbatch)
    # During the root's final callback: the unsharded grads its reductions consumed, dropped only after the compute
    # stream has waited for them (so the optimizer step can reuse that memory at once); None otherwise
    grads_freed_at_end: Optional[list] = None
    weights_epoch: int = 0  # part of every gather's weights version: see note_forward_mode
    last_forward_training: bool = True
    trained: bool = False  # a training forward ran (the root's, with grad mode on)

    def note_forward_mode(self, training: bool) -> None:
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


@dataclass
class CaptureState:
    """Where the root stands with CUDA graphs (capture.py, graphs.py)."""

    id: int = 0  # the capture the root's forward last ran in; 0: none
    graphed: bool = False  # some capture happened: replays, not our hooks, run those steps
    graph_steps: Any = field(default_factory=weakref.WeakSet)  # the mfsdp_ext.graphed steps whose graph runs it
    graphed_step: Any = None  # the mfsdp_ext.graphed step capturing it (None: none, or the user's graph)
    user_captured: bool = False  # captured by torch.cuda.graph outside mfsdp_ext.graphed

    @property
    def capturing(self) -> bool:
        """Inside a CUDA graph capture of the root's forward and backward."""
        return self.id != 0


class SharedStreams:
    """The all-gather and reduce-scatter streams several roots share (FSDP2's ``share_comm_ctx``: a pipeline rank's
    stages), made by the first of their contexts."""

    def __init__(self) -> None:
        self.streams: Optional[tuple] = None


class FsdpContext:
    @classmethod
    def live(cls) -> list[FsdpContext]:
        """The contexts of the roots alive in this process, oldest first (mfsdp_ext.graphed watches their modes and
        gathers their first units: in the same order on every rank, as a set's order is not)."""
        return sorted(registry.LIVE_CONTEXTS, key=lambda ctx: ctx.serial)

    def __init__(self, root: Any, units: list, device: torch.device):
        self.serial = next(registry.CONTEXT_SERIALS)
        registry.LIVE_CONTEXTS.add(self)
        self.root: Any = root  # the root FsdpUnit
        self.units = units
        self.device = DeviceHandle(device)
        shared: Optional[SharedStreams] = root.shared_streams  # FSDP2's share_comm_ctx
        if shared is not None and shared.streams is None:  # the first of the roots that share them makes them
            shared.streams = (self.device.new_stream(), self.device.new_stream())
        streams = shared.streams if shared is not None else (self.device.new_stream(), self.device.new_stream())
        self.ag_stream: Optional[torch.cuda.Stream] = streams[0]  # None on CPU: program order
        self.rs_stream: Optional[torch.cuda.Stream] = streams[1]
        self.order = ExecutionOrder()
        self.microbatch = MicrobatchFlags()
        self.iteration = IterationRecord()
        self.capture = CaptureState()
        self.comm = CommResources()

    def begin_iteration(self, training: bool) -> None:
        """The root's forward starts an iteration."""
        self.order.new_iteration()
        self.iteration.open = True
        self.iteration.count += 1
        self.iteration.note_forward_mode(training)

    def end_iteration(self) -> None:
        """A backward ended (or an iteration was abandoned): the units are at rest. The recorded order stays until
        the root's next forward, for the backwards of units run after the root's forward."""
        self.iteration.open = False
        self.iteration.in_backward = False
        self.iteration.grads_freed_at_end = None  # after the streams joined (final callback, or abandoned)

    def weight_sync_allowed(self) -> bool:
        """Inside microbatch(is_first=False) the main->model cast is skipped: the weights cannot have changed."""
        return not self.microbatch.explicit or self.microbatch.is_first

    def needed_first_in_next_microbatch(self, unit: Unit) -> bool:
        """Inside microbatch(is_last=False), the first two units of the forward (the root and the unit it
        prefetches) keep their weights gathered after backward: the next microbatch's forward then starts without
        waiting for their all-gathers. Its weights are this step's (is_first=False casts nothing; a changed
        weights version gathers again), and that forward holds these two gathered at its start anyway."""
        return self.microbatch.explicit and not self.microbatch.is_last and unit in self.order.forward[:2]
