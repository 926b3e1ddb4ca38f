"""CommControls: FSDP2's per-module controls of a unit's communication, on ``FsdpModule`` (module.py): symmetric
memory, custom collectives, the reduce-scatter's buffers and group. Each acts with FSDP2's meaning or refuses by name.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ..comm.policy import release_symmetric


def not_supported(method: str, what_to_do: str) -> NotImplementedError:
    return NotImplementedError(f"mfsdp_ext: FSDPModule.{method} is not supported; {what_to_do}")


class CommControls:
    """Mixed into FsdpModule, whose ``_mfsdp_unit`` is the unit they steer."""

    _mfsdp_unit: Any

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
        raise not_supported("set_custom_all_gather", "mfsdp_ext gathers in place into its flat buffers; "
                             "native_collectives=True and use_symm_mem=True are its other collectives")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        raise not_supported("set_custom_reduce_scatter", "mfsdp_ext reduces packed flat buffers; "
                             "native_collectives=True and use_symm_mem=True are its other collectives")

    def set_all_reduce_hook(self, hook: Callable, *, stream: Any = None) -> None:
        raise not_supported("set_all_reduce_hook", "the reduced gradients are the parameters' .grad after "
                             "backward; run extra reductions there")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        raise not_supported("set_separate_reduce_scatter_group", "mfsdp_ext's reduce-scatters share the mesh's "
                             "process group (native_collectives=True gives them a communicator of their own)")

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
