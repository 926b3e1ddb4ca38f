"""Which hosts a process group's ranks run on. Two callers ask: the default bf16 gradient wire (one host only:
dist_ops.on_one_host) and the symmetric-memory path's single-node check (symmetric/comm.py beside it). Both first ask
torchrun (no collective), then gather the host names: one all-gather per group serves both."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

# (group name, its global ranks) -> the host name of each rank; the ranks too, as a name can come back for another
# group after destroy_process_group
_HOSTS: dict[tuple, tuple[str, ...]] = {}


def group_hosts(group: dist.ProcessGroup) -> tuple[str, ...]:
    """The host name of every rank of ``group``, in group-rank order. The first call per group is a collective
    (every rank must ask, in the same order); later calls read the cache."""
    key = (group.group_name, tuple(dist.get_process_group_ranks(group)))
    if key not in _HOSTS:
        hosts = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        _HOSTS[key] = tuple(hosts)
    return _HOSTS[key]


def torchrun_local_world_size() -> int | None:
    """torchrun's LOCAL_WORLD_SIZE (the ranks on this node), or None when the process was not started by torchrun."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() else None
