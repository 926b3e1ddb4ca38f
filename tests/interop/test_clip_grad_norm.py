"""torch.nn.utils.clip_grad_norm_ on sharded grads, including ranks that hold no rows of some parameters (gloo).

The reference is the same model unsharded on every rank, fed the whole global batch (the sharded model sees this
rank's slice; losses are means, so the grads agree): the total norm and every clipped gradient must match it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from mfsdp_ext import fully_shard, no_shard
from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, rank_device, shard_tiny_lm
from tests.test_fully_shard import GLOBAL_BATCH


class Uneven(nn.Module):
    """Parameters of 1 and 3 rows: on 2 or 4 ranks some ranks hold none of their rows (torch.chunk's split)."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(8, 8)
        self.gate = nn.Parameter(torch.randn(1, 8))  # (1, 8): only rank 0 holds a row
        self.inp = nn.Linear(8, 3)  # (3, 8) and (3,): rank 3 of 4 holds nothing
        self.out = nn.Linear(3, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(self.mix(x) * self.gate)))


def _shard(model: nn.Module, layout: str) -> nn.Module:
    world = dist.get_world_size()
    mesh = (init_device_mesh(rank_device().type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
            if layout == "hsdp" else None)
    if layout == "no_shard":
        no_shard(model.out if isinstance(model, Uneven) else model.aux)  # a replicated group in the root unit
    if isinstance(model, TinyLM):
        return shard_tiny_lm(model, fully_shard, mesh=mesh)
    fully_shard(model.inp, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _backward(model: nn.Module, sharded: bool) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    if isinstance(model, TinyLM):
        tokens, targets = batch(7, GLOBAL_BATCH, device=rank_device())
        lm_loss(model, tokens.chunk(world)[rank], targets.chunk(world)[rank]).backward()
    else:
        g = torch.Generator().manual_seed(7)
        x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)
        F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()


def _case_clip(model_name: str, layout: str, norm_type: float, foreach):
    torch.manual_seed(50)
    model = Uneven() if model_name == "uneven" else TinyLM(tie=False)
    ref = copy.deepcopy(model)
    _shard(model, layout)
    empty = [n for n, p in model.named_parameters() if p.to_local().numel() == 0]
    for _ in range(2):  # the second round: clipping again, on grads accumulated over two backwards
        _backward(model, sharded=True)
        _backward(ref, sharded=False)
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type=norm_type, foreach=foreach)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type, foreach=foreach)
        got = got.full_tensor()
        assert want > 0.05, want  # the clip is active
        assert torch.allclose(got, want, rtol=1e-5), (got, want)
        grads = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            assert torch.allclose(p.grad.full_tensor(), grads[n].grad, rtol=1e-5, atol=1e-7), n
    return {"norm": got.item(), "ranks' empty shards": empty}


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("model_name,layout", [("uneven", "1d"), ("uneven", "hsdp"), ("uneven", "no_shard"),
                                               ("tiny_lm", "1d"), ("tiny_lm", "no_shard")])
def test_clip_grad_norm_matches_unsharded(cpu_pool, model_name, layout, norm_type):
    if layout == "hsdp" and cpu_pool.world < 4:
        pytest.skip("HSDP takes a 2x2 mesh")
    print(cpu_pool.run(_case_clip, model_name, layout, norm_type, None))


def test_clip_grad_norm_per_tensor_path(cpu_pool):
    """foreach=False: torch computes one linalg.vector_norm per gradient instead of one _foreach_norm."""
    print(cpu_pool.run(_case_clip, "uneven", "1d", math.inf, False))
