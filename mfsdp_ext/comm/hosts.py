"""Which hosts a process group's ranks run on. The paths that are taken within one host only ask: the default bf16
gradient wire (dist_ops.on_one_host), symmetric memory's single-node check (symmetric/comm.py) and the copy engines.
They first ask torchrun (no collective), then gather the host names: one all-gather per group serves all.

``MFSDP_EXT_SIMULATE_HOSTS=N`` makes one machine answer as N hosts of world / N consecutive ranks each, so the
paths chosen for runs that span hosts (HSDP replicating across hosts, the fp32 gradient wire, symmetric memory and
copy engines refused across hosts) run on one machine; with NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1, NCCL's
traffic then takes the network path as between hosts."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

# (group name, its global ranks) -> the host name of each rank; the ranks too, as a name can come back for another
# group after destroy_process_group
_HOSTS: dict[tuple, tuple[str, ...]] = {}


def simulated_hosts() -> int | None:
    """MFSDP_EXT_SIMULATE_HOSTS (the module docstring), checked: None when unset."""
    value = os.environ.get("MFSDP_EXT_SIMULATE_HOSTS", "")
    if not value:
        return None
    world = dist.get_world_size()
    if not value.isdigit() or int(value) < 1 or world % int(value):
        raise ValueError(f"MFSDP_EXT_SIMULATE_HOSTS={value!r}: give a number of hosts that divides the world size "
                         f"({world})")
    return int(value)


def group_hosts(group: dist.ProcessGroup) -> tuple[str, ...]:
    """The host name of every rank of ``group``, in group-rank order. The first call per group is a collective
    (every rank must ask, in the same order); later calls read the cache."""
    simulated = simulated_hosts()
    if simulated is not None:
        per_host = dist.get_world_size() // simulated
        return tuple(f"simulated-host-{r // per_host}" for r in dist.get_process_group_ranks(group))
    key = (group.group_name, tuple(dist.get_process_group_ranks(group)))
    if key not in _HOSTS:
        hosts = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        _HOSTS[key] = tuple(hosts)
    return _HOSTS[key]


def torchrun_local_world_size() -> int | None:
    """torchrun's LOCAL_WORLD_SIZE (the ranks on this node), or None when the process was not started by torchrun."""
    simulated = simulated_hosts()
    if simulated is not None:
        return dist.get_world_size() // simulated
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() else None
