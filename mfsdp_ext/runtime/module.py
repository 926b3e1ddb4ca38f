"""FsdpModule: the class a ``fully_shard``ed module becomes, with FSDP2's per-module controls.

It derives from torch's ``FSDPModule``, so the frameworks that find FSDP units with
``isinstance(m, torch.distributed.fsdp.FSDPModule)`` (torchtitan, accelerate, Lightning) find
ours. Every public method of torch's class is either implemented here with FSDP2's meaning or raises an error that
names it; the FSDP2 state that torch's own code reads through ``_get_fsdp_state()`` is ``_Fsdp2StateView``, which
answers only what torch's ``register_fsdp_forward_method`` needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as _TorchUnshardHandle

from ..core.states import ShardedState
from . import root
from .comm_controls import CommControls
from .fsdp2_state import Fsdp2StateView
from .unit import FsdpUnit, resolve_reshard_after_forward
from .unit_io import compiled_hook


class UnshardHandle(_TorchUnshardHandle):
    """What ``FsdpModule.unshard(async_op=True)`` returns, as FSDP2's: ``wait()`` once the gathered weights are
    needed."""

    def __init__(self, unit: FsdpUnit):
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:  # once, as the synchronous unshard() would have
            self._unit.wait_unshard()
        self._unit = None


class FsdpModule(CommControls, _TorchFSDPModule):
    """Mixin that ``fully_shard`` adds to a module's class (``FSDP<Cls>(FsdpModule, Cls)``): FSDP2's per-module
    controls, over this module's unit."""

    _mfsdp_unit: FsdpUnit
    if TYPE_CHECKING:  # a mixin: the nn.Module it is mixed into has these
        modules: Callable[[], Iterator[nn.Module]]
        _forward_pre_hooks: dict
        _forward_hooks: dict

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this unit's weights (FSDP2's call). ``async_op=True`` returns a handle whose ``wait()`` makes the
        current stream wait for the gather; a forward waits by itself."""
        unit = self._mfsdp_unit
        root.lazy_init_tree(unit)
        unit.unshard()
        if not async_op:
            unit.wait_unshard()
            return None
        return UnshardHandle(unit)

    def reshard(self) -> None:
        unit = self._mfsdp_unit
        root.lazy_init_tree(unit)
        unit.reshard()

    def reset_iter_state(self) -> None:
        """FSDP2's recovery after a forward or backward raised (on the root): every unit back at rest, the failed
        iteration's unreduced gradients dropped. mfsdp_ext also does this by itself at the next forward."""
        unit = self._mfsdp_unit
        if unit.context is None:
            return
        if not unit.is_root:
            raise RuntimeError(f"mfsdp_ext: reset_iter_state() is called on the root module, not on the inner "
                               f"unit '{unit.name}'")
        root.abandon_iteration(unit)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's: whether the next backward is the last of the step, where FSDP2 waits for its pending reductions.
        mfsdp_ext finishes (and waits for) every reduction at the end of each backward, so the gradients are the
        same either way; whether a backward reduces at all is ``set_requires_gradient_sync``'s."""
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"set_is_last_backward takes a bool, got {type(is_last_backward).__name__}")

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.reduction.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(  # type: ignore[override]  # FSDP2's int form is refused
            self, reshard_after_forward: Optional[bool], *, recurse: bool = True) -> None:
        value = bool(resolve_reshard_after_forward(reshard_after_forward))
        for unit in self._units(recurse):
            if unit.sharded_state is ShardedState.SHARDED_POST_FORWARD:
                unit.reshard()
            unit.post_forward_shards = None  # a bool replaces fully_shard's int, as in FSDP2
            unit.controls.reshard_after_forward = value and not unit.config.strategy.keeps_weights_gathered
            unit.controls.reshard_root = True  # set explicitly: the root follows it too, as in FSDP2

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """FSDP2's: False keeps the gathered weights after backward, so the next forward (the next microbatch) needs
        no all-gather; more memory. An optimizer step still makes the next forward gather the new weights."""
        for unit in self._units(recurse):
            unit.controls.reshard_after_backward = bool(reshard_after_backward)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """FSDP2's, for HSDP: False reduce-scatters within the shard group only and accumulates; the all-reduce over
        replicas happens at the next backward with True (on the last microbatch)."""
        for unit in self._units(recurse):
            unit.reduction.requires_all_reduce = bool(requires_all_reduce)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """FSDP2's: False when this unit's backward needs none of its weights (e.g. an embedding alone): the
        backward then gathers nothing for it. A backward that does need them fails on the freed storage."""
        self._mfsdp_unit.controls.unshard_in_backward = bool(unshard_in_backward)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """FSDP2's name; ours defaults to True: a parameter no rank gave a gradient in a backward gets a zero
        ``.grad`` (every rank reduces the same buffers, so ranks that use different parameters stay right).
        False leaves such parameters without ``.grad`` as a single process would (an optimizer with momentum or
        weight decay then does not move them), at the cost of one small all-reduce and a host wait per unit and
        backward."""
        for unit in self._units(recurse):
            unit.reduction.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """FSDP2's: this unit's reduced gradients are the sum over ranks divided by ``factor`` (default: the mean)."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: the factor must be positive, got {factor!r}")
        self._mfsdp_unit.reduction.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """FSDP2's: reduce with SUM only (no AVG or PREMUL_SUM in the collectives). mfsdp_ext always does: the
        gradients are scaled by 1 / divide factor while they are packed, then summed, so this changes nothing."""
        if not isinstance(enable, bool):
            raise TypeError(f"set_force_sum_reduction_for_comms takes a bool, got {type(enable).__name__}")

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """FSDP2's: in forward, this unit gathers these units' weights ahead (instead of the next in the recorded
        order); more than one prefetches further, at the cost of memory."""
        self._mfsdp_unit.controls.forward_prefetch = _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """FSDP2's: in backward, this unit gathers these units' weights ahead (instead of the previous one in the
        recorded order)."""
        self._mfsdp_unit.controls.backward_prefetch = _units_of(modules, "set_modules_to_backward_prefetch")

    def set_post_optim_event(self, event: torch.Event) -> None:
        """FSDP2's: the root's next all-gathers also wait for ``event`` (recorded after the optimizer step). They
        wait for the current stream in any case, so this only adds an ordering; call it with a new event each
        step, as for FSDP2."""
        self._mfsdp_unit.controls.post_optim_event = event

    def _get_fsdp_state(self) -> Fsdp2StateView:  # type: ignore[override]
        return Fsdp2StateView(self._mfsdp_unit)

    def _units(self, recurse: bool) -> list[FsdpUnit]:
        units = [m._mfsdp_unit for m in (self.modules() if recurse else [self]) if isinstance(m, FsdpModule)]
        return list({id(u): u for u in units}.values())  # a unit over a list of modules appears once

    def compile(self, *args, **kwargs) -> None:
        """``nn.Module.compile``, with this unit's hooks kept out of the compiled region: they become
        dynamo-disabled functions in place (same order among the module's hooks), so dynamo skips them without
        breaking the graph."""
        for hooks in (self._forward_pre_hooks, self._forward_hooks):
            for key, hook in list(hooks.items()):
                if hasattr(hook, "mfsdp_hook"):
                    hooks[key] = compiled_hook(hook)
        super().compile(*args, **kwargs)  # type: ignore[misc]  # the module's own class has it

    def _apply(self, fn, recurse=True):
        """Keep the flat-buffer parameters out of nn.Module._apply: materialize meta groups on to_empty(), cast them on
        .to(dtype) / .half() / .double() (as FSDP2 casts its sharded parameters); a move to another device is
        refused (but to the CPU for offloaded groups, whose main weights are there: ``to_empty(device="cpu")``)."""
        unit = self._mfsdp_unit
        probe = torch.zeros(1)
        moved = fn(probe)
        for g in unit.groups:
            if g.offload is not None and moved.device.type == "cpu":
                continue
            if moved.device.type != g.device.type or moved.device.index not in (None, g.device.index):
                raise RuntimeError(
                    "mfsdp_ext: a sharded module cannot be moved to another device with .to()/.cuda() (unit "
                    f"'{unit.name}' lives on {g.device}); build it on the target device, or on meta and call "
                    "to_empty(device=...), before fully_shard")
        if moved.dtype != probe.dtype:
            _cast_groups(unit, moved.dtype)
        for g in unit.groups:
            g.rebuild(g.device)  # no-op unless the group is still on meta
        owned = [(place.module, place.name) for g in unit.groups for info in g.infos for place in info.places]
        for m, n in owned:
            m._parameters[n] = None  # nn.Module._apply skips None entries; the order of _parameters is kept
        try:
            # buffers and inner units, through the module's own class (torch's FSDPModule._apply is FSDP2's)
            super(_TorchFSDPModule, self)._apply(fn, recurse=recurse)
        finally:
            for g in unit.groups:
                g.use_sharded_params()
        return self


def _cast_groups(unit: FsdpUnit, dtype: torch.dtype) -> None:
    """``module.to(dtype)`` after fully_shard: each floating group's main weights in ``dtype``, its dtypes derived
    from the unit's MixedPrecisionPolicy for that dtype (a float64 model computes in float64 unless the policy says
    otherwise), as FSDP2 casts its sharded parameters."""
    fp8 = [g for g in unit.groups if g.fp8]
    if fp8:
        raise RuntimeError(f"mfsdp_ext: unit '{unit.name}' holds FP8 weights, which are cast from float32 main "
                           f"weights: it cannot be cast to {dtype}; choose dtypes with MixedPrecisionPolicy")
    if unit.sharded_state is not ShardedState.SHARDED:
        unit.reshard()
    for g in unit.groups:
        narrow = g.reduce_comm_dtype != g.reduce_dtype  # the wire fully_shard chose for this shard group
        g.rebuild(g.device, dtype, unit.config.mp_policy.group_dtypes(dtype, narrow))
    unit.gathered_versions = [None] * len(unit.groups)


def _units_of(modules: list, what: str) -> list[FsdpUnit]:
    bad = [type(m).__name__ for m in modules if not isinstance(m, FsdpModule)]
    if bad:
        raise TypeError(f"{what}: every module must be fully_shard'ed, got {bad[0]}")
    return [m._mfsdp_unit for m in modules]
