"""How a group's weights are gathered and its gradients reduced: one protocol, interchangeable implementations.

  AllGather(g)               fill ``g.unsharded`` (allocated by the caller) from every rank's compute-dtype shard
  ReduceScatter(g, scale)    pack ``g``'s unsharded grads (times ``scale``, in the reduce dtype) and reduce-scatter
                             them; returns this rank's reduced shard (shard layout, reduce dtype). Where the group's
                             ``reduce_comm_dtype`` is narrower (MixedPrecisionPolicy.reduce_comm_dtype), the plain
                             one sends the grads in it (all-to-all) and returns the shards that arrived
                             (ArrivedShards), which the group sums in the reduce dtype

Both run on the current stream. The plain implementations here issue their collectives through a transport:
torch.distributed (any backend; the default) or mfsdp_ext's own NCCL communicator (``native_collectives=True``,
``mfsdp_ext.comm.native``). A unit's groups that use them over one transport and shard group share one
call (all_gather_together, reduce_scatter_together): each call costs ~120 us of host time through ProcessGroupNCCL.
The NCCL symmetric-memory ones are in ``mfsdp_ext.comm.symmetric``, the copy-engine ones in ``comm/copy_engine.py``. A
group gets its pair once, at lazy init (``comm/policy.py``; plain over torch.distributed by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol

import torch
import torch.distributed as dist

from .. import _native
from ..core.flat_buffer import FlatBuffer
from ..core.layout import FlatLayout
from . import dist_ops


class ParamGroup(Protocol):
    """What the collectives use of a parameter group (param_group.py's ParamGroup)."""

    world: int
    rank: int
    shard_group: dist.ProcessGroup
    device: torch.device
    layout: FlatLayout
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    reduce_comm_dtype: torch.dtype
    fp8: bool
    main_weight: FlatBuffer
    unsharded: FlatBuffer
    plan: Any  # its GatherPlan: unsharded_pieces (of a rank-major buffer), rank_major_offsets
    grads: Any  # its GroupGradients: pack(out, scale)
    collectives: GroupCollectives
    stats: Any  # its GroupStats: the counters tests and benchmarks read
    offload: Any  # its HostOffload, or None: the shard lives on the GPU

    @property
    def sums_on_arrival(self) -> bool: ...

    def gather_targets(self) -> tuple[torch.Tensor, ...]: ...

    def gather_begin(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...

    def gather_end(self) -> None: ...

    def write_shard(self, out: torch.Tensor, start: int = 0) -> None: ...

    def trainable(self) -> list: ...


class GroupCollectives(NamedTuple):
    """A group's collectives: the transport of its plain ones (and of its FP8 scale all-reduce), its all-gather and
    its reduce-scatter. Given once, at lazy init, by comm/policy.py's ``assign_collectives``."""

    transport: TorchTransport
    all_gather: AllGather
    reduce_scatter: ReduceScatter


class AllGather(Protocol):
    name: str

    def __call__(self, g: ParamGroup) -> None: ...

    def together_key(self, g: ParamGroup) -> Optional[tuple]:
        """Groups whose ops give the same key share one call (``gather_together``); None: a call of its own."""

    def gather_together(self, groups: Sequence[ParamGroup]) -> None: ...


class ReduceScatter(Protocol):
    name: str

    def __call__(self, g: ParamGroup, scale: float) -> torch.Tensor | ArrivedShards: ...

    def together_key(self, g: ParamGroup) -> Optional[tuple]:
        """Groups whose ops give the same key share one call (``scatter_together``); None: a call of its own."""

    def scatter_together(self, groups: Sequence[ParamGroup], scales: list[float]) -> list[torch.Tensor]: ...


class SeparateCalls:
    """Mixed into collectives that never share a call with other groups'."""

    def together_key(self, g) -> Optional[tuple]:
        return None

    def gather_together(self, groups) -> None:
        raise AssertionError("no together_key, no shared call")

    def scatter_together(self, groups, scales) -> list:
        raise AssertionError("no together_key, no shared call")


@dataclass
class ArrivedShards:
    """What reduce_comm_dtype's all-to-all delivered: this rank's shard from every rank, (world, shard numel) in the
    narrow dtype, not yet added; ``scale`` applies to each. ParamGroup sums them where they go: straight into a
    fresh main_grad (no reduced buffer, no copy), else into one reduce-dtype shard first (``summed``), as the
    reduce-scatter's output would be."""

    parts: torch.Tensor
    scale: float

    def summed(self, dtype: torch.dtype) -> torch.Tensor:
        """scale * shard_0, then one fused multiply-add per further shard, in rank order (one launch)."""
        out = torch.empty(self.parts.shape[1], dtype=dtype, device=self.parts.device)
        _native.grad_accumulate(out, self.parts, self.scale, False)
        return out


class TorchTransport:
    """The collectives of the plain path through torch.distributed (ProcessGroupNCCL, gloo)."""

    name = "plain"

    def __init__(self):
        self.all_gather_op = PlainAllGather(self)
        self.reduce_scatter_op = PlainReduceScatter(self)

    def all_gather_into(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], group) -> None:
        dist_ops.all_gather_into(outputs, inputs, group)

    def reduce_scatter_into(self, output: torch.Tensor, input: torch.Tensor, group) -> None:
        dist_ops.reduce_scatter_into(output, input, group)

    def grouped_reduce_scatter_into(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], group) -> None:
        dist_ops.grouped_reduce_scatter_into(outputs, inputs, group)

    def all_to_all_into(self, output: torch.Tensor, input: torch.Tensor, group) -> None:
        dist_ops.all_to_all_into(output, input, group)

    def all_reduce_max(self, tensor: torch.Tensor, group) -> None:
        dist_ops.all_reduce(tensor, group, op=dist.ReduceOp.MAX)


class GroupBoundTransport(TorchTransport):
    """torch.distributed's collectives on a process group of their own, whatever group the caller names: FSDP2's
    ``set_separate_reduce_scatter_group`` (the gradients' reduce-scatters on a communicator beside the gathers')."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def reduce_scatter_into(self, output: torch.Tensor, input: torch.Tensor, group) -> None:
        dist_ops.reduce_scatter_into(output, input, self.group)

    def grouped_reduce_scatter_into(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], group) -> None:
        dist_ops.grouped_reduce_scatter_into(outputs, inputs, self.group)

    def all_to_all_into(self, output: torch.Tensor, input: torch.Tensor, group) -> None:
        dist_ops.all_to_all_into(output, input, self.group)


class PlainAllGather:
    """One all-gather per parameter, issued as one group, each landing in place (no copy-in, no copy-out)."""

    def __init__(self, transport):
        self.transport = transport
        self.name = transport.name

    def __call__(self, g: ParamGroup) -> None:
        if g.unsharded is g.main_weight:  # replicated, no cast: the module computes on the main weight
            return
        if g.world == 1:  # one rank or replicated: the shard layout is the unsharded layout
            g.write_shard(g.unsharded.data)
        else:  # from the cached compute-dtype shard, or cast into this rank's slots and gathered in place
            self.transport.all_gather_into(*g.gather_begin(), g.shard_group)

    def together_key(self, g: ParamGroup) -> Optional[tuple]:
        """The plain gathers of a unit's groups over one transport and shard group share one call."""
        return (self.transport, g.shard_group) if g.world > 1 else None

    def gather_together(self, groups: Sequence[ParamGroup]) -> None:
        all_gather_together(groups)


def all_gather_together(groups: Sequence[ParamGroup]) -> None:
    """The plain all-gathers of several groups (the same ``together_key``: one transport, one shard group) as one
    call of the transport (one NCCL group; FP8 weights travel as uint8): each group's work before the collective
    (allocation, casts), the collective, each group's work after it (dequantize, FP8 views, stats)."""
    first = groups[0]
    with torch.autograd._unsafe_preserve_version_counter(tuple(t for g in groups for t in g.gather_targets())):
        outputs, inputs = [], []
        for g in groups:
            out, inp = g.gather_begin()
            outputs += out
            inputs += inp
        first.collectives.transport.all_gather_into(outputs, inputs, first.shard_group)
        for g in groups:
            g.gather_end()


class PlainReduceScatter:
    """Pack rank-major (one native launch), then one flat reduce-scatter whose output is the shard itself."""

    def __init__(self, transport):
        self.transport = transport
        self.name = transport.name

    def __call__(self, g: ParamGroup, scale: float) -> torch.Tensor | ArrivedShards:
        if g.sums_on_arrival:
            return self._sum_on_arrival(g, scale)
        packed = self.pack(g, scale)
        if g.world == 1:
            return packed
        reduced = torch.empty(g.layout.shard_numel, dtype=g.reduce_dtype, device=g.device)
        self.transport.reduce_scatter_into(reduced, packed, g.shard_group)
        return reduced

    def together_key(self, g: ParamGroup) -> Optional[tuple]:
        """The plain flat reduce-scatters (not the narrow wire's all-to-all) over one transport, shard group and reduce
        dtype share one call."""
        if g.world == 1 or g.sums_on_arrival:
            return None
        return self.transport, g.shard_group, g.reduce_dtype

    def scatter_together(self, groups: Sequence[ParamGroup], scales: list[float]) -> list[torch.Tensor]:
        return reduce_scatter_together(groups, scales)

    @staticmethod
    def pack(g: ParamGroup, scale: float) -> torch.Tensor:
        """The flat reduce-scatter's input: the grads times ``scale``, rank-major, in the reduce dtype."""
        packed = torch.empty(g.layout.rank_major_numel, dtype=g.reduce_dtype, device=g.device)
        g.grads.pack(packed, scale)
        return packed

    def _sum_on_arrival(self, g: ParamGroup, scale: float) -> ArrivedShards:
        """The grads packed in their own dtype (a copy, no rounding), exchanged by one all-to-all (half the bytes
        of a float32 reduce-scatter for bf16): this rank's W shards, to be summed in the reduce dtype in rank order
        (ArrivedShards). Every rank adds the same way, and on 2 ranks ``fma(s, b, s * a)`` is the float32
        reduce-scatter's ``s * a + s * b``, one rounding either way, so the bits are the same."""
        packed = torch.empty(g.layout.rank_major_numel, dtype=g.reduce_comm_dtype, device=g.device)
        g.grads.pack(packed, 1.0)
        received = torch.empty_like(packed)
        self.transport.all_to_all_into(received, packed, g.shard_group)
        return ArrivedShards(received.view(g.world, g.layout.shard_numel), scale)


def reduce_scatter_together(groups: Sequence[ParamGroup], scales: list[float]) -> list[torch.Tensor]:
    """The plain reduce-scatters of several groups (the same ``together_key``: one transport, shard group
    and reduce dtype) as one call of the transport, as all_gather_together: each group's grads packed (times its
    scale), one grouped reduce-scatter. Returns each group's reduced shard."""
    first = groups[0]
    packed = [PlainReduceScatter.pack(g, scale) for g, scale in zip(groups, scales)]
    reduced = [torch.empty(g.layout.shard_numel, dtype=g.reduce_dtype, device=g.device) for g in groups]
    op = first.collectives.reduce_scatter
    assert isinstance(op, PlainReduceScatter)  # its together_key
    op.transport.grouped_reduce_scatter_into(reduced, packed, first.shard_group)
    for g in groups:
        g.stats.reduces += 1
    return reduced


TORCH_TRANSPORT = TorchTransport()
