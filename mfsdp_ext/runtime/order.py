"""ExecutionOrder: the order the units of one root ran in, recorded in each iteration's forward and used by the next
iteration to prefetch.

Units are recorded when their forward starts (the forward prefetch follows that order) and when it ends: the
backward runs in the reverse of the end order (the root's tail, e.g. the LM head, first; then the last block). An
iteration starts at the root's forward, so units run after it (a chunked loss's head, with backwards of its own) are
recorded with it.
"""

from __future__ import annotations

from typing import Optional, Protocol


class Unit(Protocol):
    """What the order needs of a unit (runtime/unit.py's FsdpUnit): nothing but its identity."""

    name: str


class ExecutionOrder:
    def __init__(self) -> None:
        self.forward: list[Unit] = []
        self.prev_forward: list[Unit] = []
        self.forward_end: list[Unit] = []
        self.prev_forward_end: list[Unit] = []

    def new_iteration(self) -> None:
        """The root's forward starts: the last iteration's order becomes the one to prefetch by (kept as it was when
        the last iteration recorded nothing, e.g. a forward under no_grad of a model that never trained)."""
        if self.forward:
            self.prev_forward, self.prev_forward_end = self.forward, self.forward_end
        self.forward, self.forward_end = [], []

    def last_forward(self) -> list[Unit]:
        """The last iteration's forward order (the one to prefetch by), or, in the first iteration, this one's."""
        return self.prev_forward or self.forward

    def record_forward(self, unit: Unit) -> None:
        if unit not in self.forward:
            self.forward.append(unit)

    def record_forward_end(self, unit: Unit) -> None:
        if unit not in self.forward_end:
            self.forward_end.append(unit)

    def next_in_forward(self, unit: Unit) -> Optional[Unit]:
        order = self.last_forward()
        if unit in order:
            i = order.index(unit)
            return order[i + 1] if i + 1 < len(order) else None
        return None

    def next_in_backward(self, unit: Unit) -> Optional[Unit]:
        order = self.forward_end
        if unit in order:
            i = order.index(unit)
            return order[i - 1] if i > 0 else None
        return None

    def needed_first_in_backward(self, unit: Unit, root: Unit) -> bool:
        """The unit whose forward ended last before the root's: backward needs it right after the root, so
        resharding it after forward would only gather it again at once (judged from the last iteration)."""
        order = self.prev_forward_end
        return len(order) >= 2 and order[-1] is root and order[-2] is unit

    def finish_order(self, units: list) -> list:
        """Every unit of ``units``, those that ran in reverse forward order first (the order their backward ran in)."""
        ran = list(reversed(self.forward or units))
        ran_ids = {id(u) for u in ran}
        return ran + [u for u in units if id(u) not in ran_ids]
