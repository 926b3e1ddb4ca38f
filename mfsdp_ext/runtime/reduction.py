"""GradReduction: how one unit's gradients are reduced after its backward, and FSDP2's per-module controls that
steer it (``set_requires_gradient_sync``, ``set_requires_all_reduce``, ``set_reduce_scatter_unused_params``,
``set_gradient_divide_factor``).

On the reduce-scatter stream: pack the unsharded grads rank-major (pre-divided), reduce-scatter them (several
groups in one call where they can), finish HSDP's all-reduce over replicas, accumulate into ``main_grad`` and
attach the ``.grad`` views; or keep them accumulating locally where the strategy defers the reduction to the
last microbatch.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..comm import dist_ops
from ..comm.collectives import ArrivedShards
from ..core.states import Strategy
from ..params.group import ParamGroup
from .context import FsdpContext


class GradReduction:
    def __init__(self, strategy: Strategy):
        self.strategy = strategy
        self.requires_gradient_sync = True
        self.requires_all_reduce = True  # HSDP: all-reduce over replicas (False: accumulate, reduce-scatter only)
        # True: a parameter no rank gave a gradient gets a zero one (no extra collective); False: none (see reduce)
        self.reduce_scatter_unused_params = True
        self.gradient_divide_factor: Optional[float] = None  # reduced gradient = sum / factor (default: mean)

    def reduce_groups(self, ctx: FsdpContext, groups: list[ParamGroup]) -> None:
        """The unit's post-backward: reduce every group that holds unsharded grads."""
        groups = [g for g in groups if g.grads.has_unsharded()]
        scattered = self._reduce_scatter_together(ctx, groups)
        for g in groups:
            self.reduce(ctx, g, scattered.get(g))

    def _reduce_scatter_together(self, ctx: FsdpContext, groups: list[ParamGroup]) -> dict[ParamGroup, torch.Tensor]:
        """Of the groups reduced now, those whose plain reduce-scatters can share one call (same transport, shard
        group and reduce dtype: e.g. a block's FP8 weights and its bf16 norms and biases), reduce-scattered
        together on the reduce-scatter stream: their reduced shards, which reduce() takes on from there."""
        together: dict[tuple, list[ParamGroup]] = {}
        for g in groups:
            key = g.grads.together_key()
            if key is not None and self.reduces_now(ctx, g):
                together.setdefault(key, []).append(g)
        scattered: dict[ParamGroup, torch.Tensor] = {}
        for members in together.values():
            if len(members) > 1:
                scales = [self.grad_scale(g) for g in members]
                with ctx.device.use_stream(ctx.rs_stream):
                    op = members[0].collectives.reduce_scatter
                    scattered.update(zip(members, op.scatter_together(members, scales)))
        return scattered

    def reduces_now(self, ctx: FsdpContext, g: ParamGroup) -> bool:
        """Whether the group's gradients are reduced in this backward, or kept accumulating locally where the
        strategy defers the reduction to the last microbatch."""
        if self.strategy.reduces_every_microbatch and not g.replicated:
            return self.requires_gradient_sync
        return self.requires_gradient_sync and ctx.microbatch.is_last

    def grad_scale(self, g: ParamGroup) -> float:
        """The factor the gradients are packed with: pre-divided, so no overflow in low precision."""
        replicas = dist.get_world_size(g.replicate_group) if g.replicate_group is not None else 1
        return 1.0 / (self.gradient_divide_factor or g.world * replicas)

    def reduce(self, ctx: FsdpContext, g: ParamGroup, reduced: torch.Tensor | ArrivedShards | None = None) -> None:
        """Reduce-scatter the group's gradients into main_grad on the reduce-scatter stream (``reduced``: already
        reduce-scattered with other groups'), or keep them accumulating locally (reduces_now)."""
        if not self.reduces_now(ctx, g):
            ctx.iteration.grads_kept = True
            return
        last = self.requires_gradient_sync and ctx.microbatch.is_last
        every_microbatch = self.strategy.reduces_every_microbatch and not g.replicated
        with_grad = None if self.reduce_scatter_unused_params else self._params_given_a_grad(g)
        main_grad_before = g.grads.main_grad
        with ctx.device.use_stream(ctx.rs_stream):
            if reduced is None:
                reduced = g.grads.reduce_scatter(scale=self.grad_scale(g))
            for grad in g.grads.drop_unsharded():
                if ctx.iteration.grads_freed_at_end is not None:
                    ctx.iteration.grads_freed_at_end.append(grad)
                else:  # autograd allocated it on the compute stream: free once the reduce-scatter has read it
                    ctx.device.record_stream(grad, ctx.rs_stream)
            hsdp = g.replicate_group is not None and not g.replicated
            all_reduce_now = self.requires_all_reduce or not hsdp  # set_requires_all_reduce(False): HSDP defers
            # an offloaded main_grad is in host memory: the replicas' sum is taken on the device, at every reduction
            defer_replicas = (g.replicate_group is not None and (every_microbatch or not all_reduce_now)
                              and g.offload is None)
            g.grads.accumulate_reduced(reduced, defer_replicas, last and all_reduce_now, with_grad)
        stepper = g.grads.stepper() if g.grads.stepper is not None else None
        if stepper is not None:  # an optimizer built with step_in_backward=True (optim/in_backward.py)
            stepper(g, final=last)
        if g.grads.main_grad is not None and g.grads.main_grad is not main_grad_before and g.offload is None:
            # made on the reduce-scatter stream, read by the optimizer on this one; freed whenever the user lets
            # go of the .grads (zero_grad): its memory is reused only after this stream's reads too
            ctx.device.record_stream(g.grads.main_grad.data, ctx.device.current_stream())

    def _params_given_a_grad(self, g: ParamGroup) -> list[bool]:
        """Per parameter, whether any rank's backward gave it a gradient: one small all-reduce (MAX) per mesh
        group, waited for on the host, so that every rank leaves the same parameters without ``.grad`` even when
        ranks use different parameters (set_reduce_scatter_unused_params(False))."""
        mask = torch.tensor(g.grads.local_presence(), dtype=torch.float32, device=g.device)
        for group in (g.shard_group, g.replicate_group):
            if group is not None:
                dist_ops.all_reduce(mask, group, op=dist.ReduceOp.MAX)
        return [v > 0 for v in mask.tolist()]
