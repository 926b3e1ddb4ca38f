"""mfsdp_ext.no_shard: marked parameters stay replicated (gloo ranks; on 2 GPUs: the GPU test at the end), against a
single-process model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from mfsdp_ext import FsdpModule, MixedPrecisionPolicy, fully_shard, microbatch, no_shard, reset_parameters
from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, rank_device, root_groups, train
from tests.conftest import get_pool
from tests.runtime.test_strategies import count_collectives
from tests.test_fully_shard import GLOBAL_BATCH, STEPS, _compare_params


def _marked_model(seed: int) -> TinyLM:
    """TinyLM whose first block is marked (and frozen) and whose second block's fc2 is marked (trainable)."""
    torch.manual_seed(seed)
    model = TinyLM(tie=False)
    model.blocks[0].requires_grad_(False)
    return model


def _shard(model: TinyLM, mesh=None) -> TinyLM:
    no_shard(model.blocks[0])  # a frozen tower: no unit, no hooks, never communicated
    no_shard(model.blocks[1].fc2)  # trainable and replicated: all-reduced once per step
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _case_no_shard_parity(microbatches: int):
    model = _marked_model(40)
    ref = copy.deepcopy(model).to(rank_device())
    ref_losses = train(ref, STEPS, GLOBAL_BATCH, sharded=False)
    _shard(model)
    frozen_before = {n: p.full_tensor().clone() for n, p in model.blocks[0].named_parameters()}
    with count_collectives() as counts:
        losses = train(model, STEPS, GLOBAL_BATCH, sharded=True, microbatches=microbatches, microbatch_ctx=microbatch)
    loss_err = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    param_err = _compare_params(model, ref)
    assert loss_err <= 1e-5 and param_err <= 1e-5, (loss_err, param_err)
    # the marked block made no unit and has no hooks; its parameters are replicated DTensors of the root
    assert not isinstance(model.blocks[0], FsdpModule) and not model.blocks[0]._forward_pre_hooks
    for n, p in model.blocks[0].named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Replicate(),), n
        assert torch.equal(p.full_tensor(), frozen_before[n]) and p.grad is None, n
    assert model.blocks[1].fc2.weight.placements == (Replicate(),)
    # sharded groups: gathered in forward and (but the root's) in backward, one reduce-scatter per microbatch;
    # replicated parameters: gathered never, the trainable ones all-reduced once per step (the frozen ones never)
    # sharded groups: blocks 1 and 2 (block 0 made no unit), and the root's (root_groups), which it gathers in one
    # call; microbatch(is_last=False) keeps the first two units of the forward (the root, block 1) gathered after
    # backward
    units, sharded_groups, iterations = 3, 2 + root_groups(rank_device()), STEPS * microbatches
    kept_for_next_microbatch = STEPS * (microbatches - 1) * 2
    assert counts["all_gather_into"] == (iterations * (2 * units - 1) - (iterations - 1)
                                         - kept_for_next_microbatch), counts
    assert counts["reduce_scatter_into"] == iterations * sharded_groups, counts
    assert counts["all_reduce"] == STEPS, counts  # block 1's replicated group
    return {"loss_err": loss_err, "param_err": param_err, "counts": dict(counts)}

def _case_no_shard_hsdp(microbatches: int):
    """On a 2-D (replicate, shard) mesh the marked parameters are replicated over all of it: (Replicate(),
    Replicate()) DTensors, the trainable ones all-reduced over every rank once per step; parity with a
    single-process model, and clip_grad_norm_ gives its total norm."""
    world = dist.get_world_size()
    mesh = init_device_mesh(rank_device().type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = _marked_model(41)
    ref = copy.deepcopy(model).to(rank_device())
    ref_losses = train(ref, STEPS, GLOBAL_BATCH, sharded=False)
    _shard(model, mesh)
    with count_collectives() as counts:
        losses = train(model, STEPS, GLOBAL_BATCH, sharded=True, microbatches=microbatches, microbatch_ctx=microbatch)
    loss_err = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    param_err = _compare_params(model, ref)
    assert loss_err <= 1e-5 and param_err <= 1e-5, (loss_err, param_err)
    for p in (*model.blocks[0].parameters(), model.blocks[1].fc2.weight):
        assert p.placements == (Replicate(), Replicate()), p.placements
    assert model.blocks[1].fc1.weight.placements == (Replicate(), Shard(0))
    # the sharded groups (as above) all-reduce over replicas once per step (HSDP), block 1's replicated group over
    # all ranks
    assert counts["all_reduce"] == STEPS * (2 + root_groups(rank_device()) + 1), counts
    # one more backward: the total gradient norm equals the single-process model's
    tokens, targets = batch(99, GLOBAL_BATCH)
    rank = dist.get_rank()
    lm_loss(model, tokens.chunk(world)[rank], targets.chunk(world)[rank]).backward()
    lm_loss(ref, tokens, targets).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    assert abs(norm - ref_norm) / ref_norm < 1e-5, (norm, ref_norm)
    return {"loss_err": loss_err, "param_err": param_err, "counts": dict(counts)}



def _case_no_shard_meta_init():
    """The mark survives meta-device init: reset_parameters fills the replicated parameters like the rest."""
    torch.manual_seed(41)
    with torch.device("meta"):
        model = TinyLM(tie=False)
    _shard(model)
    model.to_empty(device=rank_device())
    torch.manual_seed(42)
    reset_parameters(model)
    torch.manual_seed(42)
    ref = TinyLM(tie=False).to(rank_device())  # constructed = initialised in the same module order
    assert model.blocks[0].norm.weight.placements == (Replicate(),)
    err = _compare_params(model, ref)
    assert err == 0.0, err
    return {"param_err": err}


def _case_frozen_replicated_bf16():
    """A frozen no_shard group under bf16 keeps two copies, on purpose: the fp32 main weight (what state_dict,
    checkpoints, load_state_dict and a later unfreeze see, exactly) and the bf16 copy the module computes with
    (cast once, never re-gathered while unchanged). Only the bf16 copy would do for compute, but the fp32 values
    cannot be recovered from it: a save after training would round a frozen tower to bf16."""
    model = _marked_model(43)
    before = {n: p.detach().clone() for n, p in model.blocks[0].named_parameters()}
    assert any(not torch.equal(v, v.bfloat16().float()) for v in before.values())  # bf16 would round them
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    no_shard(model.blocks[0])
    for b in model.blocks:
        fully_shard(b, mp_policy=bf16)
    fully_shard(model, mp_policy=bf16)
    train(model, 2, GLOBAL_BATCH, sharded=True)
    frozen = [g for g in model._mfsdp_unit.groups if g.replicated and not g.requires_grad]
    assert len(frozen) == 1, model._mfsdp_unit.groups
    g = frozen[0]
    assert g.model_weight is None and g.unsharded.data.dtype == torch.bfloat16 and g.main_weight.dtype == torch.float32
    assert g.stats.all_gathers == 1, g.stats  # cast into the compute copy once, kept
    assert torch.equal(g.unsharded.data, g.main_weight.data.bfloat16())
    state = model.state_dict()
    for n, v in before.items():
        saved = state[f"blocks.0.{n}"].to_local()
        assert saved.dtype == torch.float32 and torch.equal(saved, v), n
    return {"frozen group bytes (fp32 main + bf16 compute)": (g.main_weight.nbytes(), g.unsharded.nbytes())}


def test_frozen_replicated_bf16_keeps_exact_weights(cpu_pool):
    print(cpu_pool.run(_case_frozen_replicated_bf16)[0])


def test_no_shard_rejects_sharded_and_other_types():
    with pytest.raises(TypeError, match="nn.Module or an nn.Parameter"):
        no_shard(torch.zeros(3))


@pytest.mark.parametrize("microbatches", [1, 3])
def test_no_shard_parity_and_collectives(cpu_pool, microbatches):
    print(cpu_pool.run(_case_no_shard_parity, microbatches)[0])


def test_no_shard_meta_init(cpu_pool):
    print(cpu_pool.run(_case_no_shard_meta_init)[0])


@pytest.mark.parametrize("microbatches", [1, 2])
def test_no_shard_on_hsdp_mesh(microbatches):
    from tests.conftest import get_pool

    print(get_pool(4).run(_case_no_shard_hsdp, microbatches)[0])


# ----------------------------------------------------------------------------------------------- GPU (NCCL)
@pytest.mark.gpu
def test_no_shard_parity():
    print(get_pool(2, "nccl").run(_case_no_shard_parity, 3)[0])
