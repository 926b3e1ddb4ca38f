"""FSDP2's reshard_after_forward=N (an int): after forward each block keeps its gathered weights sharded over groups of
N ranks, and its backward gathers within the group. On 4 gloo ranks (a 1-D mesh, N=2) and a 2 x 2 HSDP mesh (N=2: the
shard dim's size, which is True), ours against FSDP2: the same losses and parameters; on the 1-D mesh every block's
backward gather runs over 2 ranks, its forward gather over 4."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import mfsdp_ext
from mfsdp_ext.testing.models import intercept_collectives

from ..conftest import get_pool

STEPS = 3


def _train(fully_shard, hsdp: bool) -> tuple[list[float], torch.Tensor]:
    world = dist.get_world_size()
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (world,)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 30), nn.Tanh(), nn.Linear(30, 16)) for _ in range(3)])
    for block in model:
        fully_shard(block, mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = model(torch.randn(4, 16, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, torch.cat([p.full_tensor().flatten() for p in model.parameters()])


def _case_reshard_to_two(hsdp: bool) -> dict:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    theirs = _train(fsdp2_fully_shard, hsdp)
    sizes: Counter = Counter()
    with intercept_collectives(["all_gather_into"], lambda name, args: sizes.update([dist.get_world_size(args[2])])):
        ours = _train(mfsdp_ext.fully_shard, hsdp)
    assert ours[0] == theirs[0], (ours[0], theirs[0])
    assert torch.equal(ours[1], theirs[1]), float((ours[1] - theirs[1]).abs().max())
    if not hsdp:  # 3 blocks (the root owns no parameters): each step a forward gather over 4 ranks and a backward
        # gather over 2, but the last block's from the second step on: kept gathered, its backward comes first
        assert sizes[4] == 3 * STEPS and sizes[2] == 3 * STEPS - (STEPS - 1), sizes
    return {"gathers_by_group_size": dict(sizes)}


@pytest.mark.parametrize("hsdp", [False, True], ids=["1d", "hsdp"])
def test_reshard_after_forward_int_matches_fsdp2(hsdp):
    print(get_pool(4).run(_case_reshard_to_two, hsdp)[0])
