"""What torch's own code reads of FSDP2's private state, answered for mfsdp_ext's units.

Two places in torch reach into an FSDP2 unit's state, and both work on ours through this view:

  * ``register_fsdp_forward_method`` wraps a method with ``state._pre_forward`` / ``state._post_forward``;
  * ``torch.distributed.pipelining`` (stage.py, ``perform_reduce_grad``), after the last microbatch of a step::

        state = fully_shard.state(stage_module)
        for s in state._state_ctx.all_states:
            for group in s._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()

    with ``set_requires_gradient_sync(False)`` during the microbatches, so this is where the step's gradients are
    reduced. A unit's ``post_backward`` reduces all its groups at once (FSDP2 calls it once per group; the first
    call does the unit's work and the others find it done).

Also what PyTorch's own FSDP2 tests read to check a unit's state: ``_is_root``, ``_modules_to_run_forward`` (the
modules of a unit over several that have not run in the current forward) and ``_fsdp_param_group.is_unsharded``.
Views of one unit compare equal. Anything else of FSDP2's private state does not exist here, and asking for it says
so by name.
"""

from __future__ import annotations

from typing import Any

from ..core.states import ShardedState
from . import root


class _StateContext:
    """FSDP2's ``_state_ctx``: the states of every unit under a root."""

    def __init__(self, unit: Any):
        ctx = unit.lazy_init()
        self.all_states = [Fsdp2StateView(u) for u in ctx.units]


class _UnitParams:
    """FSDP2's ``FSDPParamGroup`` of a unit: ``post_backward()`` reduces the unit's accumulated gradients;
    ``is_unsharded``: its gathered weights are in place."""

    def __init__(self, unit: Any):
        self._unit = unit

    def post_backward(self) -> None:
        self._unit.post_backward()

    @property
    def is_unsharded(self) -> bool:
        return self._unit.sharded_state is ShardedState.UNSHARDED


class Fsdp2StateView:
    """FSDP2's ``FSDPState`` surface that torch's own code uses (the module docstring), over one unit."""

    def __init__(self, unit: Any):
        self._unit = unit

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fsdp2StateView) and other._unit is self._unit

    def __hash__(self) -> int:
        return id(self._unit)

    @property
    def _is_root(self) -> bool | None:
        """None before the tree's lazy init, as FSDP2's."""
        return None if self._unit.context is None else self._unit.is_root

    @property
    def _modules_to_run_forward(self) -> set:
        return {m for m in self._unit.modules if id(m) in self._unit.to_run}

    @property
    def _fsdp_param_group(self) -> _UnitParams | None:
        return _UnitParams(self._unit) if self._unit.groups else None

    def _lazy_init(self) -> None:
        """FSDP2's: this unit's tree initialised with this unit as its root (FSDP2's refusals included: an inner unit
        already initialised, a unit over several modules)."""
        root.lazy_init(self._unit)

    def _pre_forward(self, module, args, kwargs):
        return self._unit.enter_forward_method(module, args, kwargs)

    def _post_forward(self, module, args, output):
        return self._unit.exit_forward_method(module, args, output)

    @property
    def _state_ctx(self) -> _StateContext:
        return _StateContext(self._unit)

    @property
    def _fsdp_param_groups(self) -> list[_UnitParams]:
        return [_UnitParams(self._unit)] if self._unit.groups else []

    def _root_post_backward_final_callback(self) -> None:
        """The end of a step's backward driven from outside autograd (pipelining's REDUCE_GRAD): wait for the
        reductions, bring every unit to rest."""
        unit = self._unit
        unit.lazy_init()
        if not unit.is_root:
            raise RuntimeError(f"mfsdp_ext: _root_post_backward_final_callback() on the inner unit '{unit.name}'; "
                               "call it on the root's state")
        root.final_callback(unit)

    def __getattr__(self, name: str):
        raise AttributeError(
            f"mfsdp_ext: '{self._unit.name}' is sharded by mfsdp_ext.fully_shard, which has no FSDP2 state "
            f"'{name}'; mfsdp_ext answers what torch's own code reads (pipelining, register_fsdp_forward_method): "
            "see mfsdp_ext/runtime/fsdp2_state.py")


def state(module) -> Fsdp2StateView:
    """FSDP2's ``fully_shard.state(module)``, for a module sharded by ``mfsdp_ext.fully_shard``.

    Args:
        module: a ``fully_shard``ed module (FSDP2's own, too: after ``use_as_fsdp2()`` torch's pipelining asks this
            function for every stage, and FSDP2's answer is FSDP2's state).

    Returns:
        the view of its unit's state that torch's own code reads.
    """
    unit = getattr(module, "_mfsdp_unit", None)
    if unit is None:
        from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as fsdp2_fully_shard

        return fsdp2_fully_shard.state(module)  # type: ignore[attr-defined]
    return Fsdp2StateView(unit)
