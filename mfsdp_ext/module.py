"""FsdpModule: the class a ``fully_shard``ed module becomes, with FSDP2's per-module controls."""

from __future__ import annotations

from typing import Optional

import torch

from .unit import FsdpUnit, resolve_reshard_after_forward


class UnshardHandle:
    """What ``FsdpModule.unshard(async_op=True)`` returns, as FSDP2's: ``wait()`` once the gathered weights are
    needed."""

    def __init__(self, unit: FsdpUnit):
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:  # once, as the synchronous unshard() would have
            self._unit.wait_unshard()
        self._unit = None


class FsdpModule:
    """Mixin that ``fully_shard`` adds to a module's class; the FSDP2-shaped per-module controls."""

    _mfsdp_unit: FsdpUnit

    def unshard(self, async_op: bool = False) -> Optional["UnshardHandle"]:
        """Gather this unit's weights (FSDP2's call). ``async_op=True`` returns a handle whose ``wait()`` makes the
        current stream wait for the gather; a forward waits by itself."""
        unit = self._mfsdp_unit
        unit.lazy_init()
        unit.unshard()
        if not async_op:
            unit.wait_unshard()
            return None
        return UnshardHandle(unit)

    def reshard(self) -> None:
        unit = self._mfsdp_unit
        unit.lazy_init()
        unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.reduction.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: Optional[bool], *, recurse: bool = True) -> None:
        reshard_after_forward = resolve_reshard_after_forward(reshard_after_forward)
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward and not unit.strategy.keeps_weights_gathered

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """FSDP2's: False keeps the gathered weights after backward, so the next forward (the next microbatch) needs
        no all-gather; more memory. An optimizer step still makes the next forward gather the new weights."""
        for unit in self._units(recurse):
            unit.reshard_after_backward = bool(reshard_after_backward)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """FSDP2's, for HSDP: False reduce-scatters within the shard group only and accumulates; the all-reduce over
        replicas happens at the next backward with True (on the last microbatch)."""
        for unit in self._units(recurse):
            unit.reduction.requires_all_reduce = bool(requires_all_reduce)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """FSDP2's: False when this unit's backward needs none of its weights (e.g. an embedding alone): the
        backward then gathers nothing for it. A backward that does need them fails on the freed storage."""
        self._mfsdp_unit.unshard_in_backward = bool(unshard_in_backward)

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

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """FSDP2's: in forward, this unit gathers these units' weights ahead (instead of the next in the recorded
        order); more than one prefetches further, at the cost of memory."""
        self._mfsdp_unit.forward_prefetch = _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """FSDP2's: in backward, this unit gathers these units' weights ahead (instead of the previous one in the
        recorded order)."""
        self._mfsdp_unit.backward_prefetch = _units_of(modules, "set_modules_to_backward_prefetch")

    def _units(self, recurse: bool) -> list[FsdpUnit]:
        return [m._mfsdp_unit for m in (self.modules() if recurse else [self]) if isinstance(m, FsdpModule)]

    def release_symmetric_memory(self) -> None:
        """Collective (every rank of the shard group, on the root module): free the NCCL symmetric-memory
        stages and communicator of ``use_symm_mem``; the model keeps training on the plain collectives.

        Call it before dropping a model built with ``use_symm_mem`` when the process goes on (another model,
        a sweep) and before ``destroy_process_group()``. Without it they stay allocated until the process
        exits: freeing them is collective in NCCL, so it cannot happen when the garbage collector decides."""
        unit = self._mfsdp_unit
        if unit.context is None:
            return  # not run yet: nothing was allocated
        if not unit.is_root:
            raise RuntimeError(f"mfsdp_ext: release_symmetric_memory() is called on the root module, not on the "
                               f"inner unit '{unit.name}'")
        ctx = unit.context
        if ctx.symmetric is None:
            return
        for u in ctx.units:
            for g in u.groups:
                g.use_transport(g.transport)  # back to its plain collectives
        symmetric, ctx.symmetric = ctx.symmetric, None
        symmetric.close()  # waits for the device, so no collective still uses the stages

    def compile(self, *args, **kwargs) -> None:
        """``nn.Module.compile``, with this unit's hooks kept out of the compiled region: they become
        dynamo-disabled functions in place (same order among the module's hooks), so dynamo skips them without
        breaking the graph."""
        import torch._dynamo  # torch.compile imports it anyway

        for hooks in (self._forward_pre_hooks, self._forward_hooks):
            for key, hook in list(hooks.items()):
                if hasattr(hook, "mfsdp_hook"):
                    hooks[key] = torch._dynamo.disable(hook.mfsdp_hook, recursive=True,
                                                       reason="mfsdp_ext hooks run eagerly")
        super().compile(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        """Keep the flat-buffer parameters out of nn.Module._apply; materialize meta groups on to_empty()."""
        unit = self._mfsdp_unit
        probe = torch.zeros(1)
        moved = fn(probe)
        for g in unit.groups:
            same_device = moved.device.type == g.device.type and moved.device.index in (None, g.device.index)
            if not same_device or moved.dtype != probe.dtype:
                raise RuntimeError(
                    "mfsdp_ext: a sharded module cannot be moved to another device or cast with .to()/.cuda()/"
                    f".half() (unit '{unit.name}' lives on {g.device}); build it on the target device, or on meta "
                    "and call to_empty(device=...), before fully_shard, and choose dtypes with MixedPrecisionPolicy.")
            g.materialize(g.device)  # no-op unless the group is still on meta
        owned = [(place.module, place.name) for g in unit.groups for info in g.infos for place in info.places]
        for m, n in owned:
            m._parameters[n] = None  # nn.Module._apply skips None entries; the order of _parameters is kept
        try:
            super()._apply(fn, recurse=recurse)  # buffers and inner units
        finally:
            for g in unit.groups:
                g.use_sharded_params()
        return self


def _units_of(modules: list, what: str) -> list[FsdpUnit]:
    bad = [type(m).__name__ for m in modules if not isinstance(m, FsdpModule)]
    if bad:
        raise TypeError(f"{what}: every module must be fully_shard'ed, got {bad[0]}")
    return [m._mfsdp_unit for m in modules]
