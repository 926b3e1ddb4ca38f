"""FsdpContext: what the units of one root subtree share.

It owns the all-gather and reduce-scatter streams, the execution order of the units (recorded each
iteration and used by the next one for prefetching), the microbatch flags and the root's final backward
callback. On CPU the streams are absent and everything runs in program order.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Optional

import torch
from torch.autograd import Variable

if TYPE_CHECKING:
    from .module import FsdpUnit


class FsdpContext:
    def __init__(self, root: "FsdpUnit", units: list["FsdpUnit"], device: torch.device):
        self.root = root
        self.units = units
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.ag_stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device) if self.is_cuda else None
        self.rs_stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device) if self.is_cuda else None
        # Execution order: recorded in this iteration's forward, used for prefetching in the next. Units are
        # recorded when their forward starts (forward prefetch) and when it ends: backward runs in the reverse
        # of the end order (the root's tail, e.g. the LM head, first; then the last block).
        self.forward_order: list["FsdpUnit"] = []
        self.prev_forward_order: list["FsdpUnit"] = []
        self.forward_end_order: list["FsdpUnit"] = []
        self.prev_forward_end_order: list["FsdpUnit"] = []
        # Microbatch flags (see api.microbatch): first -> sync main->model weights; last -> finish reductions.
        self.is_first_microbatch = True
        self.is_last_microbatch = True
        self.explicit_microbatch = False
        self.callback_queued = False
        self.symmetric = None  # comm.SymmetricCollectives when some unit uses NCCL symmetric memory

    # ------------------------------------------------------------------ streams
    def compute_stream(self):
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    def on_stream(self, stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def nvtx(self, name: str) -> contextlib.AbstractContextManager:
        return torch.cuda.nvtx.range(name) if self.is_cuda else contextlib.nullcontext()

    # ------------------------------------------------------------------ weight sync policy
    def weight_sync_allowed(self) -> bool:
        """Inside microbatch(is_first=False) the main->model cast is skipped: the weights cannot have changed."""
        return not self.explicit_microbatch or self.is_first_microbatch

    # ------------------------------------------------------------------ execution order
    def record_forward(self, unit: "FsdpUnit") -> None:
        if unit not in self.forward_order:
            self.forward_order.append(unit)

    def _order(self) -> list["FsdpUnit"]:
        return self.prev_forward_order or self.forward_order

    def next_in_forward(self, unit: "FsdpUnit") -> Optional["FsdpUnit"]:
        order = self._order()
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

    # ------------------------------------------------------------------ backward end
    def queue_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        """After the whole backward: finish every unit's reduction, wait for the streams, bring units to rest."""
        for unit in reversed(self.forward_order or self.units):
            unit.finish_backward()
        for unit in self.units:
            if unit not in self.forward_order:
                unit.finish_backward()
        if self.is_cuda:
            self.compute_stream().wait_stream(self.rs_stream)
        self.end_iteration()

    def end_iteration(self) -> None:
        self.callback_queued = False
        if self.forward_order:
            self.prev_forward_order = self.forward_order
            self.prev_forward_end_order = self.forward_end_order
        self.forward_order = []
        self.forward_end_order = []
        for unit in self.units:
            unit.reset_iteration()
