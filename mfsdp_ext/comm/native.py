"""The plain collectives issued through mfsdp_ext's own NCCL communicator: ``fully_shard(native_collectives=True)``.

Why: ProcessGroupNCCL spends ~100-140 us of host time on each collective (its work object, the events between
its stream and the caller's, the watchdog's bookkeeping; benchmarks/host_cost.py measures it). A unit makes
three per step (two gathers and a reduce-scatter; FP8 groups one more, the scale all-reduce), so in host-bound
steps (many small units, FP8 layers) they are a large share of the step. Here the same grouped per-parameter
all-gather, flat reduce-scatter and amax all-reduce are one C++ call each (``ncclGroupStart``/``ncclAllGather``...
on the caller's current stream), as the rest of the plain path expects.

What is given up: ProcessGroupNCCL's watchdog. A rank that never reaches a collective makes the others wait
forever instead of raising a timeout error after ``timeout``.

One communicator per shard process group and process, created (collectively, the first time a root's lazy init
asks for it) from an ncclUniqueId shared through the group's store, and kept until the process exits: destroying
an NCCL communicator is collective, so it is not left to the garbage collector. Its memory is NCCL's, outside
PyTorch's allocator.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import _native
from ..core import registry
from . import dist_ops
from .collectives import PlainAllGather, PlainReduceScatter
from .symmetric.comm import _exchange_unique_id, _native_reason


def unavailable_reason(group: dist.ProcessGroup) -> Optional[str]:
    """Why the native transport cannot run over ``group`` (CUDA and NCCL, the extension built with NCCL, a recent
    enough NCCL library), or None when it can."""
    return dist_ops.cuda_nccl_reason(group) or _native_reason()


class NcclTransport:
    """The plain path's collectives on an NCCL communicator of mfsdp_ext's own (the same kernels as
    ProcessGroupNCCL's; not its host path)."""

    name = "native"

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        C = _native._C
        uid = _exchange_unique_id(C, group)
        with torch.cuda.device(device):
            self.comm = C.SymmComm(unique_id=uid, rank=dist.get_rank(group), world_size=dist.get_world_size(group),
                                   device=device.index)
        self.comm.kept_until_exit = True  # by design (see the module docstring): no warning at exit
        self.all_gather_op = PlainAllGather(self)
        self.reduce_scatter_op = PlainReduceScatter(self)

    def all_gather_into(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], group) -> None:
        self.comm.grouped_all_gather(inputs, outputs)

    def reduce_scatter_into(self, output: torch.Tensor, input: torch.Tensor, group) -> None:
        self.comm.flat_reduce_scatter(input, output)

    def grouped_reduce_scatter_into(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], group) -> None:
        self.comm.grouped_reduce_scatter(inputs, outputs)

    def all_reduce_max(self, tensor: torch.Tensor, group) -> None:
        self.comm.all_reduce_max(tensor)

    def all_to_all_into(self, output: torch.Tensor, input: torch.Tensor, group) -> None:
        self.comm.all_to_all(input, output)


def transport_for(group: dist.ProcessGroup, device: torch.device) -> NcclTransport:
    """The native transport over ``group``: made (collectively: every rank asks in the same order) the first time,
    then the same one for every unit of every model in this process."""
    transport = registry.NATIVE_TRANSPORTS.get(group)
    if transport is None:
        transport = registry.NATIVE_TRANSPORTS[group] = NcclTransport(group, device)
    return transport
