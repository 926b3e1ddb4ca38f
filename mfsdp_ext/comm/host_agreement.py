"""The ranks agree on a few integers (each one's maximum over the ranks) without touching the device: what
mfsdp_ext.graphed decides together before every call. When every rank runs on this host, through a file mapped by
all of them (the native host_max_agree: microseconds); across hosts (or hosts simulated by MFSDP_EXT_SIMULATE_HOSTS),
one all-reduce over a gloo group."""

from __future__ import annotations

import os
import tempfile
import uuid

import torch
import torch.distributed as dist

from .. import _native
from .hosts import group_hosts

TIMEOUT_S = 600.0  # a rank that never arrives: an error names it after this long


class MaxAgreement:
    """Made on every rank of the default process group at the same point (the first use is a collective)."""

    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo")
        self.decisions = 0
        self.slots: torch.Tensor | None = None
        if len(set(group_hosts(self.group))) == 1:
            self.slots = self._map_shared()

    def _map_shared(self) -> torch.Tensor | None:
        """The file every rank maps: made by rank 0, mapped by all, then unlinked (the mappings keep it). None on
        every rank when some rank could not make or map it (a full or read-only folder): gloo is used instead."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        words = self.world * _native.AGREE_RANK_WORDS
        name = [""]
        if self.rank == 0:
            name[0] = os.path.join(folder, f"mfsdp_ext_agree_{uuid.uuid4().hex}")
            try:
                with open(name[0], "wb") as f:
                    f.write(bytes(8 * words))
            except OSError:
                name[0] = ""
        dist.broadcast_object_list(name, src=0, group=self.group)
        if not name[0]:
            return None
        try:
            slots: torch.Tensor | None = torch.from_file(name[0], shared=True, size=words, dtype=torch.int64)
        except (OSError, RuntimeError):
            slots = None
        mapped = torch.tensor([int(slots is not None)])
        dist.all_reduce(mapped, op=dist.ReduceOp.MIN, group=self.group)  # also: every rank has mapped it by now
        if self.rank == 0:
            os.unlink(name[0])
        return slots if mapped.item() else None

    def max(self, values: list[int]) -> list[int]:
        """Each of ``values``' maximum over the ranks (every rank calls with as many values, in the same order)."""
        flag = torch.tensor(values, dtype=torch.int64)
        self.decisions += 1
        if self.slots is not None:
            _native.host_max_agree(self.slots, self.rank, self.world, self.decisions, flag, TIMEOUT_S)
        else:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag.tolist()
