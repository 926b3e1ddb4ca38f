"""torch.compile of blocks under fully_shard (gloo ranks, dynamo's "eager" backend: what dynamo captures, not
inductor's kernels). Our hooks run eagerly around the compiled forward, whichever way the block is compiled.

The reference is the same sharded model run eagerly: the eager backend runs the same ops, so losses are equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mfsdp_ext import fully_shard
from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, rank_device


def _losses(how: str) -> list[float]:
    torch.manual_seed(80)
    model = TinyLM()
    for b in model.blocks:
        if how == "module_first":  # torchtitan's order: compiled with fullgraph=True, then sharded
            b.compile(backend="eager", fullgraph=True)
        fully_shard(b)
        if how == "forward":  # the block's forward only (examples/train_hf.py --compile): hooks stay outside
            b.forward = torch.compile(b.forward, backend="eager")
        elif how == "module":  # nn.Module.compile(): dynamo traces _call_impl, hooks included
            b.compile(backend="eager")
    fully_shard(model)
    if how == "wrapped":  # torch.compile(block): an OptimizedModule around it, hooks included
        for i, b in enumerate(list(model.blocks)):
            model.blocks[i] = torch.compile(b, backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(3):
        tokens, targets = batch(step, 8, device=rank_device())
        loss = lm_loss(model, tokens.chunk(world)[rank], targets.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _case_compiled_blocks(how: str):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    got = _losses(how)
    breaks = dict(counters["graph_break"])
    want = _losses("eager")
    assert got == want, (got, want)
    # one graph for the blocks' body (they share code); no break, or (torch.compile(block), whose hooks are
    # traced through our wrapper) only where the wrapper skips our hooks
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    if how == "wrapped":
        assert all("disable" in reason or "skipped" in reason for reason in breaks), list(breaks)
    else:
        assert not breaks, list(breaks)
    return {"graphs": counters["stats"]["unique_graphs"], "graph breaks": sum(breaks.values())}


@pytest.mark.parametrize("how", ["forward", "module", "module_first", "wrapped"])
def test_compiled_blocks_train_as_eager(cpu_pool, how):
    print(cpu_pool.run(_case_compiled_blocks, how)[0])
