"""The copy-engine all-gather's piece mapping (mfsdp_ext.comm.copy_engine), on 2 and 4 gloo ranks.

On GPUs each rank reads its peers' symmetric buffers directly (tests/test_gpu.py::test_copy_engine_all_gather).
Here a gloo all-gather of the buffers takes the place of that mapping, inside the barrier, so the copies the
all-gather makes (which rank's buffer, which offset, which parameter piece) are checked against the plain
all-gather on every group of a model, for shards that split parameters unevenly across ranks.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from mfsdp_ext import MixedPrecisionPolicy, fully_shard
from mfsdp_ext.comm.copy_engine import CopyEngineAllGather, CopyEngineStage, gathers_by_copy_engine

from .models import TinyLM, batch, lm_loss, shard_tiny_lm


class _ExchangedStage:
    """CopyEngineStage's interface over CPU buffers: its barrier all-gathers every rank's buffer into ``peers``."""

    view = CopyEngineStage.view

    def __init__(self, nbytes: int):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.peers = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(self.world)]
        self.barriers = 0

    def barrier(self) -> None:
        dist.all_gather(self.peers, self.peers[self.rank].clone())
        self.barriers += 1


def _case_pieces_match_plain_gather():
    torch.manual_seed(5)
    # odd sizes: parameters split unevenly, some ranks' chunks empty or padded
    model = shard_tiny_lm(TinyLM(vocab=37, dim=12, ffn=20, n_layers=2, tie=False), fully_shard,
                          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    tokens, targets = batch(0, 8, seq=4, vocab=37)
    lm_loss(model, tokens, targets).backward()  # lazy init; the groups' layouts and views exist from here
    groups = [g for u in model._mfsdp_unit.context.units for g in u.groups if gathers_by_copy_engine(g)]
    assert groups
    checked = 0
    for g in groups:
        stats = copy.copy(g.stats)
        slots = range(len(g.layout.slots))
        g.all_gather()
        plain = [g.unsharded.param_view(i).clone() for i in slots]
        g.unsharded.data.zero_()
        stage = _ExchangedStage(g.layout.shard_numel * g.compute_dtype.itemsize)
        g.all_gather(CopyEngineAllGather(stage, g))
        assert stage.barriers == 2
        for i in slots:
            assert torch.equal(g.unsharded.param_view(i), plain[i]), (g.unit().name, i)
        assert any(p.abs().sum() > 0 for p in plain)  # the weights are not all zero: the copies wrote them
        g.stats = stats
        g.free_unsharded()
        checked += 1
    return {"groups": checked}


def test_pieces_match_plain_gather(cpu_pool):
    print(cpu_pool.run(_case_pieces_match_plain_gather)[0])
