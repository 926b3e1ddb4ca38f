"""The host work before each replay of a graphed optimizer step (optim/graph_tables.py): through the plan that the
previous call left, it fills the device tables with the same bytes, and leaves the same step counters and state
dict, as the long way (every parameter's key, as an eager step computes it), across lr changes, steps outside the
graph and loaded state. On the CPU: the tables are filled as on a GPU; only the replay itself needs one."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import mfsdp_ext.optim as mo
from mfsdp_ext import fully_shard
from mfsdp_ext.optim.flat_state import build_runs
from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, lm_train_step, rank_device, shard_tiny_lm


def _make(kind: str, model):
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    if kind == "adamw":
        return mo.AdamW([{"params": blocks}, {"params": rest, "lr": 3e-3, "weight_decay": 0.0}], lr=1e-2)
    return mo.SGD([{"params": blocks}, {"params": rest, "momentum": 0.0}], lr=5e-2, momentum=0.9)


def _as_captured(opt, model, tokens, targets) -> None:
    """What a capture leaves in the optimizer: its device tables, and per group the parameters stepped and the
    runs (keyed as the captured step keyed them: counters advanced)."""
    lm_loss(model, tokens, targets).backward()
    opt.graph_begin()
    flat_work, _, _ = opt._split()
    for group, items in flat_work.items():
        runs, _, _ = build_runs(group, [(i, opt._flat_key(gi, p)) for i, p, gi in items])
        opt._graph.items[group], opt._graph.runs[group] = items, runs


def _used_bytes(opt) -> list[torch.Tensor]:
    graph = opt._graph
    return [graph.tables[g][: graph.runs[g].shape[0] * 48].clone() for g in graph.items]


def _case_plan_equals_long_way(kind: str):
    torch.manual_seed(3)
    base = TinyLM(tie=False).to(rank_device())
    models = [shard_tiny_lm(copy.deepcopy(base), fully_shard) for _ in range(2)]
    opts = [_make(kind, m) for m in models]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts]
    tokens, targets = batch(0, 4)
    for m, o in zip(models, opts):
        for _ in range(2):
            lm_train_step(m, o)(tokens, targets)
        _as_captured(o, m, tokens, targets)
    fast, slow = opts
    long_way = []
    per_parameter = fast._prologue_per_parameter
    fast._prologue_per_parameter = lambda: (long_way.append(call), per_parameter())
    outside = {4: "eager step", 7: "load_state_dict"}
    for call in range(10):
        if call in outside:  # between replays, on both: the next call's host work goes the long way
            for m, o in zip(models, opts):
                if call == 4:
                    lm_train_step(m, o)(tokens, targets)
                else:
                    o.load_state_dict(copy.deepcopy(o.state_dict()))
        slow._graph.plan = None  # the reference: every call the long way
        fast.graph_prologue()
        slow.graph_prologue()
        for a, b in zip(_used_bytes(fast), _used_bytes(slow)):
            assert torch.equal(a, b), call
        assert _equal_state(fast, slow), call
        for s in scheds:
            s.step()
    # the first call went the long way and left a plan for calls 1-3; the steps outside the graph, the same
    assert long_way == [0, *outside], long_way
    return {"kind": kind, "long_way": long_way}


def _equal_state(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k in sa["state"]:
        for name, value in sa["state"][k].items():
            other = sb["state"][k][name]
            local = (lambda t: t.to_local() if hasattr(t, "to_local") else t)
            assert torch.equal(local(value), local(other)), (k, name)
    return True


def _case_counters_load_into_torch():
    """After replays through a plan, AdamW's steps are 0-dim views of one tensor: they read, save and load into
    torch.optim.AdamW as its own scalar steps."""
    torch.manual_seed(4)
    model = shard_tiny_lm(TinyLM(tie=False).to(rank_device()), fully_shard)
    opt = mo.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = batch(0, 4)
    lm_train_step(model, opt)(tokens, targets)
    _as_captured(opt, model, tokens, targets)
    for _ in range(3):
        opt.graph_prologue()
    steps = [s["step"] for s in opt.state.values()]
    assert all(s.dim() == 0 and s.dtype == torch.float32 and s.item() == 5.0 for s in steps), steps
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    theirs = torch.optim.AdamW(model.parameters(), lr=1e-2)
    theirs.load_state_dict(torch.load(buffer, weights_only=False))
    assert [s["step"].item() for s in theirs.state.values()] == [5.0] * len(steps)
    return {"steps": len(steps)}


def _case_nothing_stepped(kind: str):
    """An optimizer the captured step called without gradients (nothing of it stepped in the graph): its replays'
    host work is empty, the long way and through the plan."""
    model = shard_tiny_lm(TinyLM(tie=False).to(rank_device()), fully_shard)
    opt = _make(kind, model)
    lm_train_step(model, opt)(*batch(0, 4))
    opt.graph_begin()  # as a capture that stepped none of its groups leaves it
    for _ in range(3):
        opt.graph_prologue()
    assert opt._graph.plan is not None and opt._graph.plan.keys == []
    return {"kind": kind}


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_nothing_stepped(cpu_pool, kind):
    print(cpu_pool.run(_case_nothing_stepped, kind)[0])


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_plan_equals_long_way(cpu_pool, kind):
    print(cpu_pool.run(_case_plan_equals_long_way, kind)[0])


def test_counters_load_into_torch(cpu_pool):
    print(cpu_pool.run(_case_counters_load_into_torch)[0])
