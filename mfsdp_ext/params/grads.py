"""GroupGradients: the gradient half of a ParamGroup (mixed into it; param_group.py holds its buffers and weights).

A unit's backward leaves each parameter's gradient on its unsharded view; the group packs them rank-major and
reduce-scatters them (its reduce-scatter op: comm/), adds the reduced shard into ``main_grad`` (finishing HSDP's
all-reduce over replicas at once or once per step), and makes the sharded parameters' ``.grad`` DTensor views of
it. ``main_grad`` is owned by those views, not by the group: ``zero_grad(set_to_none=True)`` frees it at once.
The attributes it reads (``infos``, ``layout``, the dtypes, groups and ``as_dtensor``) are ParamGroup's.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _native
from ..comm import dist_ops
from ..comm.collectives import ArrivedShards, PlainReduceScatter
from ..core.flat_buffer import FlatBuffer


_GRAPH_GRAD_GROUPS: weakref.WeakSet = weakref.WeakSet()  # groups holding gradients a CUDA graph writes
_HOOK = []


def _watch_graph_grads() -> None:
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_graph_grads))


def _check_graph_grads(optimizer, args, kwargs) -> None:
    """Before an optimizer step: the gradients a captured CUDA graph writes must still be the parameters' .grad,
    else the step would silently skip what the last replay computed."""
    groups = [g for g in _GRAPH_GRAD_GROUPS if any(b is g.main_grad for b in g.graph_main_grads)]
    if not groups:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for g in groups:
        for i in g.trainable():
            if id(g.infos[i].sharded) in stepped and not g.grad_attached(i):
                raise RuntimeError(
                    f"mfsdp_ext: the gradient of '{g.infos[i].fqn}', which a captured CUDA graph writes at every "
                    "replay, is no longer its .grad (optimizer.zero_grad(set_to_none=True), or an assignment, after "
                    "the capture), so this step would not see what the replay computed. Between replays of a "
                    "captured backward, use optimizer.zero_grad(set_to_none=False) (the graph overwrites the "
                    "gradients), or capture the whole step with mfsdp_ext.graphed(...)")


def _local_grad(info) -> torch.Tensor | None:
    """What a parameter's unsharded gradient contributes here: the tensor, or for a tensor-parallel parameter the
    local tensor of its DTensor gradient, first placed as the parameter is (a sequence-parallel norm's gradient
    arrives Partial over the tensor-parallel mesh: summed there first, as FSDP2 does). On a full SPMD mesh the
    data-parallel dims keep the placement the gradient has (Partial there: the reduction sums it, as FSDP2's)."""
    grad = info.unsharded.grad
    if grad is None or info.tp_spec is None:
        return grad
    if isinstance(grad, AsyncCollectiveTensor):
        grad = grad.wait()
    target = info.tp_spec.placements
    if info.spmd is not None:
        keep = info.spmd.all_dims
        target = tuple(g if i in keep else own for i, (g, own) in enumerate(zip(grad.placements, target)))
    if grad.placements != target:
        grad = grad.redistribute(placements=target)
    return grad._local_tensor


class GroupGradients:
    def has_unsharded_grads(self) -> bool:
        return any(info.unsharded.grad is not None for info in self.infos)

    def pack_grads(self, out: torch.Tensor, scale: float) -> None:
        """Pack the unsharded grads into ``out``, rank-major (W shards back to back; missing grads and padding as
        zeros), cast to out's dtype and scaled: one native launch. A flat reduce-scatter of ``out`` then yields
        this rank's shard of every gradient."""
        _native.pack_pieces([_local_grad(info) for info in self.infos], self._grad_pieces, out, scale)

    def drop_unsharded_grads(self) -> list[torch.Tensor]:
        grads = []
        for info in self.infos:
            if info.unsharded.grad is not None:
                grads.append(info.unsharded.grad)
                info.unsharded.grad = None
        return grads

    def grads_attached(self) -> bool:
        """True when the optimizer-visible grads still hold the last accumulation (zero_grad did not set them to
        None). Some may have none: a parameter no rank gave a gradient (set_reduce_scatter_unused_params(False)),
        or one whose ``.grad`` the user set to None."""
        return any(self.grad_attached(i) for i in self.trainable())

    def grad_attached(self, i: int) -> bool:
        """Parameter i's ``.grad`` is its view of main_grad (which that view keeps alive)."""
        info = self.infos[i]
        return info.sharded_grad is not None and info.sharded.grad is info.sharded_grad

    def local_grad_presence(self) -> list[bool]:
        """Per parameter: whether this rank's backward gave it a gradient (before the reduction consumes them)."""
        return [info.unsharded.grad is not None for info in self.infos]

    def reduce_scatter(self, scale: float) -> torch.Tensor | ArrivedShards:
        """Pack the unsharded grads (times ``scale``) and reduce-scatter them over the shard group, with this
        group's reduce-scatter, on the current stream; returns this rank's reduced shard (reduce dtype), or with
        reduce_comm_dtype the shards that arrived, summed by accumulate_reduced."""
        reduced = self.reduce_scatter_op(self, scale)
        self.stats.reduces += 1
        return reduced

    @property
    def sums_on_arrival(self) -> bool:
        """The gradients travel narrower than they are summed (reduce_comm_dtype): an all-to-all over several
        ranks, then the sum in reduce_dtype here, instead of a reduce-scatter."""
        return self.reduce_comm_dtype != self.reduce_dtype and self.world > 1

    def joins_grouped_reduce_scatter(self) -> bool:
        """Whether this group's reduce-scatter is the plain flat one over several ranks (not reduce_comm_dtype's
        all-to-all), which can be one call with other such groups' (collectives.reduce_scatter_together)."""
        return self.world > 1 and isinstance(self.reduce_scatter_op, PlainReduceScatter) and not self.sums_on_arrival

    def accumulate_reduced(self, reduced: torch.Tensor | ArrivedShards, defer_replicas: bool, last_microbatch: bool,
                           with_grad: list[bool] | None = None) -> None:
        """Add a reduce-scattered shard into main_grad, finishing HSDP's all-reduce over replicas: at once, or
        (``defer_replicas``) once per step, on the last microbatch. ``with_grad``: the parameters some rank gave
        a gradient (the others get no ``.grad``); None: all of them."""
        if self.replicate_group is not None and not defer_replicas:
            if isinstance(reduced, ArrivedShards):  # the replicas add reduce-dtype shards
                reduced = reduced.summed(self.reduce_dtype)
            dist_ops.all_reduce(reduced, self.replicate_group)
        if defer_replicas and self.main_grad_replica_summed and self.grads_attached():
            # Gradients kept from the last step are already summed over replicas: the coming all-reduce
            # would count them `replicas` times, so take 1/replicas of them now.
            self.main_grad.data.div_(dist.get_world_size(self.replicate_group))
        self.accumulate_main_grad(reduced, with_grad=with_grad)
        self.main_grad_replica_summed = False
        if defer_replicas and last_microbatch and self.main_grad is not None:  # None: no parameter got a grad
            dist_ops.all_reduce(self.main_grad.data, self.replicate_group)
            self.main_grad_replica_summed = True

    def accumulate_main_grad(self, reduced: torch.Tensor | ArrivedShards, scale: float = 1.0,
                             with_grad: list[bool] | None = None) -> None:
        """main_grad (+)= scale * reduced, then make sure the sharded params' .grad point at main_grad (those in
        ``with_grad``, and those already attached in this accumulation)."""
        trainable = self.trainable()
        attached = [self.grad_attached(i) for i in trainable]  # one walk for the decision and the zeroing
        accumulate = any(attached)  # grads_attached()
        # A new accumulation gets a new buffer: the last one is gone with its .grads, or a .grad the user still
        # holds keeps it, and keeps its values.
        main_grad = self.main_grad if accumulate else self._new_main_grad()
        if accumulate and not all(attached):  # one without .grad starts afresh (torch's accumulation into None)
            for i, has in zip(trainable, attached):
                if not has:
                    main_grad.param_view(i).zero_()
        if isinstance(reduced, ArrivedShards):
            if accumulate or main_grad.data.dtype != self.reduce_dtype:
                # added to main_grad as one reduce-dtype sum, as a reduce-scatter's output is: the same bits
                reduced = reduced.summed(self.reduce_dtype)
            else:  # a fresh main_grad of the reduce dtype: the shards are summed straight into it
                reduced, scale = reduced.parts, scale * reduced.scale
        _native.grad_accumulate(main_grad.data, reduced, scale, accumulate)
        self.attach_grads(with_grad)

    @property
    def main_grad(self) -> FlatBuffer | None:
        """The gradient shard, while a parameter's ``.grad`` (or a reference the user kept to one) still holds it.
        The group does not own it: ``zero_grad(set_to_none=True)`` frees it at once, so memory between steps is
        what FSDP2 holds, with no hook on the optimizer."""
        return None if self._main_grad_ref is None else self._main_grad_ref()

    def _new_main_grad(self) -> FlatBuffer:
        main_grad = FlatBuffer(self.layout, self.main_grad_dtype, self.device, rank=self.rank)
        self._main_grad_ref = weakref.ref(main_grad)
        if main_grad.data.is_cuda and torch.cuda.is_current_stream_capturing():
            self.keep_main_grad_for_graph()
        for info in self.infos:  # views of the last buffer, if a reference the user kept still holds it
            info.grad_ref = None
        self.main_grad_replica_summed = False
        return main_grad

    def keep_main_grad_for_graph(self) -> None:
        """main_grad is written by a captured CUDA graph at every replay: the group keeps it alive (the graph does
        not; a zero_grad(set_to_none=True) would free it under the graph), for as long as the group lives, and an
        optimizer step checks that its .grad views are still in place (_check_graph_grads)."""
        main_grad = self.main_grad
        if main_grad is not None and not any(b is main_grad for b in self.graph_main_grads):
            self.graph_main_grads.append(main_grad)
            _GRAPH_GRAD_GROUPS.add(self)
            _watch_graph_grads()

    def attach_grads(self, with_grad: list[bool] | None = None) -> None:
        """The trainable parameters' .grad become views of main_grad (frozen ones get none; with ``with_grad``,
        only those it marks). Each view keeps the whole buffer alive."""
        main_grad = self.main_grad
        for i in self.trainable():
            if with_grad is not None and not with_grad[i]:
                continue
            info = self.infos[i]
            grad = info.sharded_grad
            if grad is None:
                grad = self.as_dtensor(i, main_grad.param_view(i))
                grad._mfsdp_main_grad = main_grad  # the owner: main_grad lives while some .grad does
                info.grad_ref = weakref.ref(grad)
            if info.sharded.grad is not grad:
                info.sharded.grad = grad
