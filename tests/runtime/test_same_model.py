"""Ranks that build or shard different models get the same clear error on every rank at the first forward,
never a hang in a mismatched collective (gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mfsdp_ext import fully_shard
from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, rank_device


def _build(variant: str) -> TinyLM:
    """TinyLM, sharded per block and at the root; rank 1 departs from it as ``variant`` says."""
    odd = dist.get_rank() == 1
    torch.manual_seed(70)
    model = TinyLM(ffn=24 if odd and variant == "linear_size" else 20)
    for i, b in enumerate(model.blocks):
        if not (odd and variant == "block_not_sharded" and i == 1):
            fully_shard(b, reshard_after_forward=not (odd and variant == "argument"))
    if not (odd and variant == "root_not_sharded"):
        fully_shard(model)
    return model


def _case_mismatch(variant: str) -> str:
    model = _build(variant)
    tokens, targets = batch(0, 8, device=rank_device())
    with pytest.raises(RuntimeError, match="the ranks shard different models") as err:
        lm_loss(model, tokens, targets).backward()
    return str(err.value)


def _case_same_model_trains() -> float:
    model = _build("none")
    tokens, targets = batch(0, 8, device=rank_device())
    loss = lm_loss(model, tokens, targets)
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("variant,fragment", [
    ("linear_size", "fc1.weight(20, 12)"),  # rank 0's line names the (20, 12) weight; rank 1's the (24, 12)
    ("block_not_sharded", "blocks.1.norm.weight(12,)"),  # in the root's group on rank 1
    ("root_not_sharded", "unit <root> (TinyLM)"),
    ("argument", "reshard_after_forward=True"),
])
def test_ranks_that_differ_fail_alike(cpu_pool, variant, fragment):
    messages = cpu_pool.run(_case_mismatch, variant)
    print(messages[0])
    assert all(m == messages[0] for m in messages), messages  # the same error on every rank
    assert fragment in messages[0] and "rank 0 has" in messages[0] and "rank 1 has" in messages[0], messages[0]


def test_same_model_passes_the_check(cpu_pool):
    print(cpu_pool.run(_case_same_model_trains))
