"""mfsdp_ext.graphed on the CPU: it runs the step eagerly with one warning (the same numbers), and the key that
decides a new capture sees what a graph depends on. Capture and replay against eager steps, bit for bit, are GPU
tests (tests/test_gpu.py::test_graphed_whole_step)."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import torch
import torch.distributed as dist

import mfsdp_ext
from mfsdp_ext import fully_shard
from mfsdp_ext.graphs import GraphedStep

from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, lm_train_step, rank_device, shard_tiny_lm


def _case_cpu_runs_eagerly():
    torch.manual_seed(5)
    base = TinyLM(tie=False).to(rank_device())
    models = [shard_tiny_lm(copy.deepcopy(base), fully_shard) for _ in range(2)]
    opts = [mfsdp_ext.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    rank, world = dist.get_rank(), dist.get_world_size()

    step = mfsdp_ext.graphed(lm_train_step(models[0], opts[0]), warmup=1)
    eager = lm_train_step(models[1], opts[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(4):
            tokens, targets = (t.chunk(world)[rank] for t in batch(s, 4 * world))
            assert torch.equal(step(tokens, targets), eager(tokens, targets)), s
    graphed_warnings = [w for w in caught if "mfsdp_ext.graphed" in str(w.message)]
    assert len(graphed_warnings) == 1, [str(w.message) for w in caught]
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p.to_local(), q.to_local())
    return {"warning": str(graphed_warnings[0].message)}


def _case_key_sees_what_a_graph_depends_on():
    model = shard_tiny_lm(TinyLM(tie=False).to(rank_device()), fully_shard)
    opt = mfsdp_ext.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = batch(0, 4)
    lm_loss(model, tokens, targets).backward()  # lazy init: the model's context exists
    step = GraphedStep(lambda *a: None, warmup=1)
    step.optimizers[id(opt)] = opt
    ctx = model._mfsdp_unit.context
    step.contexts = [weakref.ref(ctx)]  # as a capture notes the roots whose forward ran in it (ctx.iteration.count)

    def key(*args):
        from torch.utils import _pytree as pytree

        leaves, spec = pytree.tree_flatten((args, {}))
        return step._key(leaves, spec)

    other = shard_tiny_lm(TinyLM(tie=False).to(rank_device()), fully_shard)  # a model the step does not use
    iterations = ctx.iteration.count
    lm_loss(other, tokens, targets).backward()
    assert ctx.iteration.count == iterations and other._mfsdp_unit.context.iteration.count == 1
    first = key(tokens, targets, 0.5)
    assert key(tokens, targets, 0.5) == first
    other.eval()
    assert key(tokens, targets, 0.5) == first  # built, switched to eval, then collected: nothing to capture again
    del other
    gc.collect()
    assert key(tokens, targets, 0.5) == first
    changed = {"shape": key(tokens[:1], targets[:1], 0.5), "value": key(tokens, targets, 0.25)}
    model.eval()
    changed["eval"] = key(tokens, targets, 0.5)
    model.train()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    changed["param_group"] = key(tokens, targets, 0.5)
    assert all(k != first for k in changed.values()), [n for n, k in changed.items() if k == first]
    return sorted(changed)


def _case_key_sees_writes_to_held_units():
    """The held units' gathered copies live across replays: the key changes when their weights are written outside
    the graph (a hand-written update, their own optimizer stepped eagerly) and not for what leaves them alone (an
    evaluation forward, another model's optimizer step). A changed key on some rank stops holding on every rank."""
    torch.manual_seed(7)
    model, other = (shard_tiny_lm(TinyLM(tie=False).to(rank_device()), fully_shard) for _ in range(2))
    opt, other_opt = (mfsdp_ext.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, other))
    tokens, targets = batch(0, 4)
    for m, o in ((model, opt), (other, other_opt)):
        lm_train_step(m, o)(tokens, targets)
    step = GraphedStep(lambda *a: None, warmup=1)
    ctx = model._mfsdp_unit.context
    step.contexts = [weakref.ref(ctx)]
    assert step._held_writes() == ()  # nothing held: nothing to watch
    for unit in ctx.order.forward[:2]:  # as a capture holds the forward's first units
        unit.held_by = weakref.ref(step)
    step.steps_at_capture = mfsdp_ext.core.registry.optimizer_steps()
    first = step._held_writes()
    unchanged, changed = {}, {}
    lm_train_step(other, other_opt)(tokens, targets)
    unchanged["other model's step"] = step._held_writes()
    model.eval()
    with torch.no_grad():
        lm_loss(model, tokens, targets)
    model.train()
    unchanged["evaluation"] = step._held_writes()
    with torch.no_grad():
        model.emb.weight.mul_(0.5)
    changed["hand-written update"] = step._held_writes()
    first_after_write = changed["hand-written update"]
    lm_train_step(model, opt)(tokens, targets)
    changed["own optimizer, eager"] = step._held_writes()
    assert all(k == first for k in unchanged.values()), [n for n, k in unchanged.items() if k != first]
    assert changed["hand-written update"] != first and changed["own optimizer, eager"] != first_after_write
    step.key = ("spec", (), (), (), 0, first)
    seen = first if dist.get_rank() else changed["own optimizer, eager"]
    same = step._same_on_every_rank(("spec", (), (), (), 0, seen))
    assert not same and not step.hold_first_units  # rank 0 alone saw the write: every rank captures, holding none
    return {"unchanged": sorted(unchanged), "changed": sorted(changed)}


def test_key_sees_writes_to_held_units(cpu_pool):
    print(cpu_pool.run(_case_key_sees_writes_to_held_units)[0])


def _case_holds_only_models_the_step_runs():
    """Before a capture, mfsdp_ext.graphed gathers and holds the first units of the models its step runs (seen in
    the warm-up calls), never those of another live model: that one may be garbage still alive on one rank only,
    and its gathers would wait for the other ranks forever."""
    torch.manual_seed(3)
    model, other = (shard_tiny_lm(TinyLM(tie=False).to(rank_device()), fully_shard) for _ in range(2))
    opt = mfsdp_ext.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = batch(0, 4)
    lm_loss(other, tokens, targets).backward()  # alive, initialised, idle
    step = GraphedStep(lm_train_step(model, opt), warmup=1)
    step._warm_up((tokens, targets), {})
    held = step._hold_first_units()
    ctx = model._mfsdp_unit.context
    assert [u.name for u in held] == [u.name for u in ctx.order.forward[:2]], [u.name for u in held]
    assert all(u.context is ctx for u in held)
    assert not any(u.held_for_graph for u in other._mfsdp_unit.context.units)
    step._release_held()
    assert not any(u.held_for_graph for u in ctx.units)
    return {"held": [u.name for u in held]}


def test_holds_only_models_the_step_runs(cpu_pool):
    print(cpu_pool.run(_case_holds_only_models_the_step_runs)[0])


def _case_live_contexts_in_creation_order():
    """mfsdp_ext.graphed gathers the idle models' first units before a capture, model by model: every rank must
    take the models in one order (their collectives share a communicator), so live() lists them in the order
    their first forwards made them, whatever the order of the set that holds them."""
    from mfsdp_ext.runtime.context import FsdpContext

    models = [shard_tiny_lm(TinyLM(vocab=16, dim=8, ffn=16, n_layers=1, tie=False), fully_shard) for _ in range(12)]
    tokens, targets = batch(0, 2, seq=4, vocab=16)
    for model in reversed(models):  # the first forward makes a model's context
        lm_loss(model, tokens, targets)
    made = [weakref.ref(m._mfsdp_unit.context) for m in reversed(models)]
    del models[3]
    gc.collect()
    kept = [ref() for ref in made if ref() is not None]
    listed = [ctx for ctx in FsdpContext.live() if any(ctx is k for k in kept)]
    assert len(kept) == 11 and [id(c) for c in listed] == [id(c) for c in kept]
    return {"models": len(listed)}


def test_live_contexts_in_creation_order(cpu_pool):
    print(cpu_pool.run(_case_live_contexts_in_creation_order)[0])


def _case_decided_on_every_rank():
    """Whether the graph fits is one decision for all ranks (a replay is a collective): each rank's own device is
    not a difference, a shape that differs between ranks is an error, a change on one rank recaptures on all."""
    rank = dist.get_rank()
    step = GraphedStep(lambda *a: None, warmup=1)

    def key(rows, changed=False):
        return ("spec", (((rows, 4), torch.float32, torch.device("cuda", rank)),), (), (), 7 + changed)

    step.key = key(2)
    assert step._same_on_every_rank(key(2))
    assert not step._same_on_every_rank(key(2, changed=rank == 0))  # rank 0 alone changed: every rank recaptures
    try:
        step._same_on_every_rank(key(2 + rank))
    except RuntimeError as exc:
        assert "different argument shapes" in str(exc)
        return {"error": str(exc)}
    raise AssertionError("ranks with different shapes were not told")


def test_decided_on_every_rank(cpu_pool):
    print(cpu_pool.run(_case_decided_on_every_rank)[0])


def test_cpu_runs_eagerly(cpu_pool):
    print(cpu_pool.run(_case_cpu_runs_eagerly)[0])


def test_key_sees_what_a_graph_depends_on(cpu_pool):
    print(cpu_pool.run(_case_key_sees_what_a_graph_depends_on)[0])
