"""The default prefetch order: from the second iteration on, each unit's forward finds the next unit of the last
iteration's forward already gathered (its gather issued before this unit computes), and each unit's backward the
unit before it. The first iteration records the order and prefetches nothing in forward."""

from __future__ import annotations

import torch
import torch.nn as nn

from mfsdp_ext import fully_shard
from mfsdp_ext.core.states import ShardedState
from mfsdp_ext.testing.models import rank_device
from tests.conftest import get_pool


def _case_default_prefetch() -> dict:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]
    model = nn.Sequential(*blocks).to(rank_device())
    for b in blocks:
        fully_shard(b)
    fully_shard(model)
    seen: dict = {"forward": [], "backward": []}
    for i, b in enumerate(blocks[:-1]):  # registered after fully_shard's: they run once the unit is gathered
        nxt = blocks[i + 1]._mfsdp_unit
        b.register_forward_pre_hook(lambda m, a, nxt=nxt: seen["forward"].append(nxt.sharded_state))
    for i, b in enumerate(blocks[1:], start=1):
        prev = blocks[i - 1]._mfsdp_unit
        # when this block's input gradients are done, before the block before it starts its backward
        b.register_full_backward_hook(lambda m, gi, go, prev=prev: seen["backward"].append(prev.sharded_state))
    x = torch.randn(4, 16, device=rank_device(), requires_grad=True)
    per_iteration = []
    for _ in range(3):
        seen["forward"].clear()
        seen["backward"].clear()
        model(x).sum().backward()
        per_iteration.append({k: [s is ShardedState.UNSHARDED for s in v] for k, v in seen.items()})
    first, *later = per_iteration
    assert not any(first["forward"]), per_iteration  # nothing recorded yet to prefetch by
    for it in later:
        assert it["forward"] == [True] * 3 and it["backward"] == [True] * 3, per_iteration
    return {"per_iteration": per_iteration}


def test_default_prefetch():
    print(get_pool(2).run(_case_default_prefetch)[0])
