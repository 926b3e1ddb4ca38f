"""mfsdp_ext.graphed on the CPU: it runs the step eagerly with one warning (the same numbers), and the key that
decides a new capture sees what a graph depends on. Capture and replay against eager steps, bit for bit, are GPU
tests (test_graphed_whole_step and test_graphed_two_optimizers at the end)."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist

import mfsdp_ext
from mfsdp_ext import MixedPrecisionPolicy, fully_shard
from mfsdp_ext.graphs import GraphedStep
from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, lm_train_step, rank_device, shard_tiny_lm
from tests.runtime.test_capture import _accumulate


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


# ----------------------------------------------------------------------------------------------- GPU: graphed steps
def _assert_same_shards(graphed_model, eager_model) -> None:
    """The graphed model's fp32 shards equal its eager twin's, bit for bit."""
    for (name, p), q in zip(graphed_model.named_parameters(), eager_model.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), name


def _case_graphed_whole_step(fp8: bool, microbatches: int, optimizer: str):
    """mfsdp_ext.graphed over the whole step (forward, backward with microbatches, clipping-free AdamW/SGD step with
    a scheduler changing the lr every step, zero_grad): 20 graphed steps equal 20 eager steps of a twin bit for
    bit (losses and fp32 shards). The graph holds the forward's first two units gathered across replays; an
    evaluation between graphed steps runs eagerly and leaves the graph valid; a write to a held unit's weights
    outside the graph is seen: the next call captures again (2 captures in all), holding none from then on."""
    import mfsdp_ext

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  fp8=mfsdp_ext.Fp8Policy() if fp8 else None)
    torch.manual_seed(13)
    base = TinyLM(vocab=64, dim=64, ffn=128, n_layers=3, tie=False).to(rank_device())
    models = [shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=policy) for _ in range(2)]
    make = (lambda m: mfsdp_ext.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)) if optimizer == "adamw" \
        else (lambda m: mfsdp_ext.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9))
    opts = [make(m) for m in models]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def make_step(model, opt):
        def train_step(tokens, targets):
            total = _accumulate(model, tokens, targets, microbatches)
            opt.step()
            opt.zero_grad()
            return total
        return train_step

    graphed = mfsdp_ext.graphed(make_step(models[0], opts[0]), warmup=2)
    eager = make_step(models[1], opts[1])
    ours, theirs, evaluated, held = [], [], [], []
    for step in range(20):
        tokens, targets = (t.chunk(world)[rank] for t in batch(step, 32 * world, seq=16, vocab=64))
        if step == 8:  # evaluation between graphed steps
            for m in models:
                m.eval()
                with torch.no_grad():
                    evaluated.append(lm_loss(m, tokens, targets).item())
                m.train()
        if step == 12:  # a hand-written update of the root's (a held unit's) weights, outside the graph
            with torch.no_grad():
                for m in models:
                    m.emb.weight.mul_(0.5)
        ours.append(graphed(tokens, targets).item())
        theirs.append(eager(tokens, targets).item())
        for s in scheds:
            s.step()
        if step == 5:
            held = [u.name for u in models[0]._mfsdp_unit.context.units if u.held_for_graph]
    assert len(held) == 2, held
    assert graphed.captures == 2 and not graphed.hold_first_units, (graphed.captures, graphed.hold_first_units)
    assert evaluated[0] == evaluated[1], evaluated
    assert ours == theirs, (ours, theirs)
    _assert_same_shards(*models)
    assert opts[0].state_dict()["state"].keys() == opts[1].state_dict()["state"].keys()
    return {"first": ours[:3], "last": ours[-1]}


@pytest.mark.gpu
@pytest.mark.parametrize("fp8,microbatches,optimizer", [(False, 1, "adamw"), (False, 2, "sgd"), (True, 2, "adamw")],
                         ids=["bf16-adamw", "bf16-mb2-sgd", "fp8-mb2-adamw"])
def test_graphed_whole_step(gpu_pool_from_one, fp8, microbatches, optimizer):
    print(gpu_pool_from_one.run(_case_graphed_whole_step, fp8, microbatches, optimizer)[0])


def _case_graphed_two_optimizers():
    """A graphed step with two optimizers, the blocks' stepped first and the root's after it: the first one's step
    gathers the held units before the second has updated the root, and the graph's end gathers the root again.
    10 graphed steps equal an eager twin's bit for bit, with one capture and two units held."""
    import mfsdp_ext

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(19)
    base = TinyLM(vocab=64, dim=64, ffn=128, n_layers=3, tie=False).to(rank_device())
    models = [shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=policy) for _ in range(2)]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def make_step(model):
        blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
        root = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
        first, second = mfsdp_ext.optim.AdamW(blocks, lr=1e-3), mfsdp_ext.optim.AdamW(root, lr=2e-3)

        def train_step(tokens, targets):
            loss = lm_loss(model, tokens, targets)
            loss.backward()
            for opt in (first, second):
                opt.step()
                opt.zero_grad()
            return loss.detach()
        return train_step

    graphed, eager = mfsdp_ext.graphed(make_step(models[0]), warmup=2), make_step(models[1])
    ours, theirs = [], []
    for step in range(10):
        tokens, targets = (t.chunk(world)[rank] for t in batch(step, 32 * world, seq=16, vocab=64))
        ours.append(graphed(tokens, targets).item())
        theirs.append(eager(tokens, targets).item())
    held = [u.name for u in models[0]._mfsdp_unit.context.units if u.held_for_graph]
    assert graphed.captures == 1 and len(held) == 2, (graphed.captures, held)
    assert ours == theirs, (ours, theirs)
    _assert_same_shards(*models)
    return {"losses": ours[-3:], "held": held}


@pytest.mark.gpu
def test_graphed_two_optimizers(gpu_pool_from_one):
    print(gpu_pool_from_one.run(_case_graphed_two_optimizers)[0])


def _case_graphed_hf_llama():
    """A HuggingFace LlamaForCausalLM (transformers, from a LlamaConfig) under fully_shard, the whole step through
    mfsdp_ext.graphed: 8 graphed steps equal 8 eager steps of a twin bit for bit (losses and fp32 shards), with one
    capture. Both are given the same explicit 4-D causal mask, which transformers hands SDPA as it is: without one it
    chooses SDPA's is_causal or a mask it builds by what it sees, and under stream capture it may choose otherwise
    (other kernels, docs/cuda_graphs.md). SDPA's math backend on both sides, whose backward is deterministic."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                         attn_implementation="sdpa")
    torch.manual_seed(3)
    base = LlamaForCausalLM(config).to(rank_device())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = []
    for _ in range(2):
        model = copy.deepcopy(base)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        models.append(fully_shard(model, mp_policy=policy))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def make_step(model):
        opt = mfsdp_ext.optim.AdamW(model.parameters(), lr=1e-3)

        def train_step(ids, mask):
            loss = model(input_ids=ids, labels=ids, attention_mask=mask).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return train_step

    graphed, eager = mfsdp_ext.graphed(make_step(models[0]), warmup=2), make_step(models[1])
    ours, theirs = [], []
    causal = torch.full((32, 32), float("-inf"), device=rank_device()).triu(1)[None, None].expand(2, 1, 32, 32)
    with sdpa_kernel(SDPBackend.MATH):
        for step in range(8):
            ids = torch.randint(0, 128, (2 * world, 32), generator=torch.Generator().manual_seed(100 + step))
            ids = ids.chunk(world)[rank].to(rank_device())
            ours.append(graphed(ids, causal).item())
            theirs.append(eager(ids, causal).item())
    assert graphed.captures == 1, graphed.captures
    assert ours == theirs, (ours, theirs)
    _assert_same_shards(*models)
    return {"losses": ours[-3:]}


@pytest.mark.gpu
def test_graphed_hf_llama(gpu_pool):
    pytest.importorskip("transformers")
    print(gpu_pool.run(_case_graphed_hf_llama)[0])
