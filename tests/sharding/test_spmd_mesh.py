"""FSDP2's full-SPMD form, ``fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``: every
parameter a DTensor on one mesh that holds every parallel dim (Replicate() on the data-parallel dims, the
tensor-parallel placement on "tp"), the inputs DTensors split over the data-parallel dims (torchtitan's full_dtensor
backend). Ours against FSDP2 doing the same and a single-process model (fp32, gloo)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mfsdp_ext import fully_shard
from mfsdp_ext.testing.models import rel_err
from tests.conftest import get_pool
from tests.sharding.test_tensor_parallel import Block, Llama, _batch

COLWISE, ROWWISE = ("wq", "wk", "wv", "w1", "w3"), ("wo", "w2")


def _distribute(model: nn.Module, mesh) -> nn.Module:
    """Every parameter a DTensor on the full mesh: colwise / rowwise on "tp" (where the mesh has it), Replicate()
    elsewhere."""
    model = copy.deepcopy(model)
    names = mesh.mesh_dim_names
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        tp = Shard(0) if leaf in COLWISE else Shard(1) if leaf in ROWWISE else Replicate()
        placements = [tp if n == "tp" else Replicate() for n in names]
        for pname, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    return model


def _shard(model, shard_fn, mesh, dims, **kwargs):
    # the mesh object the DTensors hold: FSDP2 wants that very object, and DTensor may hand out an earlier equal
    # mesh of this process in place of ``mesh``
    mesh = next(iter(model.parameters())).device_mesh
    for block in model.layers:
        shard_fn(block, mesh=mesh, dp_mesh_dims=dims, **kwargs)
    shard_fn(model, mesh=mesh, dp_mesh_dims=dims, **kwargs)
    return model


def _train(model, mesh, data_dims: tuple[str, ...], steps: int) -> list[float]:
    """AdamW on the global batch, split over ``data_dims`` as DTensor inputs (torchtitan's parallelize_inputs)."""
    placements = [Shard(0) if n in data_dims else Replicate() for n in mesh.mesh_dim_names]
    ways = math.prod(mesh[n].size() for n in data_dims)
    index = 0
    for n in data_dims:
        index = index * mesh[n].size() + mesh.get_local_rank(n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        tokens, targets = (DTensor.from_local(t.chunk(ways)[index], mesh, placements) for t in _batch(step, 8))
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item())
    return losses


def _reference(base: nn.Module, steps: int) -> list[float]:
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        tokens, targets = _batch(step, 8)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _case_vs_fsdp2(shape, names, shard, replicate, data_dims, shard_dim1=False):
    """Ours and FSDP2 under the same dp_mesh_dims (``shard_dim1``: shard_placement_fn answering Shard(1) for every
    weight): the same labels and local shards, the same losses and weights, and within 1e-5 of a single process."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dims = DataParallelMeshDims(shard=shard, replicate=replicate)
    kwargs = {"shard_placement_fn": (lambda p: Shard(1) if p.dim() == 2 else None)} if shard_dim1 else {}
    torch.manual_seed(0)
    base = Llama()
    ours, theirs = (_shard(_distribute(base, mesh), fn, mesh, dims, **kwargs)
                    for fn in (fully_shard, fsdp2_fully_shard))
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert p.placements == q.placements and p.device_mesh == q.device_mesh, (name, p.placements, q.placements)
        assert torch.equal(p.to_local(), q.to_local()), name
        assert torch.equal(p.full_tensor(), dict(base.named_parameters())[name].detach()), name
    losses = [_train(m, mesh, data_dims, 3) for m in (ours, theirs)]
    ref = _reference(base, 3)
    params_err = max(rel_err(p.full_tensor(), q.full_tensor()) for p, q in zip(ours.parameters(), theirs.parameters()))
    vs_fsdp2 = max(abs(a - b) / abs(b) for a, b in zip(*losses))
    vs_ref = max(abs(a - b) / abs(b) for a, b in zip(losses[0], ref))
    assert vs_fsdp2 <= 1e-6 and params_err <= 1e-6 and vs_ref <= 1e-5, (vs_fsdp2, params_err, vs_ref)
    wq = dict(ours.named_parameters())["layers.0.attention.wq.weight"]
    return {"wq": f"{wq.placements} on {wq.device_mesh.mesh_dim_names}", "loss_vs_fsdp2": vs_fsdp2,
            "params_vs_fsdp2": params_err, "loss_vs_single_process": vs_ref}


CASES = {  # world, (mesh shape, dim names, shard, replicate, the dims the batch is split over)
    "fsdp_tp": (4, ((2, 2), ("dp", "tp"), "dp", None, ("dp",))),
    "fsdp_only": (2, ((2,), ("dp",), "dp", None, ("dp",))),
    "ddp_tp": (4, ((2, 2), ("rep", "tp"), None, "rep", ("rep",))),
    # 2-D meshes: DTensor's placement search on a 3-D mesh takes minutes per op on a 2-core machine
    "hsdp": (4, ((2, 2), ("rep", "dp"), "dp", "rep", ("rep", "dp"))),
    "flattened": (4, ((2, 2), ("dp", "cp"), ("dp", "cp"), None, ("dp", "cp"))),
    "flattened_hsdp": (4, ((1, 2, 2), ("rep", "dp", "cp"), ("dp", "cp"), "rep", ("rep", "dp", "cp"))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_vs_fsdp2(case):
    world, args = CASES[case]
    print(get_pool(world).run(_case_vs_fsdp2, *args)[0])


def test_shard_dim1_vs_fsdp2():
    """shard_placement_fn answering Shard(1) under dp_mesh_dims: labels, shards and numbers as FSDP2's."""
    print(get_pool(4).run(_case_vs_fsdp2, (2, 2), ("dp", "tp"), "dp", None, ("dp",), True)[0])


def _case_fused_optimizer_and_microbatches():
    """mfsdp_ext.optim.AdamW and the microbatch API under dp_mesh_dims: the same weights as FSDP2 with torch's
    AdamW and set_requires_gradient_sync, the optimizer state labelled as its parameter."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    import mfsdp_ext

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dims = DataParallelMeshDims(shard="dp")
    torch.manual_seed(1)
    base = Llama()
    ours, theirs = (_shard(_distribute(base, mesh), fn, mesh, dims) for fn in (fully_shard, fsdp2_fully_shard))
    opts = [mfsdp_ext.optim.AdamW(ours.parameters(), lr=1e-2), torch.optim.AdamW(theirs.parameters(), lr=1e-2)]
    placements = [Shard(0), Replicate()]
    for step in range(3):
        tokens, targets = (t.chunk(2)[mesh.get_local_rank("dp")] for t in _batch(step, 8))
        for model, opt in zip((ours, theirs), opts):
            for i, (t, y) in enumerate(zip(tokens.chunk(2), targets.chunk(2))):
                t, y = (DTensor.from_local(x, mesh, placements) for x in (t, y))
                if model is ours:
                    with mfsdp_ext.microbatch(model, is_first=i == 0, is_last=i == 1):
                        (F.cross_entropy(model(t).flatten(0, 1), y.flatten()) / 2).backward()
                else:
                    model.set_requires_gradient_sync(i == 1)
                    (F.cross_entropy(model(t).flatten(0, 1), y.flatten()) / 2).backward()
            opt.step()
            opt.zero_grad()
    err = max(rel_err(p.full_tensor(), q.full_tensor()) for p, q in zip(ours.parameters(), theirs.parameters()))
    assert err <= 1e-5, err
    w1 = dict(ours.named_parameters())["layers.0.w1.weight"]
    state = opts[0].state[w1]["exp_avg"]
    assert state.placements == w1.placements and state.device_mesh == w1.device_mesh
    return {"params_vs_fsdp2": err, "exp_avg": str(state.placements)}


def test_fused_optimizer_and_microbatches():
    print(get_pool(4).run(_case_fused_optimizer_and_microbatches)[0])


def _case_dcp_interop(tmp: str):
    """A checkpoint of ours under dp_mesh_dims loads into FSDP2 under dp_mesh_dims, and into ours on a plain
    4-rank data-parallel mesh, exactly (the labels say what each shard is)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dims = DataParallelMeshDims(shard="dp")
    torch.manual_seed(5)
    base = Llama()
    full = {k: v.detach().clone() for k, v in base.state_dict().items()}
    dcp.save(_shard(_distribute(base, mesh), fully_shard, mesh, dims).state_dict(), checkpoint_id=tmp)
    torch.manual_seed(99)  # other weights: the load must bring the saved ones
    other = Llama()
    targets = {"fsdp2 dp_mesh_dims": _shard(_distribute(other, mesh), fsdp2_fully_shard, mesh, dims)}
    plain = copy.deepcopy(other)
    for block in plain.layers:
        fully_shard(block, mesh=init_device_mesh("cpu", (4,)))
    targets["ours plain 4-rank"] = fully_shard(plain, mesh=init_device_mesh("cpu", (4,)))
    for what, model in targets.items():
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=tmp)
        model.load_state_dict(sd)
        got = {k: v.full_tensor() for k, v in model.state_dict().items()}
        assert all(torch.equal(got[k], full[k]) for k in full), what
    return {what: "exact" for what in targets}


def test_dcp_interop(tmp_path):
    print(get_pool(4).run(_case_dcp_interop, str(tmp_path))[0])


def _case_refusals():
    from torch.distributed.fsdp import DataParallelMeshDims

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dims = DataParallelMeshDims(shard="dp")
    with pytest.raises(ValueError, match="'attention_norm.weight' is a plain tensor"):
        fully_shard(Llama().layers[0], mesh=mesh, dp_mesh_dims=dims)
    block = Block()
    block.w1.weight = nn.Parameter(distribute_tensor(block.w1.weight.detach(), mesh, [Shard(0), Replicate()]))
    with pytest.raises(ValueError, match="placed Shard.* on the data-parallel dim 'dp'"):
        fully_shard(block, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"), ignored_params=set(
            p for n, p in block.named_parameters() if n != "w1.weight"))
    with pytest.raises(ValueError, match="no dim 'fsdp'"):
        fully_shard(Block(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="fsdp"))
    with pytest.raises(ValueError, match="no dim names"):
        fully_shard(Block(), mesh=init_device_mesh("cpu", (4,)), dp_mesh_dims=dims)
    with pytest.raises(ValueError, match="pass the full mesh"):
        fully_shard(Block(), dp_mesh_dims=dims)
    three = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("a", "tp", "b"))
    with pytest.raises(ValueError, match="must be neighbours"):
        fully_shard(Block(), mesh=three, dp_mesh_dims=DataParallelMeshDims(shard=("a", "b")))
    return "ok"


def test_refusals():
    print(get_pool(4).run(_case_refusals)[0])
