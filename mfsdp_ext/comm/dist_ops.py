"""The torch.distributed collectives the flat buffers use, with fallbacks where gloo lacks one.

All-gathers are grouped: one call gathers every parameter of a group (or of a unit's groups), each into its own
place in the param-major buffer (one NCCL group, as ``ncclGroupStart/End``), so nothing is copied out afterwards.
Reduce-scatters are flat: one rank-major input whose output is the shard itself (grouped: one per group of a unit).

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single``; use what exists.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .hosts import group_hosts, torchrun_local_world_size

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """outputs[i] (world * n_i) <- every rank's inputs[i] (n_i) in rank order, for all i as one grouped collective,
    on the current stream. An input may be this rank's slot of its output (in place)."""
    if len(inputs) == 1:
        _all_gather_flat(outputs[0], inputs[0], group=group)
        return

    def one_by_one():
        for output, input in zip(outputs, inputs):
            _all_gather_flat(output, input, group=group)

    _or_gloo_fallback("grouped all-gather", group,
                      lambda: group.allgather_into_tensor_coalesced(outputs, inputs).wait(), one_by_one)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """output (n) <- SUM over ranks of this rank's n-element slice of input (world * n)."""

    def by_all_reduce():
        dist.all_reduce(input, group=group)
        rank = dist.get_rank(group)
        output.copy_(input[rank * output.numel() : (rank + 1) * output.numel()])

    _or_gloo_fallback("reduce-scatter", group, lambda: _reduce_scatter_flat(output, input, group=group), by_all_reduce)


def grouped_reduce_scatter_into(outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                group: dist.ProcessGroup) -> None:
    """reduce_scatter_into for every (outputs[i], inputs[i]) as one grouped collective (one NCCL group)."""

    def one_by_one():
        for output, input in zip(outputs, inputs):
            reduce_scatter_into(output, input, group)

    _or_gloo_fallback("grouped reduce-scatter", group, lambda: group.reduce_scatter_tensor_coalesced(
        outputs, inputs, dist.ReduceScatterOptions()).wait(), one_by_one)


def all_to_all_into(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """output's r-th of world equal slices <- rank r's slice of its input for this rank (flat, equal splits)."""
    dist.all_to_all_single(output, input, group=group)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM) -> None:
    dist.all_reduce(tensor, op=op, group=group)


# (collective, group name, backend) -> whether gloo runs it. Keyed by name, not id(group): c10d names groups alike on
# every rank, while a new group may get a freed group's id on one rank and not on another.
_GLOO_SUPPORT: dict[tuple, bool] = {}


def _or_gloo_fallback(kind: str, group: dist.ProcessGroup, collective, fallback) -> None:
    """Some gloo builds lack a grouped all-gather or a flat reduce-scatter (NCCL has both), and refuse it at the
    call, before any rank communicates (the same on every rank): the first call of ``kind`` on a gloo group tries
    the collective itself and, refused, runs ``fallback`` then and from then on. No probe collective: the calls
    each rank issues are the ones a run needs (what PyTorch's FSDP2 tests count)."""
    backend = dist.get_backend(group)
    key = (kind, group.group_name, backend)
    supported = _GLOO_SUPPORT.get(key)
    if supported is None and backend == "gloo":
        try:
            collective()
        except (RuntimeError, NotImplementedError, AttributeError):
            _GLOO_SUPPORT[key] = False
            fallback()
            return
        _GLOO_SUPPORT[key] = True
    elif supported is False:
        fallback()
    else:
        collective()


def on_one_host(group: dist.ProcessGroup) -> bool:
    """Whether every rank of ``group`` runs on this host. No collective where torchrun's LOCAL_WORLD_SIZE says the
    whole world is one node; otherwise the host names, gathered once per group (hosts.group_hosts: every rank asks
    alike, as fully_shard does, in the same order on every rank)."""
    local = torchrun_local_world_size()
    if local is not None and dist.get_world_size() <= local:
        return True
    return len(set(group_hosts(group))) == 1


def cuda_nccl_reason(group: dist.ProcessGroup) -> str | None:
    """Why a collective of our own cannot run over ``group`` (no CUDA, or not an NCCL group), or None."""
    if torch.version.cuda is None or not torch.cuda.is_available():
        return "it needs CUDA GPUs and a CUDA build of torch"
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        return f"the shard group's backend is {backend!r}; it needs 'nccl'"
    return None
