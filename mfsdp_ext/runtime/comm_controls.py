"""CommControls: FSDP2's per-module controls of a unit's communication, on ``FsdpModule`` (module.py): symmetric
memory, custom collectives, the reduce-scatter's buffers and group. Each acts with FSDP2's meaning or refuses by name.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..comm.policy import release_symmetric, separate_group, use_custom


def not_supported(method: str, what_to_do: str) -> NotImplementedError:
    return NotImplementedError(f"mfsdp_ext: FSDPModule.{method} is not supported; {what_to_do}")


class CommControls:
    """Mixed into FsdpModule, whose ``_mfsdp_unit`` is the unit they steer."""

    _mfsdp_unit: Any
    if TYPE_CHECKING:  # FsdpModule's
        def _units(self, recurse: bool) -> list: ...

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """FSDP2's cap on reduce-scatter input buffers in flight, which trades memory for not stalling the compute
        stream. mfsdp_ext packs each unit's gradients on the reduce-scatter stream and frees them in stream order,
        so the compute stream never waits to reuse one: the value is checked and has nothing to change."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int) or max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers!r}")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """FSDP2's: use symmetric memory for this unit's collectives: ``fully_shard(use_symm_mem=True)``. Call it
        before the first forward (the collectives are chosen there)."""
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm: mfsdp_ext's symmetric memory is NCCL's, got {backend!r}")
        unit = self._mfsdp_unit
        if unit.context is not None:
            raise RuntimeError("set_symm_mem_for_comm: call it before the first forward; the collectives are "
                               "chosen there (or pass use_symm_mem=True to fully_shard)")
        shard_group = unit.groups[0].shard_group if unit.groups else None
        unit.set_comm_policy(unit.config.comm.with_symmetric_memory(shard_group))

    def set_custom_all_gather(self, comm: Any) -> None:
        """FSDP2's: this unit's all-gathers go through ``comm`` (FSDP2's ``AllGather``: ``allocate`` and ``__call__``),
        called as FSDP2 calls it, once per group and gather over the group's flat shard (comm/custom.py). FP8 groups
        and dim > 0 splits keep their own gathers."""
        self._set_comm(custom_all_gather=comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """FSDP2's: this unit's gradient reduce-scatters go through ``comm`` (FSDP2's ``ReduceScatter``), called with
        the gradients packed rank-major and pre-divided, and op=SUM (comm/custom.py)."""
        self._set_comm(custom_reduce_scatter=comm)

    def _set_comm(self, **changes) -> None:
        for name, comm in changes.items():
            if not (callable(comm) and callable(getattr(comm, "allocate", None))):
                raise TypeError(f"set_{name}: pass an object with FSDP2's Comm interface (allocate(size, *, dtype, "
                                f"device) and __call__), got {comm!r:.80}")
        unit = self._mfsdp_unit
        unit.set_comm_policy(dataclasses.replace(unit.config.comm, **changes))
        if unit.context is not None:  # after lazy init: from the next collective on
            use_custom([(unit.config.comm, g) for g in unit.groups])

    def set_all_reduce_hook(self, hook: Callable, *, stream: Any = None) -> None:
        raise not_supported("set_all_reduce_hook", "the reduced gradients are the parameters' .grad after "
                             "backward; run extra reductions there")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """FSDP2's: the gradients' reduce-scatters on a process group of their own over the shard ranks (made here,
        collectively: call it alike on every rank), so they can progress beside the gathers. Call it before the
        first forward. It applies to the plain collectives over torch.distributed (native_collectives=True already
        gives the unit a communicator of its own)."""
        for unit in self._units(recurse):
            if unit.context is not None:
                raise RuntimeError("set_separate_reduce_scatter_group: call it before the first forward (the "
                                   "collectives are chosen there)")
            groups = [g.shard_group for g in unit.groups if g.shard_group is not None and g.world > 1]
            own = separate_group(groups[0]) if enable and groups else None
            unit.set_comm_policy(dataclasses.replace(unit.config.comm, reduce_scatter_group=own))

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        raise not_supported("set_allocate_memory_from_process_group_for_comm",
                             "use fully_shard(use_symm_mem=True) for NCCL-registered buffers")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        raise not_supported("_set_unshard_async_op", "mfsdp_ext's gathers always run on their own stream")

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
        if ctx.comm.symmetric is None:
            return
        # NCCL keeps the windows that a live CUDA graph captured, and freeing them waits for that graph: ours go
        # first (a later call captures again); a graph of the user's own torch.cuda.graph must be deleted by them
        for step in list(ctx.capture.graph_steps):
            step.drop_graph()
        if ctx.capture.user_captured:
            warnings.warn("mfsdp_ext: release_symmetric_memory() on a model captured by torch.cuda.graph: delete "
                          "that graph first (NCCL keeps the symmetric memory a live graph uses, and this release "
                          "would wait for it forever)", RuntimeWarning, stacklevel=2)
        release_symmetric(ctx.comm, [g for u in ctx.units for g in u.groups])
