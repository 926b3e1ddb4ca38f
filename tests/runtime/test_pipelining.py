"""torch.distributed.pipelining over fully_shard units: pipeline parallel 2 x FSDP 2 on 4 gloo ranks, every schedule
torch ships, ours against FSDP2 in the same process (the same stages, data and optimizer): equal losses, equal
parameters after three steps, and the same gathers and reduce-scatters per step. Pipelining drives the units as it
drives FSDP2's: unshard(async_op=True) / reshard() actions, set_requires_gradient_sync(False) microbatches, the
REDUCE_GRAD step through fully_shard.state(...) (runtime/fsdp2_state.py), and for the zero-bubble schedules the
weight gradients computed after the input gradients (split backward)."""

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

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
D, MICROBATCHES, STEPS = 16, 4, 3


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _stages_of(schedule: str, pp_rank: int) -> tuple[int, list[int]]:
    """(stages in all, the stages this pipeline rank holds): one each, two interleaved, or a V."""
    if schedule in ("GPipe", "1F1B"):
        return 2, [pp_rank]
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return 4, [pp_rank, 3 - pp_rank]
    return 4, [pp_rank, pp_rank + 2]


def _train(schedule: str, fully_shard) -> dict:
    import torch.distributed.pipelining as pp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_mesh = mesh["pp"].get_local_rank(), mesh["dp"]
    n_stages, mine = _stages_of(schedule, pp_rank)
    torch.manual_seed(0)
    full = [_Stage() for _ in range(n_stages)]
    mods, stages = [], []
    for s in mine:
        for block in full[s].blocks:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)  # as torchtitan under PP
        fully_shard(full[s], mesh=dp_mesh, reshard_after_forward=False)
        mods.append(full[s])
        stages.append(pp.PipelineStage(full[s], s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    cls = getattr(pp, f"Schedule{schedule}")
    sched = cls(stages if n_stages == 4 else stages[0], n_microbatches=MICROBATCHES,
                loss_fn=lambda out, y: ((out - y) ** 2).mean(), scale_grads=True)
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.1)
    gen = torch.Generator().manual_seed(100 + dp_mesh.get_local_rank())
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(8, D, generator=gen), torch.randn(8, D, generator=gen)
        step_losses: list = []
        args = [x] if 0 in mine else []
        kwargs = {"target": y, "losses": step_losses} if n_stages - 1 in mine else {}
        sched.step(*args, **kwargs)
        opt.step()
        opt.zero_grad()
        losses.append([float(v) for v in step_losses])
    return {"losses": losses, "params": {f"{s}.{n}": p.full_tensor() for s, m in zip(mine, mods)
                                         for n, p in m.named_parameters()}}


def _case_schedule(schedule: str) -> dict:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    fsdp2_counts: Counter = Counter()
    # FSDP2's one flat collective per group (torch 2.13 names; 2.11 the older ones)
    names = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
             "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}
    originals = {n: getattr(dist, n) for pair in names.values() for n in pair if hasattr(dist, n)}

    def counted(kind, fn):
        def call(*args, **kwargs):
            fsdp2_counts[kind] += 1
            return fn(*args, **kwargs)
        return call

    for kind, pair in names.items():
        for n in pair:
            if n in originals:
                setattr(dist, n, counted(kind, originals[n]))
    try:
        with mfsdp_ext.use_as_fsdp2():  # pipelining asks fully_shard.state(...): ours answers for both
            theirs = _train(schedule, fsdp2_fully_shard)
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    ours_counts: Counter = Counter()
    names = ["all_gather_into", "reduce_scatter_into", "grouped_reduce_scatter_into"]
    with mfsdp_ext.use_as_fsdp2(), intercept_collectives(names, lambda n, a: ours_counts.update([n])):
        ours = _train(schedule, mfsdp_ext.fully_shard)
    assert ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
    diff = max(float((ours["params"][k] - theirs["params"][k]).abs().max()) for k in theirs["params"])
    assert diff <= 1e-6, diff
    gathers = ours_counts["all_gather_into"]
    reduces = ours_counts["reduce_scatter_into"] + ours_counts["grouped_reduce_scatter_into"]
    assert (gathers, reduces) == (fsdp2_counts["all_gather"], fsdp2_counts["reduce_scatter"]), (
        ours_counts, fsdp2_counts)
    return {"max_param_diff": diff, "gathers": gathers, "reduces": reduces}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipelining_schedule_matches_fsdp2(schedule):
    out = get_pool(4).run(_case_schedule, schedule)
    print(schedule, out[0])
