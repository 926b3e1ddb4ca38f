"""Checkpoints as torchtitan and FSDP2 users write them: DCP resume, resharding, interop with FSDP2, full state
dicts, and DTensor semantics of parameters, gradients and optimizer state against FSDP2 on the same model.

The ``_case_*`` functions run on every rank of a pool (tests/dist_pool.py: gloo, or NCCL in the GPU tests at
the end).
A run is "save after K steps, then N more steps"; what a loaded model does in its N steps is compared with that.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from mfsdp_ext import MixedPrecisionPolicy, fully_shard
from mfsdp_ext.interop.checkpoint import full_state_dict
from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, rank_device, rel_err, shard_tiny_lm
from tests.conftest import get_pool

K, N = 3, 3  # steps before the checkpoint, steps after it
GLOBAL_BATCH = 24  # divisible by 1, 2 and 4 ranks
IMPLS = {"ours": fully_shard, "fsdp2": fsdp2_fully_shard}


def _model(seed: int, impl: str = "ours", **shard_kwargs) -> TinyLM:
    torch.manual_seed(seed)
    return shard_tiny_lm(TinyLM(), IMPLS[impl], **shard_kwargs)


def _optimizer(model, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def _tiny_lm_loss(model, step: int, rank: int, world: int) -> torch.Tensor:
    tokens, targets = batch(step, GLOBAL_BATCH)
    return lm_loss(model, tokens.chunk(world)[rank], targets.chunk(world)[rank])


def _steps(model, opt, steps: range, loss_of=_tiny_lm_loss) -> list[float]:
    """One optimizer step per global batch; this rank trains on its slice. Returns the global losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        loss = loss_of(model, step, rank, world)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _save(model, opt, path: str, api: str) -> None:
    if api == "get_state_dict":  # torchtitan's way
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    else:  # the modules' own state dicts
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)


def _load(model, opt, path: str, api: str) -> None:
    if api == "get_state_dict":
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        _create_optimizer_state(opt)  # a fresh optimizer has no state for DCP to load into
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])


@torch.no_grad()
def _create_optimizer_state(opt) -> None:
    """One step with zero gradients and lr 0: the optimizer makes its state, the weights do not move."""
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr


def _full(t) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _full_optimizer_state(model, opt) -> dict:
    _, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {f"{fqn}.{k}": v.clone() for fqn, state in osd["state"].items() for k, v in state.items()}


# ------------------------------------------------------------------------------------------ resume, same world
VARIANTS = [(kind, api) for kind in ("adamw", "sgd") for api in ("get_state_dict", "module")]


def _case_save(root: str, impl: str = "ours"):
    """For each optimizer and API: train K steps, save, train N more; the N losses go to <dir>/losses.json."""
    out = {}
    for kind, api in VARIANTS:
        path = os.path.join(root, f"{impl}_{kind}_{api}")
        model = _model(30, impl)
        opt = _optimizer(model, kind)
        _steps(model, opt, range(K))
        _save(model, opt, path, api)
        out[f"{kind}/{api}"] = _steps(model, opt, range(K, K + N))
        if dist.get_rank() == 0:
            with open(os.path.join(path, "losses.json"), "w") as f:
                json.dump(out[f"{kind}/{api}"], f)
    return out


def _case_resume(root: str, impl: str = "ours", tol: float = 0.0, saved_by: str | None = None):
    """In a process that did not save: a fresh model (other seed) and optimizer load the checkpoint and train N
    steps; their losses equal the saved run's (bit for bit when tol is 0)."""
    results = {}
    for kind, api in VARIANTS:
        path = os.path.join(root, f"{saved_by or impl}_{kind}_{api}")
        with open(os.path.join(path, "losses.json")) as f:
            want = json.load(f)
        model = _model(31, impl)
        opt = _optimizer(model, kind)
        _load(model, opt, path, api)
        got = _steps(model, opt, range(K, K + N))
        err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        assert (got == want) if tol == 0 else err <= tol, (kind, api, got, want)
        results[f"{kind}/{api}"] = {"losses": got, "rel_err": err}
    return results


def test_resume_bit_exact(cpu_pool, tmp_path):
    cpu_pool.run(_case_save, str(tmp_path))
    cpu_pool.restart()  # fresh processes load the checkpoint
    print(cpu_pool.run(_case_resume, str(tmp_path))[0])


# ------------------------------------------------------------------------------------------ resharding
def _shard_columns(p):
    return Shard(1) if p.dim() == 2 else None


SPLITS = {"rows": {}, "columns": {"shard_placement_fn": _shard_columns}}  # dim 0 (the default), or matrices on dim 1


def _case_save_for_reshard(root: str, split: str = "rows"):
    model = _model(32, **SPLITS[split])
    opt = _optimizer(model, "adamw")
    _steps(model, opt, range(K))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
    full = {"model": full_state_dict(model), "optim": _full_optimizer_state(model, opt)}
    losses = _steps(model, opt, range(K, K + N))
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(root, "full.pt"))
        with open(os.path.join(root, "losses.json"), "w") as f:
            json.dump(losses, f)
    return losses


def _case_load_resharded(root: str, split: str = "rows"):
    """Load on another number of ranks (or split): parameters and optimizer state equal the saved full tensors
    exactly, and the next N losses equal the saved run's within 1e-6 (another world size sums in another order)."""
    model = _model(33, **SPLITS[split])
    opt = _optimizer(model, "adamw")
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=root)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved = torch.load(os.path.join(root, "full.pt"), map_location="cpu")
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor().cpu(), saved["model"][name]), name
    got_state = _full_optimizer_state(model, opt)
    assert got_state.keys() == saved["optim"].keys()
    for key, value in got_state.items():  # AdamW keeps `step` on the CPU, the moments on the parameters' device
        assert torch.equal(value.cpu(), saved["optim"][key]), key
    with open(os.path.join(root, "losses.json")) as f:
        want = json.load(f)
    got = _steps(model, opt, range(K, K + N))
    err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert err <= 1e-6, (got, want)
    return {"world": dist.get_world_size(), "rel_err": err}


@pytest.mark.parametrize("saved_on,loaded_on,saved_split,loaded_split",
                         [(2, 4, "rows", "rows"), (2, 1, "rows", "rows"), (4, 2, "rows", "rows"),
                          (2, 4, "columns", "rows"), (4, 2, "rows", "columns")])
def test_reshard(tmp_path, saved_on, loaded_on, saved_split, loaded_split):
    get_pool(saved_on).run(_case_save_for_reshard, str(tmp_path), saved_split)
    print(get_pool(loaded_on).run(_case_load_resharded, str(tmp_path), loaded_split)[0])


# ------------------------------------------------------------------------------------------ interop with FSDP2
@pytest.mark.parametrize("saved_by,loaded_by", [("fsdp2", "ours"), ("ours", "fsdp2")])
def test_interop_with_fsdp2(cpu_pool, tmp_path, saved_by, loaded_by):
    """A checkpoint of one continues in the other like the one that wrote it continues (1e-6)."""
    cpu_pool.run(_case_save, str(tmp_path), saved_by)
    print(cpu_pool.run(_case_resume, str(tmp_path), loaded_by, 1e-6, saved_by)[0])


# ------------------------------------------------------------------------------------------ full state dicts
def _case_full_state_dicts(tmpdir: str):
    rank = dist.get_rank()
    torch.manual_seed(34)
    ref = TinyLM().to(rank_device())
    model = shard_tiny_lm(copy.deepcopy(ref), fully_shard)
    opt, ref_opt = _optimizer(model, "adamw"), _optimizer(ref, "adamw")
    _steps(model, opt, range(K))
    for step in range(K):
        tokens, targets = batch(step, GLOBAL_BATCH)
        lm_loss(ref, tokens, targets).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    # get_state_dict(full_state_dict, cpu_offload): rank 0 holds the unsharded model and optimizer state
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    _, ref_osd = get_state_dict(ref, ref_opt, options=StateDictOptions(full_state_dict=True))
    errs = {}
    if rank == 0:
        ref_params = dict(ref.named_parameters(remove_duplicate=False))
        assert set(msd) == set(ref.state_dict()), (sorted(msd), sorted(ref.state_dict()))
        for name, value in msd.items():
            assert value.device.type == "cpu" and not isinstance(value, DTensor), name
            errs[name] = rel_err(value, ref_params[name].detach())
        assert osd["state"].keys() == ref_osd["state"].keys()
        for fqn, state in osd["state"].items():
            for k, v in state.items():
                errs[f"optim {fqn}.{k}"] = rel_err(v, ref_osd["state"][fqn][k])
        assert max(errs.values()) <= 1e-5, errs
    else:
        assert msd == {} and not osd.get("state"), "cpu_offload keeps the full state dict on rank 0 only"
    truth = full_state_dict(model)

    # set_model_state_dict(full_state_dict, broadcast_from_rank0): rank 0 has the values, the others nothing
    fresh = _model(35)
    set_model_state_dict(fresh, msd if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    assert all(torch.equal(v, truth[k]) for k, v in full_state_dict(fresh).items())

    # a plain torch.save'd full state dict (no DTensors) loads with load_state_dict
    path = os.path.join(tmpdir, "full_model.pt")
    if rank == 0:
        os.makedirs(tmpdir, exist_ok=True)
        torch.save({k: v.cpu() for k, v in truth.items()}, path)
    dist.barrier()
    from_file = _model(36)
    from_file.load_state_dict(torch.load(path))
    assert all(torch.equal(v, truth[k]) for k, v in full_state_dict(from_file).items())
    return {"max_rel_err_vs_single_process": max(errs.values()) if errs else None}


def test_full_state_dicts(cpu_pool, tmp_path):
    print(cpu_pool.run(_case_full_state_dicts, str(tmp_path))[0])


def _case_dcp_load_in_place(tmpdir: str):
    """dcp.load into model.state_dict() updates the model itself (no load_state_dict), as for FSDP2; the bf16
    weights the next forward uses follow."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    saved = _model(37, mp_policy=bf16)
    _steps(saved, _optimizer(saved, "adamw"), range(K))
    dcp.save(saved.state_dict(), checkpoint_id=tmpdir)
    target = _model(38, mp_policy=bf16)
    state = target.state_dict()  # taken before the forward that casts and gathers the old weights
    tokens, targets = batch(0, 4)
    lm_loss(target, tokens, targets)
    dcp.load(state, checkpoint_id=tmpdir)
    got, want = full_state_dict(target), full_state_dict(saved)
    assert all(torch.equal(got[k], want[k]) for k in want)
    with torch.no_grad():
        assert lm_loss(target, tokens, targets).item() == lm_loss(saved, tokens, targets).item()
    return "ok"


def test_dcp_load_in_place(cpu_pool, tmp_path):
    cpu_pool.run(_case_dcp_load_in_place, str(tmp_path))


# ------------------------------------------------------------------------------------------ DTensor semantics
def _same_metadata(a: DTensor, b: DTensor, what: str) -> None:
    assert (a.shape, a.stride(), a.placements, a.to_local().shape) == (b.shape, b.stride(), b.placements,
                                                                       b.to_local().shape), what


def _case_dtensor_semantics_match_fsdp2():
    """Ours and FSDP2 after the same step: parameters, gradients and optimizer state carry the same DTensor
    metadata and give the same full_tensor() / redistribute(Replicate()); clip_grad_norm_ gives the same total
    norm and clipped gradients."""
    models = {impl: _model(39, impl) for impl in IMPLS}
    opts = {impl: _optimizer(m, "adamw") for impl, m in models.items()}
    for impl in IMPLS:
        _steps(models[impl], opts[impl], range(K))
    assert models["ours"].state_dict().keys() == models["fsdp2"].state_dict().keys()
    tokens, targets = batch(K, GLOBAL_BATCH)
    rank, world = dist.get_rank(), dist.get_world_size()
    norms, errs = {}, {}
    for m in models.values():
        lm_loss(m, tokens.chunk(world)[rank], targets.chunk(world)[rank]).backward()
    ours, theirs = (dict(models[i].named_parameters()) for i in ("ours", "fsdp2"))
    _, ours_osd = get_state_dict(models["ours"], opts["ours"])
    _, theirs_osd = get_state_dict(models["fsdp2"], opts["fsdp2"])
    for name in theirs:
        pairs = {"param": (ours[name], theirs[name]), "grad": (ours[name].grad, theirs[name].grad)}
        pairs.update({k: (ours_osd["state"][name][k], v) for k, v in theirs_osd["state"][name].items()
                      if isinstance(v, DTensor)})
        for what, (a, b) in pairs.items():
            _same_metadata(a, b, f"{name} {what}")
            replicated = a.redistribute(placements=[Replicate()] * a.device_mesh.ndim).to_local()
            assert torch.equal(replicated, a.full_tensor()), f"{name} {what}"
            errs[f"{name} {what}"] = rel_err(a.full_tensor(), b.full_tensor())
    for impl, m in models.items():
        norms[impl] = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.1).full_tensor().item()
    clipped = {n: rel_err(ours[n].grad.full_tensor(), theirs[n].grad.full_tensor()) for n in theirs}
    assert max(errs.values()) <= 1e-5, errs
    assert abs(norms["ours"] - norms["fsdp2"]) <= 1e-6 * norms["fsdp2"], norms
    assert max(clipped.values()) <= 1e-5, clipped
    return {"norms": norms, "max_rel_err": max(errs.values()), "max_clipped_grad_err": max(clipped.values())}


def test_dtensor_semantics_match_fsdp2(cpu_pool):
    print(cpu_pool.run(_case_dtensor_semantics_match_fsdp2)[0])


def _case_hsdp_dtensors():
    """HSDP's (Replicate(), Shard(0)) parameters and gradients reassemble to the full tensors."""
    world = dist.get_world_size()
    mesh = init_device_mesh(rank_device().type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = _model(40, mesh=mesh)
    _steps(model, _optimizer(model, "adamw"), range(2))
    truth = full_state_dict(model)
    for name, p in model.named_parameters():
        assert p.placements == (Replicate(), p.placements[1]) and torch.equal(p.full_tensor(), truth[name]), name
    msd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert all(torch.equal(msd[k], truth[k]) for k in msd)
    return "ok"


def test_hsdp_dtensors():
    get_pool(4).run(_case_hsdp_dtensors)


# ------------------------------------------------------------------------------------------ a HuggingFace model
def _hf_llama(seed: int, impl: str = "ours"):
    """A small LlamaForCausalLM built from its config (nothing downloaded), each decoder layer and the root
    sharded. Eager attention: its backward is deterministic, so resumed runs can be compared bit for bit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="eager")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(rank_device())
    for layer in model.model.layers:
        IMPLS[impl](layer)
    return IMPLS[impl](model)


def _hf_loss(model, step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, 512, (8, 33), generator=g).to(rank_device()).chunk(world)[rank]
    return model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss


def _case_hf_llama_resume(tmpdir: str):
    """The torchtitan way with a HuggingFace Llama: get_state_dict + dcp.save after K steps, then dcp.load +
    set_state_dict into a fresh model and optimizer; the next N losses equal the uninterrupted run's exactly."""
    pytest.importorskip("transformers")
    model = _hf_llama(41)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    _steps(model, opt, range(K), _hf_loss)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmpdir)
    want = _steps(model, opt, range(K, K + N), _hf_loss)
    fresh = _hf_llama(42)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3, weight_decay=0.1)
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=tmpdir)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = _steps(fresh, fresh_opt, range(K, K + N), _hf_loss)
    assert got == want, (got, want)
    return {"losses": got}


def test_hf_llama_resume(cpu_pool, tmp_path):
    pytest.importorskip("transformers")
    print(cpu_pool.run(_case_hf_llama_resume, str(tmp_path))[0])


def _case_load_assign_into_meta_model(impl: str):
    """accelerate's cpu_ram_efficient_loading: shard a meta-built model (blocks, the tied [emb, norm, head] list
    unit, the root), then load_state_dict(sharded, assign=True) of DTensors made with distribute_tensor from the
    meta model's own placements: the model then computes as the one the weights came from, as with FSDP2."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(41)
    ref = TinyLM().to(rank_device())
    with torch.device("meta"):
        model = TinyLM()
    for b in model.blocks:
        IMPLS[impl](b)
    IMPLS[impl]([model.emb, model.norm, model.head], reshard_after_forward=False)
    IMPLS[impl](model)
    meta_sd = model.state_dict()
    full = ref.state_dict()
    sharded = {k: distribute_tensor(full[k].detach().clone(), v.device_mesh, v.placements)
               for k, v in meta_sd.items()}
    model.load_state_dict(sharded, assign=True)
    model.head.weight = model.emb.weight  # accelerate re-ties after the load (tie_weights)
    tokens, targets = batch(0, 4)
    with torch.no_grad():
        got, want = lm_loss(model, tokens, targets).item(), lm_loss(ref, tokens, targets).item()
    assert abs(got - want) <= 1e-6 * abs(want), (got, want)
    return "ok"


@pytest.mark.parametrize("impl", ["ours", "fsdp2"])
def test_load_assign_into_meta_model(cpu_pool, impl):
    cpu_pool.run(_case_load_assign_into_meta_model, impl)


# ----------------------------------------------------------------------------------------------- GPU (NCCL)
@pytest.mark.gpu
def test_checkpoint_resume_bit_exact(tmp_path):
    pool = get_pool(2, "nccl")
    pool.run(_case_save, str(tmp_path))
    pool.restart()  # fresh processes load the checkpoint
    print(pool.run(_case_resume, str(tmp_path))[0])


@pytest.mark.gpu
@pytest.mark.parametrize("saved_on,loaded_on", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_checkpoint_reshard(tmp_path, saved_on, loaded_on):
    get_pool(saved_on, "nccl").run(_case_save_for_reshard, str(tmp_path))
    print(get_pool(loaded_on, "nccl").run(_case_load_resharded, str(tmp_path))[0])


@pytest.mark.gpu
@pytest.mark.parametrize("saved_by,loaded_by", [("fsdp2", "ours"), ("ours", "fsdp2")])
def test_checkpoint_interop_with_fsdp2(gpu_pool, tmp_path, saved_by, loaded_by):
    gpu_pool.run(_case_save, str(tmp_path), saved_by)
    print(gpu_pool.run(_case_resume, str(tmp_path), loaded_by, 1e-6, saved_by)[0])


@pytest.mark.gpu
def test_gpu_full_state_dicts(gpu_pool, tmp_path):
    print(gpu_pool.run(_case_full_state_dicts, str(tmp_path))[0])


@pytest.mark.gpu
def test_gpu_dcp_load_in_place(gpu_pool, tmp_path):
    gpu_pool.run(_case_dcp_load_in_place, str(tmp_path))


@pytest.mark.gpu
def test_gpu_dtensor_semantics_match_fsdp2(gpu_pool):
    print(gpu_pool.run(_case_dtensor_semantics_match_fsdp2)[0])


@pytest.mark.gpu
def test_gpu_hf_llama_resume(gpu_pool, tmp_path):
    """The issue's repro: a HuggingFace LlamaForCausalLM checkpointed the torchtitan way resumes bit-exactly."""
    pytest.importorskip("transformers")
    print(gpu_pool.run(_case_hf_llama_resume, str(tmp_path))[0])
