"""fully_shard (ZeRO-3) against a single-process reference and FSDP2, on 2 and 4 gloo ranks (the parity cases also on 2
and 4 GPUs with NCCL: the GPU tests at the end, ``pytest -m gpu``).

The ``_case_*`` functions run on every rank of a pool (tests/dist_pool.py); they assert and return numbers.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import mfsdp_ext
from mfsdp_ext import MixedPrecisionPolicy, fully_shard, microbatch
from mfsdp_ext.interop.checkpoint import full_state_dict
from mfsdp_ext.testing.models import TinyLM, batch, rank_device, rel_err, root_groups, shard_tiny_lm, train

STEPS = 5
GLOBAL_BATCH = 24  # divisible by 2 ranks x 3 microbatches and 4 ranks x 3 microbatches


def _compare_params(model, ref) -> float:
    full = full_state_dict(model)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    assert full.keys() == ref_params.keys(), (sorted(full), sorted(ref_params))
    return max(rel_err(full[k], ref_params[k].detach()) for k in full)


def _parity(sharded, ref, *, microbatches=1, use_microbatch_api=False, tol=1e-5):
    losses = train(sharded, STEPS, GLOBAL_BATCH, sharded=True, microbatches=microbatches,
                   microbatch_ctx=microbatch if use_microbatch_api else None)
    ref_losses = train(ref, STEPS, GLOBAL_BATCH, sharded=False, microbatches=1)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_err = _compare_params(sharded, ref)
    assert loss_err <= tol and param_err <= tol, (loss_err, param_err, losses, ref_losses)
    return {"loss_err": loss_err, "param_err": param_err}


class ScoringLM(TinyLM):
    """Methods other than forward, as RL and evaluation code has: they call forward and use the root's own
    parameters directly (FSDP2: torch.distributed.fsdp.register_fsdp_forward_method)."""

    def score(self, tokens, targets):
        penalty = 0.01 * self.aux.weight.square().sum()  # a root parameter, before forward gathers the root
        logits, aux = self(tokens)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return logp.mean() - 0.01 * aux.square().mean() - penalty

    def features(self, tokens):  # no forward call: the root's embedding and norm, the blocks' own hooks
        h = self.emb(tokens)
        for b in self.blocks:
            h = b(h)
        return self.norm(h)

    def generate(self, tokens, n: int):
        for _ in range(n):
            logits, _ = self(tokens)
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], 1)
        return tokens


def _case_forward_method():
    """register_fsdp_forward_method: training through a method that calls forward and reads a root parameter
    itself, and greedy generation under no_grad between steps, equal the single-process model."""
    torch.manual_seed(6)
    model = ScoringLM(tie=False)
    ref = copy.deepcopy(model).to(rank_device())
    shard_tiny_lm(model, fully_shard)
    for name in ("score", "generate", "features"):
        mfsdp_ext.register_fsdp_forward_method(model, name)
    rank, world = dist.get_rank(), dist.get_world_size()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    generated = []
    for step in range(4):
        tokens, targets = batch(step, GLOBAL_BATCH)
        for m, opt, sharded in ((model, opts[0], True), (ref, opts[1], False)):
            t, y = (tokens.chunk(world)[rank], targets.chunk(world)[rank]) if sharded else (tokens, targets)
            (-m.score(t, y)).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            ours, theirs = model.generate(tokens[:2, :3], 4), ref.generate(tokens[:2, :3], 4)
            features_err = rel_err(model.features(tokens), ref.features(tokens))
        assert torch.equal(ours, theirs), (step, ours, theirs)
        assert features_err <= 1e-6, (step, features_err)
        generated.append(ours[0].tolist())
    param_err = _compare_params(model, ref)
    assert param_err <= 1e-5, param_err
    assert not any(u.forward_method_depth for u in (model._mfsdp_unit, *(b._mfsdp_unit for b in model.blocks)))
    with pytest.raises(ValueError, match="not fully_shard"):
        mfsdp_ext.register_fsdp_forward_method(ScoringLM(), "score")
    with pytest.raises(ValueError, match="no method 'sample'"):
        mfsdp_ext.register_fsdp_forward_method(model, "sample")
    return {"param_err": param_err, "generated": generated[-1]}


def _case_fp32_parity(model_kwargs=None):
    torch.manual_seed(0)
    model = TinyLM(**(model_kwargs or {}))
    ref = copy.deepcopy(model).to(rank_device())
    shard_tiny_lm(model, fully_shard)
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return _parity(model, ref)


def _case_grad_accumulation(k: int):
    torch.manual_seed(1)
    model = TinyLM()
    ref = copy.deepcopy(model).to(rank_device())
    shard_tiny_lm(model, fully_shard)
    return _parity(model, ref, microbatches=k, use_microbatch_api=True)


def _case_frozen_params():
    torch.manual_seed(2)
    model = TinyLM()
    for p in (model.blocks[1].fc1.weight, model.blocks[0].norm.bias, model.aux.weight):
        p.requires_grad_(False)
    ref = copy.deepcopy(model).to(rank_device())
    shard_tiny_lm(model, fully_shard)
    out = _parity(model, ref)
    for unit_module in (model.blocks[0], model.blocks[1], model):
        frozen = [g for g in unit_module._mfsdp_unit.groups if not g.requires_grad]
        assert len(frozen) == 1 and frozen[0].grads.main_grad is None and frozen[0].stats.reduces == 0
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    return out


def _case_frozen_model_cast_and_gathered_once():
    """A frozen model next to a trained one (a distillation teacher): other optimizers' steps do not make it
    cast and gather its unchanged weights again."""
    torch.manual_seed(4)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    student = fully_shard(nn.Linear(8, 8), mp_policy=bf16, sharding_strategy="optim")
    teacher = nn.Linear(8, 8).requires_grad_(False)
    fully_shard(teacher, mp_policy=bf16, sharding_strategy="optim")
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    x = torch.randn(4, 8, device=rank_device())
    for _ in range(3):
        (student(x).float() - teacher(x).float()).square().mean().backward()
        opt.step()
        opt.zero_grad()
    [t], [s] = teacher._mfsdp_unit.groups, student._mfsdp_unit.groups
    counts = {"teacher": (t.stats.weight_syncs, t.stats.all_gathers), "student": (s.stats.weight_syncs,
                                                                                 s.stats.all_gathers)}
    assert counts == {"teacher": (1, 1), "student": (3, 3)}, counts
    return counts


def _case_parameterless_parent():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref = copy.deepcopy(model).to(rank_device())
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)  # owns no parameter
    assert model._mfsdp_unit.groups == []
    rank, world = dist.get_rank(), dist.get_world_size()
    opt, ropt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(step)).to(rank_device())
        model(x.chunk(world)[rank]).square().mean().backward()
        ref(x).square().mean().backward()
        opt.step(), ropt.step(), opt.zero_grad(), ropt.zero_grad()
    err = _compare_params(model, ref)
    assert err <= 1e-5, err
    return {"param_err": err}


def _case_unsharded_storage_released():
    torch.manual_seed(4)
    model = shard_tiny_lm(TinyLM(n_layers=3), fully_shard)
    from mfsdp_ext.testing.models import batch, lm_loss

    def gathered_bytes(m):
        return sum(g.unsharded.nbytes() for g in m._mfsdp_unit.groups)

    tokens, targets = batch(0, 4)
    loss = lm_loss(model, tokens, targets)
    after_forward = [gathered_bytes(b) for b in model.blocks]
    loss.backward()
    after_backward = [gathered_bytes(b) for b in model.blocks] + [gathered_bytes(model)]
    assert after_forward == [0, 0, 0], after_forward
    assert after_backward == [0, 0, 0, 0], after_backward
    unit_bytes = model.blocks[0]._mfsdp_unit.groups[0].layout.total_numel * 4
    return {"after_forward": after_forward, "after_backward": after_backward, "unit_bytes": unit_bytes}


def _case_main_grad_released_after_zero_grad():
    """zero_grad(set_to_none=True) frees the gradient shards at once, as FSDP2 does (so memory between steps is
    FSDP2's, and forward and backward run without a whole gradient shard held); the next reduction makes them again.
    A .grad the user still holds keeps its values; zero_grad(set_to_none=False) keeps the buffer."""
    torch.manual_seed(4)
    model = shard_tiny_lm(TinyLM(n_layers=2), fully_shard)
    from mfsdp_ext.testing.models import batch, lm_loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    groups = [g for m in (*model.blocks, model) for g in m._mfsdp_unit.groups if g.requires_grad]

    def held() -> list[bool]:
        return [g.grads.main_grad is not None for g in groups]

    def step(set_to_none):
        tokens, targets = batch(0, 4)
        loss = lm_loss(model, tokens, targets)
        during_forward = held()
        loss.backward()
        assert all(held())  # the reduction made it
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return during_forward

    assert step(True) == [False] * len(groups)  # the first step: nothing reduced yet
    assert held() == [False] * len(groups)  # zero_grad(set_to_none=True) freed them
    weight = model.blocks[0].fc1.weight
    tokens, targets = batch(1, 4)
    lm_loss(model, tokens, targets).backward()
    step_grad = weight.grad.to_local().clone()
    kept = weight.grad  # the user keeps a reference across zero_grad and the next iteration
    opt.zero_grad(set_to_none=True)
    kept_group = [g.grads.main_grad is not None for g in groups]
    assert kept_group.count(True) == 1, kept_group  # the held .grad keeps its own group's buffer, no other
    released = step(True)
    assert released == kept_group, released
    assert torch.equal(kept.to_local(), step_grad), "a held .grad changed when the next reduction ran"
    assert weight.grad is not kept  # the next reduction made a new buffer
    del kept
    assert held() == [False] * len(groups)
    assert step(False) == [False] * len(groups)  # this forward followed set_to_none=True
    assert all(held())  # zeroed in place: the buffers stay
    kept_buffers = step(True)
    assert kept_buffers == [True] * len(groups), kept_buffers
    return {"groups": len(groups)}


def _case_late_group_reduced_first():
    """The root's parameters used after the blocks (final norm, aux head) form their own group, reduced as soon as
    their gradients are ready, before any block's reduction; the embedding's group is reduced last. On CUDA (on
    the CPU, one group: asked for here, the grouping is the same code)."""
    from mfsdp_ext.sharding import groups as unit_groups
    from mfsdp_ext.testing.models import lm_loss

    torch.manual_seed(4)
    assert len(shard_tiny_lm(TinyLM(n_layers=3), fully_shard)._mfsdp_unit.groups) == root_groups(rank_device())
    reduces_early = unit_groups.reduces_early
    unit_groups.reduces_early = lambda device: True
    try:
        model = shard_tiny_lm(TinyLM(n_layers=3), fully_shard)
    finally:
        unit_groups.reduces_early = reduces_early

    root = model._mfsdp_unit
    late = [g for g in root.groups if g.grads.reduce_when_ready]
    assert len(late) == 1 and [i.fqn for i in late[0].infos] == ["norm.weight", "norm.bias", "aux.weight", "aux.bias"]
    order = []
    for m in (*model.blocks, model):
        unit = m._mfsdp_unit
        original = unit.reduction.reduce
        unit.reduction.reduce = lambda ctx, g, *rest, unit=unit, original=original: (
            order.append((unit.name, g.grads.reduce_when_ready)), original(ctx, g, *rest))
    for step in range(2):
        order.clear()
        tokens, targets = batch(step, 4)
        lm_loss(model, tokens, targets).backward()
        assert order[0] == (root.name, True), order
        assert order[-1] == (root.name, False), order
        assert len(order) == 5, order
    return {"order": order}


def _case_torch_save_state_dict(tmpdir: str):
    """torch.save(model.state_dict()) works (each rank its shards) and loads back into a fresh sharded model.
    torch 2.13 cannot pickle a DTensor whose local tensor starts inside its storage: the parameters' local
    tensors sit at offset 0 of a slice of the flat buffer's storage."""
    import os

    torch.manual_seed(4)
    model = shard_tiny_lm(TinyLM(n_layers=2), fully_shard)
    train(model, 1, GLOBAL_BATCH, sharded=True)
    path = os.path.join(tmpdir, f"rank{dist.get_rank()}.pt")
    torch.save(model.state_dict(), path)
    torch.manual_seed(5)
    fresh = shard_tiny_lm(TinyLM(n_layers=2), fully_shard)
    fresh.load_state_dict(torch.load(path, weights_only=False))
    a, b = full_state_dict(model), full_state_dict(fresh)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return {"tensors": len(a)}


def _case_meta_init():
    """Meta-built + sharded + materialized equals a single process that runs the same init."""
    torch.manual_seed(5)
    with torch.device("meta"):
        model = TinyLM()
    shard_tiny_lm(model, fully_shard)
    for p in model.parameters():
        assert p.device.type == "meta"
    model.to_empty(device=rank_device())
    torch.manual_seed(6)
    mfsdp_ext.reset_parameters(model)

    torch.manual_seed(5)
    with torch.device("meta"):
        ref = TinyLM()
    ref.to_empty(device=rank_device())
    ref.head.weight = ref.emb.weight  # to_empty keeps the tie; be explicit
    torch.manual_seed(6)
    for m in ref.modules():
        if any(True for _ in m.parameters(recurse=False)):
            m.reset_parameters()
    init_err = _compare_params(model, ref)
    assert init_err == 0.0, init_err
    # no rank holds a full copy: each rank's local shards add up to about 1/world of the model
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in ref.parameters())
    assert local <= total / dist.get_world_size() + 512, (local, total)
    out = _parity(model, ref)
    out["init_err"] = init_err
    return out


def _case_bf16_vs_fsdp2():
    from torch.distributed.fsdp import MixedPrecisionPolicy as Fsdp2Policy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    torch.manual_seed(7)
    base = TinyLM()
    ref, ours, theirs = copy.deepcopy(base).to(rank_device()), copy.deepcopy(base), copy.deepcopy(base)
    shard_tiny_lm(ours, fully_shard, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    shard_tiny_lm(theirs, fsdp2_fully_shard, mp_policy=Fsdp2Policy(param_dtype=torch.bfloat16))
    ref_losses = train(ref, STEPS, GLOBAL_BATCH, sharded=False)
    our_losses = train(ours, STEPS, GLOBAL_BATCH, sharded=True)
    their_losses = train(theirs, STEPS, GLOBAL_BATCH, sharded=True)
    ref_params = dict(ref.named_parameters())
    ours_full = full_state_dict(ours)
    theirs_full = {k: v.full_tensor() for k, v in theirs.named_parameters()}  # deduplicated names, as ref
    our_err = max(rel_err(ours_full[k], ref_params[k].detach()) for k in ref_params)
    their_err = max(rel_err(theirs_full[k], ref_params[k].detach()) for k in ref_params)
    our_loss_err = max(abs(a - b) / b for a, b in zip(our_losses, ref_losses))
    their_loss_err = max(abs(a - b) / b for a, b in zip(their_losses, ref_losses))
    # bf16 precision is 2^-8 ~ 4e-3 relative: within a few ulps after 5 steps, and no worse than FSDP2.
    assert our_err < 3e-2 and our_loss_err < 2e-2, (our_err, our_loss_err)
    assert our_err <= 1.25 * their_err + 1e-3, (our_err, their_err)
    assert our_loss_err <= 1.25 * their_loss_err + 1e-3, (our_loss_err, their_loss_err)
    return {"ours_param_err": our_err, "fsdp2_param_err": their_err, "ours_loss_err": our_loss_err,
            "fsdp2_loss_err": their_loss_err}


def _case_state_dict_roundtrip(tmpdir: str):
    """state_dict() holds torch.chunk-split DTensors: full_tensor() and DCP see the true values."""
    import torch.distributed.checkpoint as dcp

    from mfsdp_ext.testing.models import batch, lm_loss

    torch.manual_seed(8)
    ref = TinyLM().to(rank_device())
    trained = shard_tiny_lm(copy.deepcopy(ref), fully_shard)
    train(trained, 2, GLOBAL_BATCH, sharded=True)
    truth = full_state_dict(trained)
    sd = trained.state_dict()
    assert sd.keys() == truth.keys() and "head.weight" in sd  # tied weight under both names, as nn.Module does
    for k, v in sd.items():
        assert isinstance(v, torch.distributed.tensor.DTensor), k
        assert torch.equal(v.full_tensor(), truth[k]), k

    for name, param in trained.named_parameters():  # the parameters are true Shard(0) DTensors
        assert torch.equal(param.full_tensor(), truth[name]), name
        assert torch.equal(param.redistribute(placements=[Replicate()] * param.device_mesh.ndim).to_local(),
                           truth[name]), name
    rank, world = dist.get_rank(), dist.get_world_size()
    ref.load_state_dict(truth)
    tokens, targets = batch(7, GLOBAL_BATCH)
    lm_loss(trained, tokens.chunk(world)[rank], targets.chunk(world)[rank]).backward()
    lm_loss(ref, tokens, targets).backward()
    for (name, param), (_, ref_param) in zip(trained.named_parameters(), ref.named_parameters()):
        assert rel_err(param.grad.full_tensor(), ref_param.grad) <= 1e-5, name
    trained.zero_grad(set_to_none=True)

    def fresh(seed):
        torch.manual_seed(seed)
        return shard_tiny_lm(TinyLM(), fully_shard)

    from_dtensors = fresh(9)
    from_dtensors.load_state_dict(sd)
    from_full = fresh(10)
    from_full.load_state_dict({k: v.full_tensor() for k, v in sd.items()})
    from_dcp = fresh(11)
    dcp.save(sd, checkpoint_id=tmpdir)
    target = from_dcp.state_dict()
    dcp.load(target, checkpoint_id=tmpdir)
    from_dcp.load_state_dict(target)
    tokens, targets = batch(0, 4)
    want = lm_loss(trained, tokens, targets).item()
    for name, m in (("dtensors", from_dtensors), ("full", from_full), ("dcp", from_dcp)):
        got = full_state_dict(m)
        assert all(torch.equal(got[k], truth[k]) for k in truth), name
        assert lm_loss(m, tokens, targets).item() == want, name  # the cast weights follow the load
    return {"keys": len(sd), "checked": ["state_dict full_tensor", "param/grad full_tensor", "load DTensors",
                                         "load full tensors", "DCP save/load"]}

def _case_explicit_unshard():
    """FsdpModule.unshard() as FSDP2's: async_op=True returns a handle; after wait() the module holds its full
    weights (equal to the gathered parameters) until reshard(); a forward in between computes on them."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    ref = copy.deepcopy(model).to(rank_device())
    fully_shard(model[0])
    fully_shard(model)
    x = torch.randn(3, 8, device=rank_device())
    model(x)  # lazy init
    assert model[0].unshard() is None
    assert tuple(model[0].weight.shape) == (16, 8) and not isinstance(model[0].weight, DTensor)
    model[0].reshard()
    assert isinstance(model[0].weight, DTensor)
    handle = model[0].unshard(async_op=True)
    handle.wait()
    assert torch.equal(model[0].weight.detach(), ref[0].weight.detach())
    out = model(x)
    assert torch.allclose(out, ref(x), rtol=1e-6, atol=1e-6)
    model[0].reshard()
    assert isinstance(model[0].weight, DTensor)
    return "ok"


class _WithScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-d: fully_shard refuses it unless ignored

    def forward(self, x):
        return self.lin(x) * self.scale


def _case_ignored_params():
    """FSDP2's ignored_params: left as they are (a plain parameter, its gradient this rank's own, unreduced); the
    others sharded as usual. An offload_policy of the wrong kind and shard_placement_fn are refused with what is
    supported."""
    torch.manual_seed(8)
    model = _WithScale().to(rank_device())
    ref = copy.deepcopy(model)
    _expect(ValueError, "scalar parameters", lambda: fully_shard(copy.deepcopy(model)))
    fully_shard(model, ignored_params={model.scale})
    assert not isinstance(model.scale, DTensor) and isinstance(model.lin.weight, DTensor)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(1)).to(rank_device())
    model(x[4 * rank:4 * (rank + 1)]).square().mean().backward()
    ref(x[4 * rank:4 * (rank + 1)]).square().mean().backward()  # this rank's slice: the ignored grad's reference
    assert torch.allclose(model.scale.grad, ref.scale.grad, rtol=1e-6), (model.scale.grad, ref.scale.grad)
    ref.zero_grad()
    ref(x).square().mean().backward()  # the whole batch: the sharded (averaged) gradients' reference
    assert rel_err(model.lin.weight.grad.full_tensor(), ref.lin.weight.grad) <= 1e-5
    msgs = {"offload": _expect(TypeError, "offload_policy must be",
                               lambda: fully_shard(nn.Linear(4, 4), offload_policy="cpu")),
            "placement": _expect(ValueError, "Shard(dim)",
                                 lambda: fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Replicate())),
            "uneven": _expect(ValueError, "even split",
                              lambda: fully_shard(nn.Linear(3, 3), shard_placement_fn=lambda p: Shard(1))),
            "dim_out_of_range": _expect(AssertionError, "Shard dim 1 is invalid for 1D tensor",
                                        lambda: fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(1)))}
    # FSDP2's default placement asked for explicitly is what mfsdp_ext does
    fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(0) if p.dim() == 2 else None)
    return msgs


def _case_list_of_modules():
    """fully_shard([model.norm, model.head]) as torchtitan writes it: one unit over both modules, and training
    equals a single-process model's (FSDP2's numbers: tests/interop/test_fsdp2_compat.py)."""
    torch.manual_seed(12)
    model = TinyLM(tie=False)
    ref = copy.deepcopy(model).to(rank_device())
    for b in model.blocks:
        fully_shard(b)
    grouped = [model.norm, model.head]
    assert fully_shard(grouped) is grouped
    fully_shard(model)
    assert all(isinstance(m, mfsdp_ext.FsdpModule) for m in grouped)
    assert model.norm._mfsdp_unit is model.head._mfsdp_unit and len(model.head._mfsdp_unit.groups) == 1
    assert isinstance(model.head.weight, DTensor)
    return _parity(model, ref)



def _expect(exc_type, fragment, fn):
    try:
        fn()
    except exc_type as e:
        assert fragment in str(e), f"error message {str(e)!r} lacks {fragment!r}"
        return str(e)
    raise AssertionError(f"expected {exc_type.__name__} containing {fragment!r}")


def _case_errors():
    msgs = {}
    m = nn.Linear(4, 4)
    fully_shard(m)
    msgs["twice"] = _expect(ValueError, "already sharded", lambda: fully_shard(m))
    outer_inner = nn.Sequential(nn.Linear(4, 4))
    msgs["nested_list"] = _expect(ValueError, "do not contain each other", lambda: fully_shard([outer_inner,
                                                                                              outer_inner[0]]))
    msgs["int_reshard"] = _expect(ValueError, "it should be a factor of",
                                  lambda: fully_shard(nn.Linear(4, 4), reshard_after_forward=3 * dist.get_world_size()))
    msgs["int_set_reshard"] = _expect(ValueError, "should be a bool", lambda: m.set_reshard_after_forward(2))
    unit = fully_shard(nn.Linear(4, 4), reshard_after_forward=None)._mfsdp_unit
    assert unit.controls.reshard_after_forward  # FSDP2's None

    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.tensor(1.0))

    msgs["scalar"] = _expect(ValueError, "to a 1D tensor with numel equal to 1", lambda: fully_shard(Scalar()))

    class IntParam(nn.Module):
        def __init__(self):
            super().__init__()
            self.i = nn.Parameter(torch.ones(3, dtype=torch.int64), requires_grad=False)

    msgs["int"] = _expect(ValueError, "non-floating", lambda: fully_shard(IntParam()))
    world = dist.get_world_size()
    mesh3 = init_device_mesh(rank_device().type, (1, 1, world))
    msgs["mesh"] = _expect(ValueError, "expects a 1D or 2D DeviceMesh",
                           lambda: fully_shard(nn.Linear(4, 4), mesh=mesh3))
    rank_dependent = nn.Linear(4, 4 + dist.get_rank())
    fully_shard(rank_dependent)  # no collective here: found at the first forward (tests/runtime/test_same_model.py)
    msgs["mismatch"] = _expect(RuntimeError, "different models", lambda: rank_dependent(torch.randn(2, 4)))
    other = "meta" if rank_device().type == "cpu" else "cpu"
    msgs["move"] = _expect(RuntimeError, "cannot be moved to another device", lambda: m.to(other))
    assert all(p.dtype == torch.float16 and p.to_local().dtype == torch.float16 for p in m.half().parameters())
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    fully_shard(meta)
    msgs["meta_forward"] = _expect(RuntimeError, "meta device", lambda: meta(torch.randn(2, 4)))

    class Inner(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = w

        def forward(self, x):
            return x @ self.w

    shared = nn.Parameter(torch.randn(4, 4, device=rank_device()))
    outer = nn.Sequential(Inner(shared), Inner(shared))
    fully_shard(outer[0])
    fully_shard(outer)  # as FSDP2: accepted here, refused at the first forward
    msgs["tied_across_units"] = _expect(ValueError, "already managed by another FSDP group",
                                        lambda: outer(torch.randn(2, 4, device=rank_device())))
    if dist.get_backend() == "gloo":  # no NCCL here: True is an error, "auto" warns once and falls back
        msgs["symm_true"] = _expect(RuntimeError, "symmetric memory is unavailable",
                                    lambda: fully_shard(nn.Linear(4, 4), use_symm_mem=True))
        import warnings

        from mfsdp_ext.comm import policy
        policy._warned_auto_fallback.clear()  # an earlier test in this rank may have warned already
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            auto = fully_shard(nn.Linear(4, 4), use_symm_mem="auto")
        assert auto._mfsdp_unit.config.comm.symm_mem is False
        assert any("plain collectives" in str(w.message) for w in caught)
        msgs["native_gloo"] = _expect(RuntimeError, "it needs CUDA GPUs",
                                      lambda: fully_shard(nn.Linear(4, 4), native_collectives=True))
        msgs["copy_engine_gloo"] = _expect(RuntimeError, "copy_engine_all_gather=True): it needs CUDA GPUs",
                                           lambda: fully_shard(nn.Linear(4, 4), copy_engine_all_gather=True))
        msgs["copy_engine_rs_gloo"] = _expect(RuntimeError, "copy_engine_reduce_scatter=True): it needs CUDA GPUs",
                                              lambda: fully_shard(nn.Linear(4, 4), copy_engine_reduce_scatter=True))
        # the default, "auto": on gloo the plain collectives, without a word
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            default = fully_shard(nn.Linear(4, 4))
            default(torch.ones(2, 4)).sum().backward()
        _, gather, reduce = default._mfsdp_unit.groups[0].collectives
        assert (gather.name, reduce.name, caught) == ("plain", "plain", []), (gather, reduce, caught)
    msgs["native_not_bool"] = _expect(ValueError, "native_collectives must be True or False",
                                      lambda: fully_shard(nn.Linear(4, 4), native_collectives="auto"))
    msgs["native_no_shard"] = _expect(RuntimeError, "no_shard has no all-gather",
                                      lambda: fully_shard(nn.Linear(4, 4), sharding_strategy="no_shard",
                                                          native_collectives=True))
    msgs["copy_engine_not_bool"] = _expect(ValueError, "copy_engine_all_gather must be False, True or 'auto'",
                                           lambda: fully_shard(nn.Linear(4, 4), copy_engine_all_gather="yes"))
    msgs["copy_engine_and_symm"] = _expect(ValueError, "two all-gathers; pass one",
                                           lambda: fully_shard(nn.Linear(4, 4), copy_engine_all_gather=True,
                                                               use_symm_mem="auto"))
    msgs["copy_engine_rs_not_bool"] = _expect(ValueError, "copy_engine_reduce_scatter must be False, True or 'auto'",
                                              lambda: fully_shard(nn.Linear(4, 4), copy_engine_reduce_scatter="on"))
    msgs["copy_engine_rs_and_symm"] = _expect(ValueError, "two reduce-scatters; pass one",
                                              lambda: fully_shard(nn.Linear(4, 4), copy_engine_reduce_scatter=True,
                                                                  use_symm_mem=True))
    # release_symmetric_memory: on the root only; a no-op where nothing symmetric was allocated
    two = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(two[0])
    fully_shard(two)
    two.release_symmetric_memory()  # before the first forward: nothing allocated yet
    two(torch.randn(2, 4)).sum().backward()
    msgs["release_inner"] = _expect(RuntimeError, "on the root module", two[0].release_symmetric_memory)
    two.release_symmetric_memory()  # no symmetric memory on gloo: a no-op (release itself: tests/comm/test_symm_mem.py)
    # the pool is still usable afterwards: one more collective
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    return msgs


@dataclasses.dataclass
class _Hidden:  # a dataclass output / input, as FSDP2 walks them
    h: torch.Tensor
    note: str = "kept"


class _Opaque:  # a class neither pytree nor dataclasses can look into
    def __init__(self, h):
        self.h = h


class _ContainerBlock(nn.Module):
    def __init__(self, wrap, d: int = 8):
        super().__init__()
        self.wrap, self.lin = wrap, nn.Linear(d, d)

    def forward(self, x):
        x = x.h if isinstance(x, (_Hidden, _Opaque)) else x
        return self.wrap(torch.tanh(self.lin(x)))


def _case_output_containers(kind: str):
    """Units that return their output inside a dataclass (walked, as FSDP2 does: hooked and resharded) or inside
    an opaque class (a warning; the weights stay gathered for its backward) train with the single-process
    gradients; a dataclass input is cast to the compute dtype."""
    import warnings

    wrap = {"dataclass": _Hidden, "opaque": _Opaque}[kind]
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 8), _ContainerBlock(wrap), _ContainerBlock(wrap), nn.Linear(8, 1))
    model[3].register_forward_pre_hook(lambda m, args: (args[0].h,))
    ref = copy.deepcopy(model).to(rank_device())
    for block in (model[1], model[2]):
        fully_shard(block)
    fully_shard(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(step)).to(rank_device())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = model(x[4 * rank:4 * (rank + 1)]).square().mean()
        kept_gathered = model[1]._mfsdp_unit.groups[0].unsharded.nbytes() > 0
        loss.backward()
        warned = [str(w.message) for w in caught if "holds no tensor that requires grad" in str(w.message)]
        assert bool(warned) == (kind == "opaque" and step == 0), warned  # once per unit
        assert kept_gathered == (kind == "opaque"), kind  # a walked output is resharded after forward
        (ref(x).square().mean()).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            err = rel_err(p.grad.full_tensor(), q.grad)
            assert err <= 1e-5, (kind, step, name, err)
        model.zero_grad(), ref.zero_grad()
        assert model[1]._mfsdp_unit.groups[0].unsharded.nbytes() == 0  # at rest after the backward
    # a dataclass input is cast to param_dtype, its other fields kept
    block = _ContainerBlock(_Hidden).to(rank_device())
    fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    seen = []
    block.register_forward_pre_hook(lambda m, args: seen.append((args[0].note, args[0].h.dtype)))
    out = block(_Hidden(torch.randn(2, 8, device=rank_device()), note="n"))
    assert seen == [("n", torch.bfloat16)] and out.h.dtype == torch.bfloat16, (seen, out)
    return {"kind": kind, "warned": kind == "opaque"}


# ----------------------------------------------------------------------------------------------- pytest
def test_fp32_parity_nested_tied(cpu_pool):
    print(cpu_pool.run(_case_fp32_parity)[0])


def test_fp32_parity_untied(cpu_pool):
    print(cpu_pool.run(_case_fp32_parity, {"tie": False})[0])


@pytest.mark.parametrize("k", [3])
def test_grad_accumulation_equals_big_batch(cpu_pool, k):
    print(cpu_pool.run(_case_grad_accumulation, k)[0])


def test_frozen_params(cpu_pool):
    print(cpu_pool.run(_case_frozen_params)[0])


def test_frozen_model_cast_and_gathered_once(cpu_pool):
    print(cpu_pool.run(_case_frozen_model_cast_and_gathered_once)[0])


def test_parameterless_parent(cpu_pool):
    print(cpu_pool.run(_case_parameterless_parent)[0])


def test_unsharded_storage_released(cpu_pool):
    print(cpu_pool.run(_case_unsharded_storage_released)[0])


def test_main_grad_released_after_zero_grad(cpu_pool):
    print(cpu_pool.run(_case_main_grad_released_after_zero_grad)[0])


def test_late_group_reduced_first(cpu_pool):
    print(cpu_pool.run(_case_late_group_reduced_first)[0])


def test_meta_init(cpu_pool):
    print(cpu_pool.run(_case_meta_init)[0])


def test_bf16_no_worse_than_fsdp2(cpu_pool):
    print(cpu_pool.run(_case_bf16_vs_fsdp2)[0])


def test_torch_save_state_dict(cpu_pool, tmp_path):
    print(cpu_pool.run(_case_torch_save_state_dict, str(tmp_path))[0])


def test_state_dict_roundtrip(cpu_pool, tmp_path):
    print(cpu_pool.run(_case_state_dict_roundtrip, str(tmp_path / "ckpt"))[0])


def test_clear_errors(cpu_pool):
    print(cpu_pool.run(_case_errors)[0])


@pytest.mark.parametrize("kind", ["dataclass", "opaque"])
def test_output_containers(cpu_pool, kind):
    print(cpu_pool.run(_case_output_containers, kind)[0])


def test_explicit_unshard(cpu_pool):
    cpu_pool.run(_case_explicit_unshard)


def test_ignored_params(cpu_pool):
    print(cpu_pool.run(_case_ignored_params)[0])


def test_forward_method(cpu_pool):
    print(cpu_pool.run(_case_forward_method)[0])


def test_list_of_modules(cpu_pool):
    print(cpu_pool.run(_case_list_of_modules)[0])


def test_tensor_tree_fast_paths_match_pytree():
    """The hooks' walk skips pytree for a lone tensor and for tensor-only positional calls: same leaves in the same
    order as pytree's walk, and the rebuilt structure is the original one over the new leaves."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from mfsdp_ext.core import tensor_tree

    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    trees = [a, ((a, (b, c)), {}), ((a,), {}), ((), {}),  # fast paths
             ((a, 3), {}), ((a,), {"k": b}), ((a, [b, c]), {}), [a, b], ((a, (b, None)), {})]  # pytree's
    for tree in trees:
        leaves, rebuild = tensor_tree.flatten(tree)
        ref_leaves, spec = tree_flatten(tree)
        assert len(leaves) == len(ref_leaves) and all(x is y for x, y in zip(leaves, ref_leaves)), tree
        new = [x * 2 if torch.is_tensor(x) else x for x in leaves]
        rebuilt, expected = rebuild(new), tree_unflatten(new, spec)
        assert tree_flatten(rebuilt)[1] == spec, (tree, rebuilt)
        assert all(x is y for x, y in zip(tree_flatten(rebuilt)[0], tree_flatten(expected)[0])), tree


def test_default_mesh_device_as_fsdp2(monkeypatch):
    """fully_shard without a mesh puts it on the accelerator when there is one, whatever the process group's backend
    (FSDP2's _init_default_fully_shard_mesh does so: gloo, a threaded group or "cuda:nccl,cpu:gloo" on a GPU host
    still trains on the GPU), else on the CPU."""
    from mfsdp_ext.sharding import mesh as sharding_mesh

    assert sharding_mesh.default_device_type() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: torch.device("cuda"))
    assert sharding_mesh.default_device_type() == "cuda"
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert sharding_mesh.default_device_type() == "cpu"


# ----------------------------------------------------------------------------------------------- GPU: parity cases
@pytest.mark.gpu
def test_fp32_parity(gpu_pool):
    print(gpu_pool.run(_case_fp32_parity)[0])


@pytest.mark.gpu
def test_grad_accumulation(gpu_pool):
    print(gpu_pool.run(_case_grad_accumulation, 3)[0])


@pytest.mark.gpu
def test_gpu_frozen_params(gpu_pool):
    print(gpu_pool.run(_case_frozen_params)[0])


@pytest.mark.gpu
def test_gpu_parameterless_parent(gpu_pool):
    print(gpu_pool.run(_case_parameterless_parent)[0])


@pytest.mark.gpu
def test_gpu_unsharded_storage_released(gpu_pool):
    print(gpu_pool.run(_case_unsharded_storage_released)[0])


@pytest.mark.gpu
def test_gpu_main_grad_released_after_zero_grad(gpu_pool):
    print(gpu_pool.run(_case_main_grad_released_after_zero_grad)[0])


@pytest.mark.gpu
def test_gpu_meta_init(gpu_pool):
    print(gpu_pool.run(_case_meta_init)[0])


@pytest.mark.gpu
def test_gpu_bf16_no_worse_than_fsdp2(gpu_pool):
    print(gpu_pool.run(_case_bf16_vs_fsdp2)[0])
