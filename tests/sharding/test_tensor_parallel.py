"""Tensor parallelism + fully_shard on a 2 x 2 (dp, tp) mesh of 4 gloo ranks: parallelize_module(block, tp_mesh,
plan), then fully_shard over the dp mesh, against FSDP2 doing the same and a single-process model (fp32)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from mfsdp_ext import Fp8Policy, MixedPrecisionPolicy, fully_shard
from mfsdp_ext.testing.models import rel_err
from tests.conftest import get_pool

DIM, HEADS, HIDDEN, VOCAB, SEQ = 16, 4, 20, 11, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism the colwise projections hold this rank's heads only
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        # plain ops, not scaled_dot_product_attention: DTensor has no CPU rule for it (test_spmd_mesh's DTensors)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        mask = torch.full((t, t), float("-inf")).triu(1)
        if isinstance(scores, DTensor):
            mask = distribute_tensor(mask, scores.device_mesh, [Replicate()] * scores.device_mesh.ndim)
        o = (scores + mask).softmax(-1) @ v
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention = Attention()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _plan():
    """torchtitan's plan for a Llama block: colwise q/k/v/w1/w3, rowwise o/w2."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel(), RowwiseParallel()
    return {"attention.wq": col, "attention.wk": col, "attention.wv": col, "attention.wo": row, "w1": col,
            "w3": col, "w2": row}


def _build(base, shard_fn, mesh, **kwargs):
    from torch.distributed.tensor.parallel import parallelize_module

    model = copy.deepcopy(base)
    for block in model.layers:
        parallelize_module(block, mesh["tp"], _plan())
        shard_fn(block, mesh=mesh["dp"], **kwargs)
    shard_fn(model, mesh=mesh["dp"], **kwargs)
    return model


def _batch(step: int, batch: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model, steps: int, dp_rank: int, dp_size: int) -> list[float]:
    """AdamW on this dp rank's slice of the global batch (the tp ranks of one dp rank see the same data)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        tokens, targets = _batch(step, 8)  # the same global batch whatever the data-parallel size
        tokens, targets = tokens.chunk(dp_size)[dp_rank], targets.chunk(dp_size)[dp_rank]
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dp_size > 1:  # the mean over dp ranks (each counted once per tp rank, which holds the same loss)
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(total.item())
    return losses


def _shard_dim1(p):
    from torch.distributed.tensor import Shard

    return Shard(1) if p.dim() == 2 else None


def _case_tp_fsdp_vs_fsdp2_and_reference(shard_placement_fn=None):
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    base = Llama()
    ours, theirs = (_build(base, fn, mesh, shard_placement_fn=shard_placement_fn)
                    for fn in (fully_shard, fsdp2_fully_shard))
    # the same labels as FSDP2's, the same local shards
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert isinstance(p, DTensor) and p.placements == q.placements and p.device_mesh == q.device_mesh, \
            (name, p.placements, q.placements)
        assert torch.equal(p.to_local(), q.to_local()), name
        assert torch.equal(p.full_tensor(), dict(base.named_parameters())[name].detach()), name
    wq = dict(ours.named_parameters())["layers.0.attention.wq.weight"]
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh["dp"].size()
    our_losses = _train(ours, 4, dp_rank, dp_size)
    their_losses = _train(theirs, 4, dp_rank, dp_size)
    ref_losses = _train(copy.deepcopy(base), 4, 0, 1)
    vs_fsdp2 = max(abs(a - b) / abs(b) for a, b in zip(our_losses, their_losses))
    vs_ref = max(abs(a - b) / abs(b) for a, b in zip(our_losses, ref_losses))
    params_err = max(rel_err(p.full_tensor(), q.full_tensor()) for p, q in zip(ours.parameters(), theirs.parameters()))
    assert vs_fsdp2 <= 1e-5 and params_err <= 1e-5 and vs_ref <= 1e-5, (vs_fsdp2, params_err, vs_ref)
    return {"wq": str(wq.placements), "loss_vs_fsdp2": vs_fsdp2, "loss_vs_single_process": vs_ref,
            "params_vs_fsdp2": params_err}


def _case_refusals():
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    from torch.distributed.tensor.parallel import parallelize_module

    model = Llama(layers=1)
    parallelize_module(model.layers[0], mesh["tp"], _plan())
    with pytest.raises(ValueError, match="not a sibling sub-mesh"):  # the tp mesh given as the dp mesh
        fully_shard(copy.deepcopy(model).layers[0], mesh=mesh["tp"])
    fp8 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, fp8=Fp8Policy(compute=False))
    with pytest.raises(ValueError, match="tensor-parallel layer"):
        fully_shard(model.layers[0], mesh=mesh["dp"], mp_policy=fp8)
    with pytest.raises(ValueError, match="sharded on a dim other than 0"):  # FP8 weights are split on rows only
        fully_shard(Block(), mesh=mesh["dp"], mp_policy=fp8, shard_placement_fn=_shard_dim1)
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    own_mesh = _get_mesh_info(mesh["tp"], None)  # a mesh of its own for every weight
    with pytest.raises(ValueError, match="use_symm_mem=False"):
        fully_shard(Block(), mesh=mesh["dp"], use_symm_mem=True,
                    shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), own_mesh))
    return "ok"


@pytest.mark.parametrize("shard_placement_fn", [None, _shard_dim1], ids=["dim0", "dim1"])
def test_tp_fsdp_vs_fsdp2_and_reference(shard_placement_fn):
    print(get_pool(4).run(_case_tp_fsdp_vs_fsdp2_and_reference, shard_placement_fn)[0])


def test_refusals():
    print(get_pool(4).run(_case_refusals)[0])


def _case_fused_optimizer_and_microbatches(shard_placement_fn=None):
    """mfsdp_ext.optim.AdamW and the microbatch API on the 2-D layout: the fused kernel steps the TP-local shards,
    its state DTensors carry the parameters' 2-D placements; the same numbers as FSDP2 with torch's AdamW."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    import mfsdp_ext

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(1)
    base = Llama()
    ours, theirs = (_build(base, fn, mesh, shard_placement_fn=shard_placement_fn)
                    for fn in (fully_shard, fsdp2_fully_shard))
    opts = [mfsdp_ext.optim.AdamW(ours.parameters(), lr=1e-2), torch.optim.AdamW(theirs.parameters(), lr=1e-2)]
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh["dp"].size()
    for step in range(3):
        tokens, targets = (t.chunk(dp_size)[dp_rank] for t in _batch(step, 8))
        for model, opt in zip((ours, theirs), opts):
            for i, (t, y) in enumerate(zip(tokens.chunk(2), targets.chunk(2))):
                ctx = mfsdp_ext.microbatch(model, is_first=i == 0, is_last=i == 1) if model is ours else None
                if ctx is None:
                    model.set_requires_gradient_sync(i == 1)
                    (F.cross_entropy(model(t).flatten(0, 1), y.flatten()) / 2).backward()
                else:
                    with ctx:
                        (F.cross_entropy(model(t).flatten(0, 1), y.flatten()) / 2).backward()
            opt.step()
            opt.zero_grad()
    err = max(rel_err(p.full_tensor(), q.full_tensor()) for p, q in zip(ours.parameters(), theirs.parameters()))
    assert err <= 1e-5, err
    state = opts[0].state[dict(ours.named_parameters())["layers.0.w1.weight"]]["exp_avg"]
    assert state.placements == dict(ours.named_parameters())["layers.0.w1.weight"].placements
    return {"params_vs_fsdp2": err, "exp_avg": str(state.placements)}


def _case_dcp_reshard(tmp: str):
    """A checkpoint saved at (dp=2, tp=2) loads at (dp=4, tp=1) and (dp=1, tp=4) exactly, ours and FSDP2 both
    ways: the labels say what each shard is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    torch.manual_seed(2)
    base = Llama()
    full = {k: v.detach().clone() for k, v in base.state_dict().items()}
    for saver, path in ((fully_shard, f"{tmp}/ours"), (fsdp2_fully_shard, f"{tmp}/fsdp2")):
        model = _build(base, saver, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
        dcp.save(model.state_dict(), checkpoint_id=path)
    results = {}
    for shape in ((4, 1), (1, 4)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        for loader in (fully_shard, fsdp2_fully_shard):
            for path in (f"{tmp}/ours", f"{tmp}/fsdp2"):
                torch.manual_seed(99)  # other weights: the load must bring the saved ones
                model = _build(Llama(), loader, mesh)
                sd = model.state_dict()
                dcp.load(sd, checkpoint_id=path)
                model.load_state_dict(sd)
                got = {k: v.full_tensor() for k, v in model.state_dict().items()}
                assert all(torch.equal(got[k], full[k]) for k in full), (shape, loader.__module__, path)
                results[f"{shape} {'ours' if loader is fully_shard else 'fsdp2'} <- {path.rsplit('/', 1)[1]}"] = "exact"
    return results


@pytest.mark.parametrize("shard_placement_fn", [None, _shard_dim1], ids=["dim0", "dim1"])
def test_fused_optimizer_and_microbatches(shard_placement_fn):
    print(get_pool(4).run(_case_fused_optimizer_and_microbatches, shard_placement_fn)[0])


def test_dcp_reshard(tmp_path):
    print(get_pool(4).run(_case_dcp_reshard, str(tmp_path))[0])


def _case_hsdp_tp():
    """HSDP + TP on a (replicate, shard, tp) = 2 x 2 x 2 mesh of 8 ranks: labels (Replicate(), Shard(0) or
    _StridedShard, TP placement), the same numbers as FSDP2."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "dp", "tp"))
    torch.manual_seed(3)
    base = Llama()
    models = []
    for shard_fn in (fully_shard, fsdp2_fully_shard):
        model = copy.deepcopy(base)
        for block in model.layers:
            parallelize_module(block, mesh["tp"], _plan())
            shard_fn(block, mesh=mesh["rep", "dp"])
        shard_fn(model, mesh=mesh["rep", "dp"])
        models.append(model)
    ours, theirs = models
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert p.placements == q.placements and torch.equal(p.to_local(), q.to_local()), (name, p.placements)
    dp_rank = mesh.get_local_rank("rep") * 2 + mesh.get_local_rank("dp")
    losses = [_train(m, 3, dp_rank, 4) for m in models]
    err = max(rel_err(p.full_tensor(), q.full_tensor()) for p, q in zip(ours.parameters(), theirs.parameters()))
    assert losses[0] == losses[1] or max(abs(a - b) / abs(b) for a, b in zip(*losses)) <= 1e-6, losses
    assert err <= 1e-6, err
    return {"wq": str(dict(ours.named_parameters())["layers.0.attention.wq.weight"].placements), "params": err}


def test_hsdp_tp():
    print(get_pool(8).run(_case_hsdp_tp)[0])


class Experts(nn.Module):
    """Grouped experts as 3-D parameters [experts, dim, hidden] (torchtitan's layout); the forward uses this rank's
    local experts (an expert-parallel layout holds a slice of them as DTensors Shard(0) over "ep")."""

    def __init__(self, num: int = 4):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num, DIM, HIDDEN) / DIM**0.5)
        self.w2 = nn.Parameter(torch.randn(num, HIDDEN, DIM) / HIDDEN**0.5)

    def forward(self, x):
        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        return torch.einsum("eth,ehd->td", F.silu(torch.einsum("td,edh->eth", x, w1)), w2)


def _experts_on(experts: nn.Module, ep_mesh) -> set:
    """The experts' weights made DTensors Shard(0) over ``ep_mesh`` (expert parallelism); returns them."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for name in ("w1", "w2"):
        setattr(experts, name, nn.Parameter(distribute_tensor(getattr(experts, name).detach(), ep_mesh, [Shard(0)])))
    return set(experts.parameters())


def _assert_same_shards(ours: nn.Module, theirs: nn.Module) -> None:
    """Every parameter labelled as FSDP2's, on the same mesh, holding the same local shard."""
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert p.placements == q.placements and p.device_mesh == q.device_mesh, (name, p.placements, q.placements)
        assert torch.equal(p.to_local(), q.to_local()), name


def _train_both(models) -> float:
    """Three AdamW steps of each model on the same per-rank inputs; the largest relative difference of their
    weights afterwards."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randn(6, DIM, generator=g)
        for model, opt in zip(models, opts):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return max(rel_err(p.full_tensor(), q.full_tensor()) for p, q in zip(*(m.parameters() for m in models)))


def _case_expert_parallel_dtensors():
    """Experts held as DTensors Shard(0) over an "ep" mesh, sharded by fully_shard over the "edp" mesh: FSDP2's
    labels ((_StridedShard(0, 2), Shard(0))) and the same numbers as FSDP2."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    torch.manual_seed(4)
    base = Experts()
    models = []
    for shard_fn in (fully_shard, fsdp2_fully_shard):
        model = copy.deepcopy(base)
        _experts_on(model, mesh["ep"])
        shard_fn(model, mesh=mesh["edp"])
        models.append(model)
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert p.placements == q.placements and torch.equal(p.to_local(), q.to_local()), (name, p.placements)
    err = _train_both(models)
    assert err <= 1e-6, err
    return {"w1": str(models[0].w1.placements), "params_vs_fsdp2": err}


def test_expert_parallel_dtensors():
    print(get_pool(4).run(_case_expert_parallel_dtensors)[0])


class MoeBlock(nn.Module):
    """A dense projection and grouped experts: torchtitan's MoE block in miniature."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.experts = Experts(num=4)

    def forward(self, x):
        return self.experts(F.silu(self.proj(x)))


def _case_per_parameter_mesh(expert_dim: int):
    """torchtitan's expert parallelism: one fully_shard over the block on the dense "dp" mesh (4 ranks), whose
    shard_placement_fn answers ShardPlacementResult(Shard(expert_dim), the "edp" mesh) for the experts, held as
    DTensors Shard(0) over "ep": FSDP2's labels, local shards and numbers (fp32: to the bit)."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    dense = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    dp_info, edp_info = _get_mesh_info(dense, None), _get_mesh_info(sparse["edp"], None)
    torch.manual_seed(6)
    base = MoeBlock()
    models = []
    for shard_fn in (fully_shard, fsdp2_fully_shard):
        model = copy.deepcopy(base)
        expert_params = _experts_on(model.experts, sparse["ep"])

        def placement(p, expert_params=expert_params):
            if p in expert_params:
                return ShardPlacementResult(placement=Shard(expert_dim), mesh_info=edp_info)
            return ShardPlacementResult(placement=Shard(0), mesh_info=dp_info)

        shard_fn(model, mesh=dense, shard_placement_fn=placement)
        models.append(model)
    _assert_same_shards(*models)
    err = _train_both(models)
    assert err == 0.0, err
    groups = models[0]._mfsdp_unit.groups
    assert len({id(g.shard_group) for g in groups}) == 2, "one group per mesh"
    return {"w1": str(models[0].experts.w1.placements), "proj": str(models[0].proj.weight.placements),
            "params_vs_fsdp2": err}


def _case_local_experts_on_sub_mesh():
    """Experts as plain local tensors (each "ep" rank its own, other weights), sharded by their own fully_shard over
    the "edp" sub-mesh inside a block sharded over the whole "dp" mesh: FSDP2's labels and numbers (fp32: to the
    bit); each expert weight's gradient is reduced over edp only, the dense one over all 4 ranks."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    dense = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    torch.manual_seed(7)
    base = MoeBlock()
    with torch.no_grad():  # this ep rank's experts differ from the other ep rank's
        for w in base.experts.parameters():
            w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(sparse.get_local_rank("ep"))))
    models = []
    for shard_fn in (fully_shard, fsdp2_fully_shard):
        model = copy.deepcopy(base)
        shard_fn(model.experts, mesh=sparse["edp"])
        shard_fn(model, mesh=dense)
        models.append(model)
    _assert_same_shards(*models)
    err = _train_both(models)
    assert err == 0.0, err
    return {"w1": f"{models[0].experts.w1.placements} on {models[0].experts.w1.device_mesh.mesh_dim_names}",
            "params_vs_fsdp2": err}


def test_local_experts_on_sub_mesh():
    print(get_pool(4).run(_case_local_experts_on_sub_mesh)[0])


@pytest.mark.parametrize("expert_dim", [0, 1])
def test_per_parameter_mesh(expert_dim):
    print(get_pool(4).run(_case_per_parameter_mesh, expert_dim)[0])


def _case_shard_dim1(param_dtype):
    """shard_placement_fn answering Shard(1) (torchtitan's choice for experts when ranks outnumber them), for the
    3-D expert weights and a 2-D weight: FSDP2's labels and local shards, and its numbers (fp32: to the bit; a bf16
    compute dtype: within bf16's rounding)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
    from torch.distributed.tensor import Shard

    class LinearThenExperts(nn.Module):  # the Linear feeds the experts: both get gradients
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(DIM, 2 * DIM)
            self.experts = Experts(num=4)

        def forward(self, x):
            return self.experts(self.proj(x)[:, :DIM])

    torch.manual_seed(5)
    base = LinearThenExperts()
    models = []
    policy = TorchPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for shard_fn in (fully_shard, fsdp2_fully_shard):
        model = copy.deepcopy(base)
        shard_fn(model, shard_placement_fn=lambda p: Shard(1) if p.dim() > 1 else None, mp_policy=policy)
        models.append(model)

    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert p.placements == q.placements and torch.equal(p.to_local(), q.to_local()), (name, p.placements)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randn(6, DIM, generator=g)
        for model, opt in zip(models, opts):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    err = max(rel_err(p.full_tensor(), q.full_tensor()) for p, q in zip(*(m.parameters() for m in models)))
    assert err <= (0.0 if param_dtype is None else 2e-2), err
    from mfsdp_ext.interop.checkpoint import full_state_dict

    full = full_state_dict(models[0])  # gathered and put in place from the staging area
    assert all(torch.equal(full[n], p.full_tensor()) for n, p in models[0].named_parameters())
    return {"w1": str(models[0].experts.w1.placements), "params_vs_fsdp2": err}


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_shard_dim1(cpu_pool, param_dtype):
    print(cpu_pool.run(_case_shard_dim1, param_dtype)[0])
