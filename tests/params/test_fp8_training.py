"""FP8 weights in fully_shard (MixedPrecisionPolicy(fp8=Fp8Policy(...))) on 2 gloo ranks, and on 2 GPUs (marked).

The ``_case_*`` functions run on every rank of a pool (tests/dist_pool.py); they assert and return numbers.

Tolerances: e4m3 keeps 3 mantissa bits, so a weight is rounded with a relative error up to 2^-4 (6.25%; about
2-3% on average for Gaussian weights), against 2^-9 for bf16. On this tiny model the loss of a run with FP8 weights
stays within FP8_LOSS_TOL (relative) of the bf16 run's over the steps: the logits move with the weights' rounding
error, and the optimizer sees it through the forward only (main weights stay fp32 and are updated alike).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from mfsdp_ext import Fp8Policy, FsdpModule, MixedPrecisionPolicy, fully_shard, microbatch
from mfsdp_ext.fp8.linear import Fp8LinearMixin
from mfsdp_ext.fp8.tensor import E4M3
from mfsdp_ext.testing.models import TinyLM, rank_device, shard_tiny_lm
from tests.conftest import get_pool

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
STEPS = 6
GLOBAL_BATCH = 8  # 4 sequences of 8 tokens per rank: M = 32 rows, a multiple of 16 (FP8 GEMMs)
SEQ = 8
VOCAB = 11
FP8_LOSS_TOL = 0.03  # measured: ~0.3-0.6% on this model (see the module docstring)


def _policy(compute: bool, **kwargs) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, fp8=Fp8Policy(compute=compute, **kwargs))


def _tiny_lm(seed: int = 0, **kwargs) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(vocab=VOCAB, dim=16, ffn=32, n_layers=2, **kwargs)


def _fp8_groups(model: nn.Module) -> list:
    return [g for m in model.modules() if isinstance(m, FsdpModule) for g in m._mfsdp_unit.groups if g.fp8]


def _all_groups(model: nn.Module) -> list:
    return [g for m in model.modules() if isinstance(m, FsdpModule) for g in m._mfsdp_unit.groups]


def _batch(step: int, device):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    rank, world = dist.get_rank(), dist.get_world_size()
    return tokens[:, :-1].chunk(world)[rank].to(device), tokens[:, 1:].chunk(world)[rank].to(device)


def _loss(model, tokens, targets):
    logits, aux = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) + 0.1 * aux.float().square().mean()


def _train(model, steps: int = STEPS, microbatches: int = 1, lr: float = 1e-2) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    device = rank_device()
    losses = []
    for step in range(steps):
        tokens, targets = _batch(step, device)
        total = torch.zeros((), device=device)
        for i, (t, y) in enumerate(zip(tokens.chunk(microbatches), targets.chunk(microbatches))):
            with microbatch(model, is_first=i == 0, is_last=i == microbatches - 1):
                loss = _loss(model, t, y) / microbatches
                loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------- (a) exact
def _reference_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3 current scaling in float64, rounded as the kernel contract says: scale = 448 / amax
    rounded to fp32 (an fp32 division is the correctly rounded quotient; float64 then fp32 rounds the same), the
    product w * scale rounded once to fp32 (exact in float64), saturated to +-448, rounded to e4m3 (RNE);
    scale_inv = 1 / scale rounded to fp32."""
    w64 = w.detach().double().cpu()
    amax = w64.abs().max().item()
    scale = torch.tensor(448.0 / max(amax, 1e-12), dtype=torch.float64).float()
    scaled = (w64 * scale.double()).float().clamp(-448.0, 448.0)
    return scaled.to(E4M3), (1.0 / scale.double()).float()


def _case_quantize_exact():
    model = _tiny_lm(seed=5)
    with torch.no_grad():
        model.blocks[0].fc1.weight[3, 7] = 9.0  # an outlier: its row's scale differs from the others'
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    shard_tiny_lm(model, fully_shard, mp_policy=_policy(compute=True))
    checked, scales = 0, []
    for bi, block in enumerate(model.blocks):
        [g] = [g for g in block._mfsdp_unit.groups if g.fp8]
        assert [info.fqn for info in g.infos] == ["fc1.weight", "fc2.weight"], [info.fqn for info in g.infos]
        g.sync_model_weight(g.weights_version())
        g.all_gather()
        for i, info in enumerate(g.infos):
            ref, ref_scale_inv = _reference_fp8(full[f"blocks.{bi}.{info.fqn}"])
            got = g.unsharded_fp8.param_view(i).cpu()
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), (
                info.fqn, (got.float() - ref.float()).abs().max())
            assert g.scale_inv[i].cpu().view(torch.int32).item() == ref_scale_inv.view(torch.int32).item(), (
                info.fqn, g.scale_inv[i].item(), ref_scale_inv.item())
            scales.append(g.scale_inv[i].item())
            checked += 1
        g.free_unsharded()
    # compute=False: the bf16 gathered weight is the FP8 weight dequantized (one rounding of data * scale_inv)
    model = _tiny_lm(seed=5)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    shard_tiny_lm(model, fully_shard, mp_policy=_policy(compute=False))
    for bi, block in enumerate(model.blocks):
        [g] = [g for g in block._mfsdp_unit.groups if g.fp8]
        g.sync_model_weight(g.weights_version())
        g.all_gather()
        assert g.unsharded_fp8.nbytes() == 0  # freed after the dequantization
        for i, info in enumerate(g.infos):
            ref, ref_scale_inv = _reference_fp8(full[f"blocks.{bi}.{info.fqn}"])
            want = (ref.float() * ref_scale_inv).to(torch.bfloat16)
            assert torch.equal(g.unsharded.param_view(i).cpu(), want), info.fqn
        g.free_unsharded()
    return {"checked": checked, "scale_inv": scales}


# ---------------------------------------------------------------------------------------------- (b), (f) training
def _case_training_tracks_bf16(compute: bool, strategy: str = "optim_grads_params", checkpointing: str = "off",
                               microbatches: int = 1, hsdp: bool = False):
    def build(policy):
        model = _tiny_lm(seed=1, checkpointing=checkpointing)
        mesh = None
        if hsdp:
            mesh = init_device_mesh(rank_device().type, (2, dist.get_world_size() // 2),
                                    mesh_dim_names=("replicate", "shard"))
        return shard_tiny_lm(model, fully_shard, mp_policy=policy, sharding_strategy=strategy, mesh=mesh)

    ref = build(BF16)
    ref_losses = _train(ref, microbatches=microbatches)
    model = build(_policy(compute))
    groups = _fp8_groups(model)
    assert len(groups) == 2 and all(len(g.infos) == 2 for g in groups)  # fc1, fc2 of each block; not head, aux
    if compute:
        linears = [m for m in model.modules() if isinstance(m, Fp8LinearMixin)]
        assert len(linears) == 4 and not isinstance(model.aux, Fp8LinearMixin)
    losses = _train(model, microbatches=microbatches)
    err = _max_rel(losses, ref_losses)
    assert losses != ref_losses, "the FP8 run computed exactly what the bf16 run did: FP8 weights unused?"
    assert err <= FP8_LOSS_TOL, (err, losses, ref_losses)
    assert losses[-1] < losses[0], losses  # it learns
    # scales once per optimizer step, whatever the microbatches; the cast per gather until the shard is kept
    # (cache_model_weight=None keeps it from a third gather of the same weights on), then once per step
    assert [g.stats.scale_syncs for g in groups] == [STEPS] * len(groups), [g.stats.scale_syncs for g in groups]
    for g in groups:
        casts, gathers = g.stats.weight_syncs, g.stats.all_gathers
        assert (STEPS <= casts <= gathers) if g.keep_fp8_shard else casts == gathers, (casts, gathers)
    if compute:  # the compute-dtype gathered buffer of FP8 weights is never allocated
        assert all(g.unsharded.nbytes() == 0 for g in groups)
    for p in model.parameters():
        assert p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
    sd, ref_sd = model.state_dict(), ref.state_dict()  # the state dict is the bf16 model's: names, fp32 shards
    assert list(sd) == list(ref_sd) and all(sd[k].dtype == ref_sd[k].dtype == torch.float32 for k in sd)
    return {"max_rel_loss_diff": err, "losses": losses, "bf16": ref_losses}


def _case_fp8_shard_cast_per_gather(compute: bool):
    """cache_model_weight=False: the FP8 shard is cast at every all-gather (scales once per step) and freed after
    it. Same scales, same casts: the losses equal those of keeping the shard (True), bit for bit (with microbatches
    and activation checkpointing, whose recompute gathers again), and no FP8 shard outlives a gather. None (auto):
    per gather without microbatches, kept from a third gather of the same weights on, the same losses."""
    def run(cache, microbatches=2):
        model = shard_tiny_lm(_tiny_lm(seed=1, checkpointing="non_reentrant"), fully_shard,
                              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, cache_model_weight=cache,
                                                             fp8=Fp8Policy(compute=compute)))
        return model, _train(model, microbatches=microbatches)

    kept, kept_losses = run(True)
    for g in _fp8_groups(kept):
        assert g.model_weight.nbytes() > 0 and g.stats.weight_syncs == STEPS
    for cache, microbatches in ((False, 2), (None, 1)):
        model, losses = run(cache, microbatches)
        if microbatches == 2:
            assert losses == kept_losses, (losses, kept_losses)
        for g in _fp8_groups(model):
            assert not g.keep_fp8_shard and g.model_weight.nbytes() == 0, (cache, g.model_weight.nbytes())
            assert g.stats.weight_syncs == g.stats.all_gathers > STEPS, (g.stats.weight_syncs, g.stats.all_gathers)
    _, one_microbatch_kept = run(True, 1)
    assert losses == one_microbatch_kept, (losses, one_microbatch_kept)
    auto, auto_losses = run(None, 2)
    assert auto_losses == kept_losses, (auto_losses, kept_losses)
    for g in _fp8_groups(auto):
        # cast per gather in the first step's first microbatch (forward, backward), kept from the third gather on
        assert g.keep_fp8_shard and g.model_weight.nbytes() > 0
        assert STEPS < g.stats.weight_syncs < g.stats.all_gathers, (g.stats.weight_syncs, g.stats.all_gathers)
    return {"losses": kept_losses, "auto_casts": [g.stats.weight_syncs for g in _fp8_groups(auto)]}


# ---------------------------------------------------------------------------------------------- (c) bytes
def _case_all_gather_bytes_half(compute: bool):
    def build(policy):
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 48, bias=False))
        return fully_shard(model.to(rank_device()), mp_policy=policy)

    def one_step(model):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(7)).to(rank_device())
        model(x).float().square().mean().backward()
        return sum(g.stats.all_gather_bytes for g in _all_groups(model))

    ref = build(BF16)
    ref_bytes = one_step(ref)
    model = build(_policy(compute))
    assert len(_fp8_groups(model)) == 1 and len(_all_groups(model)) == 1  # every weight FP8 (no head here)
    fp8_bytes = one_step(model)
    expected_bf16 = (32 * 64 + 64 * 48) * 2  # every rank receives every element once, 2 bytes each
    assert ref_bytes == expected_bf16 and fp8_bytes * 2 == ref_bytes, (fp8_bytes, ref_bytes)
    return {"bf16_bytes": ref_bytes, "fp8_bytes": fp8_bytes}


# ---------------------------------------------------------------------------------------------- (f) details
def _case_compute_memory_and_fallback():
    model = shard_tiny_lm(_tiny_lm(seed=2), fully_shard, mp_policy=_policy(compute=True))
    seen = {}

    def probe(module, args):
        g = [g for g in model.blocks[0]._mfsdp_unit.groups if g.fp8][0]
        seen["bf16"], seen["fp8"] = g.unsharded.nbytes(), g.unsharded_fp8.nbytes()
        seen["fp8_weight"] = module._fp8_weight is not None
        # the GEMM's scales: the group's per-parameter scales, each at a multiple of 256 bytes into its own
        # allocation, 16-byte aligned at least (cuBLASLt refuses a scale pointer inside the scale vector; found on
        # the GPU, where allocations start 512-byte aligned)
        base = g.gemm_scale_inv.data_ptr()
        seen["scales"] = [((v.scale_inv.data_ptr() - base) % 256 + v.scale_inv.data_ptr() % 16, v.scale_inv.item())
                          for v in g.fp8_views]
        seen["scale_inv"] = g.scale_inv.tolist()

    model.blocks[0].fc1.register_forward_pre_hook(probe)
    tokens, targets = _batch(0, rank_device())
    _loss(model, tokens, targets).backward()
    assert seen["bf16"] == 0 and seen["fp8"] > 0 and seen["fp8_weight"], seen
    assert [a for a, _ in seen["scales"]] == [0] * len(seen["scale_inv"]), seen
    assert [v for _, v in seen["scales"]] == seen["scale_inv"], seen
    # 3 tokens: M = 3 is no multiple of 16: each FP8 layer falls back to bf16 (the dequantized FP8 weight),
    # warns once naming itself, and its gradient still reaches the main grads
    model.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loss(model, tokens[:1, :3], targets[:1, :3]).backward()
        _loss(model, tokens[:1, :3], targets[:1, :3]).backward()
    names = sorted(str(w.message).split("'")[1] for w in caught if "Fp8Linear" in str(w.message))
    assert names == ["fc1", "fc1", "fc2", "fc2"], [str(w.message) for w in caught]  # 2 blocks, once per module
    fc1 = model.blocks[0].fc1.weight
    assert fc1.grad is not None and fc1.grad.to_local().abs().sum() > 0
    return seen


def _case_bad_configs():
    out = []
    with pytest.raises(ValueError, match="float32 main weights"):
        fully_shard(_tiny_lm().to(torch.bfloat16), mp_policy=_policy(compute=False))
    out.append("bf16 main weights")
    with pytest.raises(ValueError, match="no_shard"):
        fully_shard(_tiny_lm(), mp_policy=_policy(compute=False), sharding_strategy="no_shard")
    out.append("no_shard")
    with pytest.raises(TypeError, match="linear_config"):
        fully_shard(_tiny_lm(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                               fp8=Fp8Policy(linear_config="fast")))
    out.append("linear_config")
    compiled = _tiny_lm()
    compiled.blocks[0].compile()  # as torchtitan compiles each block before sharding it
    with pytest.raises(ValueError, match="compiled with torch.compile"):
        fully_shard(compiled.blocks[0], mp_policy=_policy(compute=True))
    fully_shard(compiled.blocks[0], mp_policy=_policy(compute=False))  # FP8 weights, bf16 compute: accepted
    out.append("compute under torch.compile")
    # a predicate chooses instead of the default (here: fc1 only, in both blocks)
    model = shard_tiny_lm(_tiny_lm(), fully_shard, mp_policy=_policy(False, modules=lambda fqn, m: "fc1" in fqn))
    assert [[i.fqn for i in g.infos] for g in _fp8_groups(model)] == [["fc1.weight"], ["fc1.weight"]]
    return out


def _case_meta_init_and_summary():
    """Built on the meta device, sharded with FP8 weights, materialised and initialised shard by shard: trains,
    scales once per step; the unit summary names the FP8 groups."""
    from mfsdp_ext import reset_parameters
    from mfsdp_ext.runtime import summary

    torch.manual_seed(0)
    with torch.device("meta"):
        model = _tiny_lm()
    shard_tiny_lm(model, fully_shard, mp_policy=_policy(compute=True))
    model.to_empty(device=rank_device())
    reset_parameters(model)
    losses = _train(model, steps=3)
    assert all(g.stats.scale_syncs == 3 for g in _fp8_groups(model)) and losses[-1] < losses[0], losses
    lines = summary.unit_lines(model, [m._mfsdp_unit for m in model.modules() if isinstance(m, FsdpModule)])
    assert sum("fp8 e4m3 (FP8 GEMMs)" in line for line in lines) == 2, lines
    return lines


# ---------------------------------------------------------------------------------------------- (g) collectives
def _case_collectives_per_step(strategy: str):
    """The FP8 scales of every FP8 group of the tree (one per block) travel in one all-reduce(MAX) per optimizer
    step, whatever the microbatches and recomputes; each unit gathers its groups (a block's FP8 weights and its
    bf16 norm and biases; the root's two) in one all-gather call, and a block reduce-scatters its two groups in one
    call. The losses and parameters are bit for bit those of a collective per group (MAX is exact; grouped
    collectives move and add the same bytes)."""
    from collections import Counter

    from mfsdp_ext.params import fp8_group
    from mfsdp_ext.params.grads import GroupGradients
    from mfsdp_ext.params.group import ParamGroup
    from mfsdp_ext.testing.models import intercept_collectives

    def run():
        model = shard_tiny_lm(_tiny_lm(seed=1, checkpointing="non_reentrant"), fully_shard,
                              mp_policy=_policy(compute=False), sharding_strategy=strategy)
        counts = Counter()
        with intercept_collectives(("all_gather_into", "reduce_scatter_into", "grouped_reduce_scatter_into",
                                    "all_reduce"), lambda name, args: counts.update([name])):
            losses = _train(model, microbatches=2)
        params = {k: v.to_local().clone() for k, v in model.state_dict().items()}
        return model, losses, params, counts

    model, losses, params, counts = run()
    groups = _fp8_groups(model)
    assert len(groups) == 2 and counts["all_reduce"] == STEPS, counts  # the scales, once per step for both blocks
    assert [g.stats.scale_syncs for g in groups] == [STEPS] * len(groups)
    units = [m._mfsdp_unit for m in model.modules() if isinstance(m, FsdpModule)]
    gathers = [{g.stats.all_gathers for g in u.groups} for u in units]
    # the root's final norm and aux head form a group of their own on CUDA (reduced early: sharding/groups.py)
    root_groups = 2 if rank_device().type == "cuda" else 1
    assert sorted(len(u.groups) for u in units) == sorted([2, 2, root_groups]), [len(u.groups) for u in units]
    assert all(len(n) == 1 for n in gathers), gathers
    assert counts["all_gather_into"] == sum(n for [n] in gathers), (counts, gathers)  # one call per unit gather
    # the blocks' two groups reduce together; the root's by themselves (on CUDA the final norm and aux head early)
    reduces = [[g.stats.reduces for g in u.groups] for u in units]
    assert counts["grouped_reduce_scatter_into"] == sum(g.stats.reduces for g in groups), (counts, reduces)
    assert counts["reduce_scatter_into"] == sum(g.stats.reduces for g in model._mfsdp_unit.groups), (counts, reduces)
    # the same training with a collective per group
    sync_scales = fp8_group.sync_scales
    joins = ParamGroup.gather_together_key, GroupGradients.together_key
    fp8_group.sync_scales = lambda gs, vs: [sync_scales([g], [v]) for g, v in zip(gs, vs)]
    ParamGroup.gather_together_key = GroupGradients.together_key = lambda self: None
    try:
        _, per_group_losses, per_group_params, per_group_counts = run()
    finally:
        fp8_group.sync_scales = sync_scales
        ParamGroup.gather_together_key, GroupGradients.together_key = joins
    assert per_group_counts["all_reduce"] == STEPS * len(groups), per_group_counts
    per_group_gathers = sum(len(u.groups) * n for u, [n] in zip(units, gathers))  # a call per group and gather
    assert per_group_counts["all_gather_into"] == per_group_gathers, (per_group_counts, counts)
    assert per_group_counts["reduce_scatter_into"] == sum(map(sum, reduces)), (per_group_counts, reduces)
    assert not per_group_counts["grouped_reduce_scatter_into"], per_group_counts
    assert losses == per_group_losses, (losses, per_group_losses)
    assert all(torch.equal(params[k], per_group_params[k]) for k in params)

    # weights written after the tree's scales were synced (here by a hook between the blocks' gathers) get their
    # own all-reduce at their gather
    def write(module, args, output):
        with torch.no_grad():
            model.blocks[1].fc1.weight.mul_(2.0)
            model.blocks[1].fc2.weight.mul_(2.0)

    model.blocks[0].register_forward_hook(write)
    with torch.no_grad(), intercept_collectives(("all_reduce",), lambda name, args: counts.update(["eval"])):
        model(_batch(0, rank_device())[0])
    block = model.blocks[1]
    amax = torch.stack([block.fc1.weight.full_tensor().abs().max(), block.fc2.weight.full_tensor().abs().max()])
    assert counts["eval"] == 2 and torch.equal(groups[1].amax, amax), (counts, groups[1].amax, amax)
    return {"together": dict(counts), "per_group": dict(per_group_counts)}


def test_policy_validation():
    with pytest.raises(ValueError, match="param_dtype=torch.bfloat16"):
        MixedPrecisionPolicy(fp8=Fp8Policy())
    with pytest.raises(ValueError, match="param_dtype=torch.bfloat16"):
        MixedPrecisionPolicy(param_dtype=torch.float32, fp8=Fp8Policy())
    with pytest.raises(TypeError, match="Fp8Policy.modules"):
        Fp8Policy(modules=["fc1"])
    with pytest.raises(TypeError, match="Fp8Policy.compute"):
        Fp8Policy(compute="yes")
    with pytest.raises(TypeError, match="mfsdp_ext.Fp8Policy"):
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, fp8=True)
    MixedPrecisionPolicy(param_dtype=torch.float16, fp8=Fp8Policy(compute=False))


# ---------------------------------------------------------------------------------------------- CPU tests
@pytest.fixture(scope="module")
def pool2():
    return get_pool(2, "gloo")


def test_quantize_path_bit_exact(pool2):
    out = pool2.run(_case_quantize_exact)
    assert out[0]["scale_inv"] == out[1]["scale_inv"]  # every rank uses the same per-parameter scales
    print(out[0])


@pytest.mark.parametrize("compute", [False, True], ids=["dequantize", "fp8_compute"])
def test_training_tracks_bf16(pool2, compute):
    print(pool2.run(_case_training_tracks_bf16, compute)[0])


@pytest.mark.parametrize("compute", [False, True], ids=["dequantize", "fp8_compute"])
def test_all_gather_bytes_half(pool2, compute):
    print(pool2.run(_case_all_gather_bytes_half, compute)[0])


@pytest.mark.parametrize("compute", [False, True], ids=["dequantize", "fp8_compute"])
def test_cast_once_per_step_microbatches_and_checkpointing(pool2, compute):
    print(pool2.run(_case_training_tracks_bf16, compute, "optim_grads_params", "non_reentrant", 2)[0])


@pytest.mark.parametrize("compute", [False, True], ids=["dequantize", "fp8_compute"])
def test_fp8_shard_cast_per_gather(pool2, compute):
    print(pool2.run(_case_fp8_shard_cast_per_gather, compute)[0])


@pytest.mark.parametrize("strategy", ["optim_grads", "optim"])
def test_strategies(pool2, strategy):
    print(pool2.run(_case_training_tracks_bf16, True, strategy, "off", 2)[0])


def test_hsdp(pool2):  # (replicate 2, shard 1): the amax all-reduce over replicas, the one-rank gather
    print(pool2.run(_case_training_tracks_bf16, False, "optim_grads_params", "off", 2, True)[0])


@pytest.mark.parametrize("compute", [False, True], ids=["dequantize", "fp8_compute"])
def test_hsdp_2x2(compute):  # 4 ranks: 2 sequences of 8 tokens each, M = 16 rows (no microbatches)
    print(get_pool(4, "gloo").run(_case_training_tracks_bf16, compute, "optim_grads_params", "off", 1, True)[0])


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_collectives_per_step(pool2, strategy):
    print(pool2.run(_case_collectives_per_step, strategy)[0])


def test_compute_memory_and_fallback(pool2):
    print(pool2.run(_case_compute_memory_and_fallback)[0])


def test_meta_init_and_summary(pool2):
    print(pool2.run(_case_meta_init_and_summary)[0])


def test_bad_configs(pool2):
    print(pool2.run(_case_bad_configs)[0])


# ---------------------------------------------------------------------------------------------- GPU tests
def _case_gpu_fp8_vs_bf16(steps: int = 20):
    """A larger TinyLM with FP8 GEMMs (compute=True) against bf16, on CUDA: the mean loss of the last 5 steps
    within 5%, every step within 25%. Per step the two runs part ways: on these random tokens at lr 3e-3 the
    bf16 run's own loss jumps by up to 23% from one step to the next (2 H200: FP8 and bf16 differ by 13% at
    step 7, by 4% over the last 5 steps)."""
    def build(policy):
        torch.manual_seed(11)
        model = TinyLM(vocab=512, dim=256, ffn=1024, n_layers=4).to(rank_device())
        return shard_tiny_lm(model, fully_shard, mp_policy=policy)

    def run(model):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, 512, (16, 65), generator=g)
            rank, world = dist.get_rank(), dist.get_world_size()
            t = tokens.chunk(world)[rank].to(rank_device())
            loss = _loss(model, t[:, :-1], t[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach()
            dist.all_reduce(total)
            losses.append(total.item() / world)
        return losses

    ref = run(build(BF16))
    model = build(_policy(compute=True))
    losses = run(model)
    err = _max_rel(losses, ref)
    tail_err = abs(sum(losses[-5:]) - sum(ref[-5:])) / sum(ref[-5:])
    assert tail_err <= 0.05 and err <= 0.25, (tail_err, err, losses, ref)
    assert all(g.unsharded.nbytes() == 0 for g in _fp8_groups(model))
    return {"last_5_mean_rel_diff": tail_err, "max_rel_loss_diff": err, "fp8": losses[-3:], "bf16": ref[-3:]}


@pytest.mark.gpu
def test_gpu_fp8_training_vs_bf16(gpu_pool):
    print(gpu_pool.run(_case_gpu_fp8_vs_bf16)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("compute", [False, True], ids=["dequantize", "fp8_compute"])
def test_gpu_all_gather_bytes_half(gpu_pool, compute):
    print(gpu_pool.run(_case_all_gather_bytes_half, compute)[0])


@pytest.mark.gpu
def test_gpu_quantize_path_bit_exact(gpu_pool):
    out = gpu_pool.run(_case_quantize_exact)
    assert all(o["scale_inv"] == out[0]["scale_inv"] for o in out)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_gpu_microbatches_checkpointing(gpu_pool, strategy):
    print(gpu_pool.run(_case_training_tracks_bf16, True, strategy, "non_reentrant", 2)[0])
