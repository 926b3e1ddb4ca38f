"""GroupGradients: a ParamGroup's gradients (``group.grads``).

A unit's backward leaves each parameter's gradient on its unsharded view; the group packs them rank-major and
reduce-scatters them (its reduce-scatter: comm/), adds the reduced shard into ``main_grad`` (finishing HSDP's
all-reduce over replicas at once or once per step), and makes the sharded parameters' ``.grad`` DTensor views of it.
An offloaded group's ``main_grad`` is in host memory: the reduced shard is copied there and added by the offload
worker (offload.py).

[Note: main-grad references]
``main_grad`` is owned by the ``.grad`` views, not by the group: the group holds it weakly, so
``zero_grad(set_to_none=True)`` frees it at once and memory between steps is what FSDP2 holds, with no hook on the
optimizer. A ``.grad`` the user still holds keeps the buffer and its values; the next accumulation then starts a new
one. The exception is a buffer a captured CUDA graph writes at every replay: the group keeps it (``graph_buffers``) for
as long as it lives, and an optimizer step checks that its ``.grad`` views are still in place.

[Note: freed gradients]
The unsharded gradients a reduction consumed are freed in stream order: with ``record_stream`` on the reduce-scatter
stream during the backward, or, in the root's final callback, only after the compute stream has waited for that
stream (runtime/root.py), so the optimizer step can reuse the memory of the last reductions at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from .. import _native
from ..comm import dist_ops
from ..comm.collectives import ArrivedShards
from ..core import registry
from ..core.flat_buffer import FlatBuffer


def _check_graph_grads(optimizer, args, kwargs) -> None:
    """Before an optimizer step: the gradients a captured CUDA graph writes must still be the parameters' .grad,
    else the step would silently skip what the last replay computed."""
    groups = [g for g in registry.GRAPH_GRAD_GROUPS
              if any(b is g.grads.main_grad for b in g.grads.graph_buffers)]
    if not groups:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for g in groups:
        for i in g.trainable():
            if id(g.infos[i].sharded) in stepped and not g.grads.attached_at(i):
                raise RuntimeError(
                    f"mfsdp_ext: the gradient of '{g.infos[i].fqn}', which a captured CUDA graph writes at every "
                    "replay, is no longer its .grad (optimizer.zero_grad(set_to_none=True), or an assignment, after "
                    "the capture), so this step would not see what the replay computed. Between replays of a "
                    "captured backward, use optimizer.zero_grad(set_to_none=False) (the graph overwrites the "
                    "gradients), or capture the whole step with mfsdp_ext.graphed(...)")


def _local_grad(info) -> Optional[torch.Tensor]:
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
    def __init__(self, group: Any, *, dtype: torch.dtype, reduce_when_ready: bool):
        """``group``: the ParamGroup (held weakly: it owns this object). ``dtype``: main_grad's (the optimizer's
        gradients'). ``reduce_when_ready``: reduce as soon as every trainable parameter has its gradient (the unit
        sets ``on_ready``), not at the unit's post-backward: parameters used after the unit's inner units
        (sharding/groups.py)."""
        self._group = weakref.ref(group)
        self.dtype = dtype
        self.reduce_when_ready = reduce_when_ready
        self.on_ready: Optional[Callable] = None  # the unit's callback for a reduce_when_ready group
        self.ready = 0  # gradients accumulated in this backward (reduce_when_ready)
        self._main_grad_ref: Optional[weakref.ref] = None  # weak: see [Note: main-grad references]
        self.graph_buffers: list = []  # gradient buffers a captured CUDA graph writes: kept here
        self.replica_summed = False  # HSDP: main_grad holds a finished all-reduce over replicas
        # offload: the optimizer stepping this group in backward, called after each reduction (optim/in_backward.py)
        self.stepper: Optional[weakref.WeakMethod] = None

    @property
    def group(self) -> Any:
        return self._group()

    # ------------------------------------------------------------------ the unsharded grads of this backward
    def has_unsharded(self) -> bool:
        return any(info.unsharded.grad is not None for info in self.group.infos)

    def pack(self, out: torch.Tensor, scale: float, pieces: Optional[torch.Tensor] = None) -> None:
        """Pack the unsharded grads into ``out``, rank-major (W shards back to back; missing grads and padding as
        zeros), cast to out's dtype and scaled: one native launch. A flat reduce-scatter of ``out`` then yields
        this rank's shard of every gradient. ``pieces``: another pack table than the group's (a window of each
        shard: comm/copy_engine.py)."""
        _native.pack_pieces(self.local_grads(), self.group.plan.grad_pieces if pieces is None else pieces, out, scale)

    def local_grads(self) -> list[Optional[torch.Tensor]]:
        """Per parameter, what its unsharded gradient contributes on this rank (None: no gradient)."""
        return [_local_grad(info) for info in self.group.infos]

    def drop_unsharded(self) -> list[torch.Tensor]:
        grads = []
        for info in self.group.infos:
            if info.unsharded.grad is not None:
                grads.append(info.unsharded.grad)
                info.unsharded.grad = None
        return grads

    def local_presence(self) -> list[bool]:
        """Per parameter: whether this rank's backward gave it a gradient (before the reduction consumes them)."""
        return [info.unsharded.grad is not None for info in self.group.infos]

    def accumulated_hook(self):
        """A post-accumulate-grad hook for a reduce_when_ready group's parameters. It holds this object weakly: a
        tensor's hooks live in C++, where the garbage collector cannot see a cycle through them, and a group kept
        alive keeps its process groups (and gloo's threads) alive at exit."""
        grads = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            me = grads()
            if me is not None and me.on_ready is not None:
                me.ready += 1
                if me.ready == len(me.group.trainable()):
                    me.on_ready(me.group)

        return hook

    # ------------------------------------------------------------------ the reduction
    def reduce_scatter(self, scale: float) -> torch.Tensor | ArrivedShards:
        """Pack the unsharded grads (times ``scale``) and reduce-scatter them over the shard group, with the group's
        reduce-scatter, on the current stream; returns this rank's reduced shard (reduce dtype), or with
        reduce_comm_dtype the shards that arrived, summed by accumulate_reduced."""
        g = self.group
        reduced = g.collectives.reduce_scatter(g, scale)
        g.stats.reduces += 1
        return reduced

    def together_key(self) -> Optional[tuple]:
        """Groups with the same key share one reduce-scatter call (their op's ``scatter_together``); None: this group
        reduces by itself."""
        g = self.group
        return g.collectives.reduce_scatter.together_key(g)

    def accumulate_reduced(self, reduced: torch.Tensor | ArrivedShards, defer_replicas: bool, last_microbatch: bool,
                           with_grad: Optional[list[bool]] = None) -> None:
        """Add a reduce-scattered shard into main_grad, finishing HSDP's all-reduce over replicas: at once, or
        (``defer_replicas``) once per step, on the last microbatch. ``with_grad``: the parameters some rank gave
        a gradient (the others get no ``.grad``); None: all of them."""
        g = self.group
        if g.replicate_group is not None and not defer_replicas:
            if isinstance(reduced, ArrivedShards):  # the replicas add reduce-dtype shards
                reduced = reduced.summed(g.reduce_dtype)
            dist_ops.all_reduce(reduced, g.replicate_group)
        if defer_replicas and self.replica_summed and self.attached():
            # Gradients kept from the last step are already summed over replicas: the coming all-reduce
            # would count them `replicas` times, so take 1/replicas of them now.
            self.main_grad.data.div_(dist.get_world_size(g.replicate_group))
        self.accumulate(reduced, with_grad=with_grad)
        self.replica_summed = False
        if defer_replicas and last_microbatch and self.main_grad is not None:  # None: no parameter got a grad
            dist_ops.all_reduce(self.main_grad.data, g.replicate_group)
            self.replica_summed = True

    def accumulate(self, reduced: torch.Tensor | ArrivedShards, scale: float = 1.0,
                   with_grad: Optional[list[bool]] = None) -> None:
        """main_grad (+)= scale * reduced, then make sure the sharded params' .grad point at main_grad (those in
        ``with_grad``, and those already attached in this accumulation)."""
        g = self.group
        trainable = g.trainable()
        attached = [self.attached_at(i) for i in trainable]  # one walk for the decision and the zeroing
        accumulate = any(attached)  # attached()
        # A new accumulation gets a new buffer: the last one is gone with its .grads, or a .grad the user still
        # holds keeps it, and keeps its values.
        main_grad = self.main_grad if accumulate else self._new_main_grad()
        # one without .grad starts afresh (torch's accumulation into None)
        restart = [i for i, has in zip(trainable, attached) if accumulate and not has]
        if isinstance(reduced, ArrivedShards):
            if accumulate or main_grad.data.dtype != g.reduce_dtype or g.offload is not None:
                # added to main_grad as one reduce-dtype sum, as a reduce-scatter's output is: the same bits
                reduced = reduced.summed(g.reduce_dtype)
            else:  # a fresh main_grad of the reduce dtype: the shards are summed straight into it
                scale *= reduced.scale
                reduced = reduced.parts
        if g.offload is not None:  # main_grad in host memory: copied there, added by the offload worker
            g.offload.download_grad(main_grad, reduced, scale=scale, accumulate=accumulate, restart=restart)
        else:
            for i in restart:
                main_grad.param_view(i).zero_()
            _native.grad_accumulate(main_grad.data, reduced, scale, accumulate)
        self.attach(with_grad)

    # ------------------------------------------------------------------ main_grad and the .grad views
    @property
    def main_grad(self) -> Optional[FlatBuffer]:
        """The gradient shard, while a parameter's ``.grad`` (or a reference the user kept to one) still holds it
        ([Note: main-grad references])."""
        return None if self._main_grad_ref is None else self._main_grad_ref()

    def _new_main_grad(self) -> FlatBuffer:
        g = self.group
        main_grad = (g.offload.buffer(g.layout, self.dtype, g.rank) if g.offload is not None else
                     FlatBuffer(g.layout, self.dtype, g.device, rank=g.rank))
        self._main_grad_ref = weakref.ref(main_grad)
        if main_grad.data.is_cuda and torch.cuda.is_current_stream_capturing():
            self.keep_for_graph()
        for info in g.infos:  # views of the last buffer, if a reference the user kept still holds it
            info.grad_ref = None
        self.replica_summed = False
        return main_grad

    def keep_for_graph(self) -> None:
        """main_grad is written by a captured CUDA graph at every replay: keep it alive (the graph does not; a
        zero_grad(set_to_none=True) would free it under the graph), for as long as the group lives, and have every
        optimizer step check that its .grad views are still in place (_check_graph_grads)."""
        main_grad = self.main_grad
        if main_grad is not None and not any(b is main_grad for b in self.graph_buffers):
            self.graph_buffers.append(main_grad)
            registry.GRAPH_GRAD_GROUPS.add(self.group)
            registry.install_optimizer_hook("check_graph_grads", _check_graph_grads, pre=True)

    def attached(self) -> bool:
        """True when the optimizer-visible grads still hold the last accumulation (zero_grad did not set them to
        None). Some may have none: a parameter no rank gave a gradient (set_reduce_scatter_unused_params(False)),
        or one whose ``.grad`` the user set to None."""
        return any(self.attached_at(i) for i in self.group.trainable())

    def attached_at(self, i: int) -> bool:
        """Parameter i's ``.grad`` is its view of main_grad (which that view keeps alive)."""
        info = self.group.infos[i]
        return info.sharded_grad is not None and info.sharded.grad is info.sharded_grad

    def attach(self, with_grad: Optional[list[bool]] = None) -> None:
        """The trainable parameters' .grad become views of main_grad (frozen ones get none; with ``with_grad``,
        only those it marks). Each view keeps the whole buffer alive."""
        g = self.group
        main_grad = self.main_grad
        for i in g.trainable():
            if with_grad is not None and not with_grad[i]:
                continue
            info = g.infos[i]
            grad = info.sharded_grad
            if grad is None:
                grad = g.as_dtensor(i, main_grad.param_view(i))
                grad._mfsdp_main_grad = main_grad  # the owner: main_grad lives while some .grad does
                info.grad_ref = weakref.ref(grad)
            if info.sharded.grad is not grad:
                info.sharded.grad = grad
