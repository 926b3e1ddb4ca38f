"""The ranks' agreement before each call of a graphed step (comm/host_agreement.py): every rank gets each value's
maximum over the ranks, decision after decision, through the shared mapping on one host and through gloo across
(simulated) hosts or where the mapping fails; a rank that never arrives is named in an error, and bad arguments are
refused."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mfsdp_ext import _native
from mfsdp_ext.comm.host_agreement import MaxAgreement


def _case_max_over_ranks(simulated_hosts: str):
    os.environ["MFSDP_EXT_SIMULATE_HOSTS"] = simulated_hosts
    try:
        agreement = MaxAgreement()
    finally:
        del os.environ["MFSDP_EXT_SIMULATE_HOSTS"]
    rank, world = dist.get_rank(), dist.get_world_size()
    assert (agreement.slots is not None) == (simulated_hosts == ""), simulated_hosts
    for decision in range(300):  # the ranks race ahead of each other: each decision's values stay apart
        values = [(decision * 7 + rank * 13) % 11, -rank, int(decision % world == rank), decision - rank]
        expected = [max((decision * 7 + r * 13) % 11 for r in range(world)), 0, 1, decision]
        assert agreement.max(values) == expected, (decision, values)
    return {"path": "shared mapping" if agreement.slots is not None else "gloo", "decisions": agreement.decisions}


@pytest.mark.parametrize("simulated_hosts", ["", "2"], ids=["one_host", "two_simulated_hosts"])
def test_max_over_ranks(cpu_pool, simulated_hosts):
    print(cpu_pool.run(_case_max_over_ranks, simulated_hosts)[0])


def _case_unmappable_falls_back():
    """A rank that cannot map the file (here the last one): every rank agrees through gloo instead."""
    original = torch.from_file

    def refuse(*args, **kwargs):
        raise OSError("no space left on device")

    if dist.get_rank() == dist.get_world_size() - 1:
        torch.from_file = refuse
    try:
        agreement = MaxAgreement()
    finally:
        torch.from_file = original
    assert agreement.slots is None
    assert agreement.max([dist.get_rank(), 5]) == [dist.get_world_size() - 1, 5]
    return {"path": "gloo"}


def test_unmappable_falls_back(cpu_pool):
    print(cpu_pool.run(_case_unmappable_falls_back)[0])


def test_missing_rank_is_named():
    slots = torch.zeros(2 * _native.AGREE_RANK_WORDS, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="rank 1 did not reach decision 1"):
        _native.host_max_agree(slots, 0, 2, 1, torch.tensor([3]), 0.05)
    slots[_native.AGREE_RANK_WORDS] = 1  # rank 1 published decision 1 (its values: zeros)
    values = torch.tensor([-3, 4])
    _native.host_max_agree(slots, 0, 2, 1, values, 0.05)
    assert values.tolist() == [0, 4]


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(10, dtype=torch.int64), 0, 2, 1, torch.tensor([1]), 1.0), "slots"),
    ((torch.zeros(48, dtype=torch.int64), 2, 2, 1, torch.tensor([1]), 1.0), "rank"),
    ((torch.zeros(48, dtype=torch.int64), 0, 2, 0, torch.tensor([1]), 1.0), "seq"),
    ((torch.zeros(48, dtype=torch.int64), 0, 2, 1, torch.zeros(9, dtype=torch.int64), 1.0), "values"),
])
def test_bad_arguments_refused(args, match):
    with pytest.raises(ValueError, match=match):
        _native.host_max_agree(*args)
