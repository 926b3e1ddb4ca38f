"""CPU offload (FSDP2's ``CPUOffloadPolicy``): fully_shard offloaded against FSDP2 offloaded and against itself not
offloaded, on 2 and 4 gloo ranks; the GPU tests at the end (``pytest -m gpu``).

On a CPU mesh the sharded state is in host memory already, so the policy changes nothing there; FSDP2 offloaded runs on
gloo with ``pin_memory=False`` (pinning needs an accelerator: FSDP2 raises with the default ``pin_memory=True``). The
CUDA path's own logic (main weight and gradient apart from the kept model weight, the staged copies, the worker thread
that adds the gradients, the replicas' sum at every reduction) runs here too under ``_host_path()``, with the host as
the device: everything but the streams, the events and pinned memory, which the GPU tests cover.

The ``_case_*`` functions run on every rank of a pool (tests/dist_pool.py); they assert and return numbers.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor

import mfsdp_ext
from mfsdp_ext import Fp8Policy, MixedPrecisionPolicy, fully_shard, microbatch, no_shard
from mfsdp_ext.core import registry
from mfsdp_ext.interop.checkpoint import full_state_dict
from mfsdp_ext.runtime.capture import CaptureError
from mfsdp_ext.sharding import groups as sharding_groups
from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, lm_train_step, rank_device, rel_err
from tests.runtime.test_capture import _seen_as_capturing

STEPS = 4
GLOBAL_BATCH = 24  # divisible by 2 and 4 ranks x 3 microbatches
PAGEABLE = CPUOffloadPolicy(pin_memory=False)
KINDS = ("ours", "ours_host", "ours_plain", "fsdp2")
# ours: CPUOffloadPolicy() (pinned by default: nothing to pin on a CPU mesh); ours_host: the CUDA path's logic on the
# host (_host_path); ours_plain: no offload; fsdp2: FSDP2 offloaded (pageable: FSDP2 pins only with an accelerator)


@contextlib.contextmanager
def _host_path():
    """fully_shard offloads as on a CUDA mesh although the mesh is the CPU's: the groups made inside get a HostOffload
    (pageable memory), so the CUDA path's code runs with the host as the device."""
    original = sharding_groups.host_offload

    def as_on_a_gpu(policy, device, **kwargs):
        return original(policy, torch.device("cuda"), **kwargs)

    sharding_groups.host_offload = as_on_a_gpu
    try:
        yield
    finally:
        sharding_groups.host_offload = original


def _shard(model: TinyLM, kind: str, **kwargs) -> TinyLM:
    shard = fsdp2_fully_shard if kind == "fsdp2" else fully_shard
    if kind != "ours_plain":
        kwargs["offload_policy"] = CPUOffloadPolicy() if kind == "ours" else PAGEABLE
    with _host_path() if kind == "ours_host" else contextlib.nullcontext():
        for b in model.blocks:
            shard(b, **kwargs)
        shard(model, **kwargs)
    groups = [g for m in model.modules() if isinstance(m, mfsdp_ext.FsdpModule) for g in m._mfsdp_unit.groups]
    # offloaded on a GPU mesh and on the host path; on a CPU mesh the groups are plain (no staging, no worker)
    offloaded = kind == "ours_host" or (kind == "ours" and rank_device().type == "cuda")
    assert all((g.offload is not None) == offloaded for g in groups), kind
    if kind == "ours_host":  # no compute-dtype shard kept on the device unless asked (the gathers copy the host's)
        kept = kwargs.get("mp_policy", MixedPrecisionPolicy()).cache_model_weight is True
        assert all((g.model_weight is not None) == kept and g.cast.in_slot != kept for g in groups), kept
    return model


def _model(kind: str, seed: int = 0, *, tie: bool = True, **kwargs) -> TinyLM:
    torch.manual_seed(seed)
    return _shard(TinyLM(tie=tie), kind, **kwargs)


def _optimizer(model, flat: bool = False) -> torch.optim.Optimizer:
    cls = mfsdp_ext.optim.AdamW if flat else torch.optim.AdamW
    return cls(model.parameters(), lr=1e-2, weight_decay=0.1)


def _microbatch(model, mode: str, first: bool, last: bool, fsdp2: bool):
    """One microbatch's context: ``every`` reduces each (accumulating the reduced shards), ``microbatch`` is
    mfsdp_ext.microbatch (FSDP2: no_sync, the same sums), ``no_sync`` set_requires_gradient_sync(last),
    ``no_all_reduce`` (HSDP) set_requires_all_reduce(last)."""
    if mode == "microbatch" and not fsdp2:
        return microbatch(model, is_first=first, is_last=last)
    if mode in ("microbatch", "no_sync"):
        model.set_requires_gradient_sync(last)
    elif mode == "no_all_reduce":
        model.set_requires_all_reduce(last)
    return contextlib.nullcontext()


def _train(model, opt, steps: range, *, microbatches: int = 1, mode: str = "every", clip=None, fsdp2=False,
           set_to_none: bool = True) -> list[float]:
    """Optimizer steps on the global batches (this rank's slice, in microbatches); returns the global losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        tokens, targets = batch(step, GLOBAL_BATCH)
        tokens, targets = tokens.chunk(world)[rank], targets.chunk(world)[rank]
        total = torch.zeros((), device=rank_device())
        for i, (t, y) in enumerate(zip(tokens.chunk(microbatches), targets.chunk(microbatches))):
            with _microbatch(model, mode, i == 0, i == microbatches - 1, fsdp2):
                loss = lm_loss(model, t, y) / microbatches
                loss.backward()
            total += loss.detach()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=clip)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if not set_to_none:  # a .grad let go by the user while the others keep accumulating: it starts afresh
            model.aux.weight.grad = None
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _params(model) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter (the two implementations split alike), on the CPU."""
    return {n: p.to_local().detach().cpu() for n, p in model.named_parameters()}


def _max_err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(rel_err(a[k], b[k]) if b[k].numel() else 0.0 for k in a)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _same_metadata(a: DTensor, b: DTensor, what: str) -> None:
    assert isinstance(a, DTensor) and isinstance(b, DTensor), what
    assert (a.shape, a.placements, a.device_mesh.shape, a.to_local().shape) == \
        (b.shape, b.placements, b.device_mesh.shape, b.to_local().shape), what


def _check_host_state(model, opt, reference_model, reference_opt) -> int:
    """Parameters, gradients and optimizer state are DTensors over CPU tensors, placed as FSDP2's (``reference``)."""
    ours, theirs = dict(model.named_parameters()), dict(reference_model.named_parameters())
    checked = 0
    for name, p in ours.items():
        pairs = {"param": (p, theirs[name]), "grad": (p.grad, theirs[name].grad)}
        pairs.update({f"state {k}": (v, reference_opt.state[theirs[name]][k]) for k, v in opt.state[p].items()
                      if isinstance(v, DTensor)})
        for what, (a, b) in pairs.items():
            _same_metadata(a, b, f"{name} {what}")
            assert a.to_local().device.type == "cpu", f"{name} {what}"
            checked += 1
    for key, value in model.state_dict().items():
        assert isinstance(value, DTensor) and value.to_local().device.type == "cpu", key
    return checked


# ------------------------------------------------------------------------------------------ training
def _case_training():
    """Offloaded training equals FSDP2 offloaded (1e-6) and itself not offloaded (bit for bit, the host path too),
    with torch's AdamW and mfsdp_ext.optim.AdamW; parameters, .grad and optimizer state are CPU DTensors placed as
    FSDP2's."""
    runs, checked = {}, 0
    for flat in (False, True):
        models = {kind: _model(kind) for kind in KINDS}
        opts = {kind: _optimizer(m, flat and kind != "fsdp2") for kind, m in models.items()}
        losses = {kind: _train(m, opts[kind], range(STEPS), fsdp2=kind == "fsdp2") for kind, m in models.items()}
        for m in models.values():  # one more backward: the gradients as the optimizer would see them
            tokens, targets = batch(STEPS, GLOBAL_BATCH)
            rank, world = dist.get_rank(), dist.get_world_size()
            lm_loss(m, tokens.chunk(world)[rank], targets.chunk(world)[rank]).backward()
        for kind in ("ours", "ours_host"):
            checked += _check_host_state(models[kind], opts[kind], models["fsdp2"], opts["fsdp2"])
        params = {kind: _params(m) for kind, m in models.items()}
        grads = {kind: {n: p.grad.to_local() for n, p in m.named_parameters()} for kind, m in models.items()}
        for kind in ("ours", "ours_host"):
            assert losses[kind] == losses["ours_plain"], (kind, losses)
            assert _equal(params[kind], params["ours_plain"]) and _equal(grads[kind], grads["ours_plain"]), kind
        err = max(_max_err(params["ours"], params["fsdp2"]), _max_err(grads["ours"], grads["fsdp2"]))
        assert err <= 1e-6, err
        runs["flat" if flat else "torch"] = {"losses": losses["ours"], "vs_fsdp2": err}
    return {**runs, "dtensors_checked": checked}


def test_training(cpu_pool):
    print(cpu_pool.run(_case_training)[0])


def _case_microbatches(mode: str):
    """Gradient accumulation over 3 microbatches: reduced at each and accumulated in the host shard (``every``),
    mfsdp_ext.microbatch, or FSDP2's set_requires_gradient_sync(False) until the last (``no_sync``)."""
    models = {kind: _model(kind, 1) for kind in KINDS}
    opts = {kind: _optimizer(m) for kind, m in models.items()}
    losses = {kind: _train(m, opts[kind], range(STEPS), microbatches=3, mode=mode, fsdp2=kind == "fsdp2")
              for kind, m in models.items()}
    params = {kind: _params(m) for kind, m in models.items()}
    for kind in ("ours", "ours_host"):
        assert losses[kind] == losses["ours_plain"] and _equal(params[kind], params["ours_plain"]), kind
    err = _max_err(params["ours"], params["fsdp2"])
    assert err <= 1e-6, err
    return {"losses": losses["ours"], "vs_fsdp2": err}


@pytest.mark.parametrize("mode", ["every", "microbatch", "no_sync"])
def test_microbatches(cpu_pool, mode):
    print(cpu_pool.run(_case_microbatches, mode)[0])


def _case_hsdp(mode: str):
    """HSDP (2 replicas): offloaded equals FSDP2 offloaded over microbatches (the host path sums over the replicas at
    every reduction, also when set_requires_all_reduce(False) asks to wait)."""
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    models = {kind: _model(kind, 2, mesh=mesh) for kind in KINDS}
    opts = {kind: _optimizer(m) for kind, m in models.items()}
    losses = {kind: _train(m, opts[kind], range(STEPS), microbatches=2, mode=mode, fsdp2=kind == "fsdp2")
              for kind, m in models.items()}
    params = {kind: _params(m) for kind, m in models.items()}
    assert losses["ours"] == losses["ours_plain"] and _equal(params["ours"], params["ours_plain"])
    errs = {kind: _max_err(params[kind], params["fsdp2"]) for kind in ("ours", "ours_host", "ours_plain")}
    assert max(errs.values()) <= 1e-6, errs
    return {"losses": losses["ours_host"], "vs_fsdp2": errs}


@pytest.mark.parametrize("mode", ["every", "no_all_reduce"])
def test_hsdp(cpu_pool, mode):
    print(cpu_pool.run(_case_hsdp, mode)[0])


# ------------------------------------------------------------------------------------------ clip_grad_norm_
def _case_clip_grad_norm():
    """clip_grad_norm_ (2-norm and inf) over offloaded gradients gives FSDP2 offloaded's total norm and clipped
    gradients; training with clipping stays equal."""
    models = {kind: _model(kind, 3, tie=False) for kind in KINDS}
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = batch(0, GLOBAL_BATCH)
    norms: dict = {}
    for kind, m in models.items():
        lm_loss(m, tokens.chunk(world)[rank], targets.chunk(world)[rank]).backward()
        norms[kind] = [torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05, norm_type=t).full_tensor().item()
                       for t in (2.0, float("inf"))]
    grads = {kind: {n: p.grad.to_local() for n, p in m.named_parameters()} for kind, m in models.items()}
    for kind in ("ours", "ours_host"):
        assert norms[kind] == norms["ours_plain"] and _equal(grads[kind], grads["ours_plain"]), (kind, norms)
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(norms[kind], norms["fsdp2"])), norms
    err = _max_err(grads["ours"], grads["fsdp2"])
    assert err <= 1e-6, err
    opts = {kind: _optimizer(m) for kind, m in models.items()}
    for kind, m in models.items():
        opts[kind].zero_grad()
        _train(m, opts[kind], range(STEPS), clip=0.05, fsdp2=kind == "fsdp2")
    params = {kind: _params(m) for kind, m in models.items()}
    assert _equal(params["ours_host"], params["ours_plain"])
    trained_err = _max_err(params["ours"], params["fsdp2"])
    assert trained_err <= 1e-6, trained_err
    return {"norms": norms["ours"], "grads_vs_fsdp2": err, "trained_vs_fsdp2": trained_err}


def test_clip_grad_norm(cpu_pool):
    print(cpu_pool.run(_case_clip_grad_norm)[0])


# ------------------------------------------------------------------------------------------ checkpoints
K, N = 3, 3  # steps before the checkpoint, steps after it


def _case_checkpoint(root: str, saved_by: str, loaded_by: str):
    """DCP (torchtitan's get_state_dict / set_state_dict): what one implementation saved, offloaded or not, continues
    in the other as in the one that saved it (1e-6; bit for bit between ours offloaded and not). Ours steps with
    mfsdp_ext.optim.AdamW, FSDP2 with torch's: the optimizer state crosses too."""
    path = os.path.join(root, f"{saved_by}_to_{loaded_by}")
    saver = _model(saved_by, 4)
    opt = _optimizer(saver, flat=saved_by != "fsdp2")
    _train(saver, opt, range(K), fsdp2=saved_by == "fsdp2")
    msd, osd = get_state_dict(saver, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    want = _train(saver, opt, range(K, K + N), fsdp2=saved_by == "fsdp2")
    loader = _model(loaded_by, 5)
    opt = _optimizer(loader, flat=loaded_by != "fsdp2")
    msd, osd = get_state_dict(loader, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(loader, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = _train(loader, opt, range(K, K + N), fsdp2=loaded_by == "fsdp2")
    err = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    both_ours = "fsdp2" not in (saved_by, loaded_by)
    assert (got == want) if both_ours else err <= 1e-6, (got, want)
    assert all(p.to_local().device.type == "cpu" for p in loader.parameters())
    return {"losses": got, "rel_err": err}


@pytest.mark.parametrize("saved_by,loaded_by", [("ours", "fsdp2"), ("fsdp2", "ours"), ("ours", "ours_plain"),
                                                ("ours_plain", "ours"), ("ours_host", "fsdp2"),
                                                ("fsdp2", "ours_host")])
def test_checkpoint(cpu_pool, tmp_path, saved_by, loaded_by):
    print(cpu_pool.run(_case_checkpoint, str(tmp_path), saved_by, loaded_by)[0])


# ------------------------------------------------------------------------------------------ the host path
BF16 = torch.bfloat16
HOST_PATH_VARIANTS = {
    "bf16": dict(mp_policy=MixedPrecisionPolicy(param_dtype=BF16)),  # the host casts, each gather copies its chunks
    "bf16_kept": dict(mp_policy=MixedPrecisionPolicy(param_dtype=BF16, cache_model_weight=True)),  # kept on the device
    "fp32_uncached": dict(mp_policy=MixedPrecisionPolicy(cache_model_weight=False)),
    "bf16_reduce": dict(mp_policy=MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)),  # staged, cast on add
    "optim_grads": dict(sharding_strategy="optim_grads"),
    "optim": dict(sharding_strategy="optim"),
    "no_shard": dict(sharding_strategy="no_shard"),
    "no_shard_mark": {},  # the root's aux head marked no_shard: a replicated group
    "keep_grads": {},  # zero_grad(set_to_none=False): each reduction adds into the kept host shard
    "reshard_after_forward": dict(reshard_after_forward=False),
    "meta": {},  # built on meta, to_empty(device="cpu") (torchtitan's way with CPU offload), reset_parameters
}


def _host_path_model(kind: str, variant: str) -> TinyLM:
    torch.manual_seed(6)
    if variant == "meta":
        with torch.device("meta"):
            model = TinyLM()
    else:
        model = TinyLM()
    if variant == "no_shard_mark":
        no_shard(model.aux)
    _shard(model, kind, **HOST_PATH_VARIANTS[variant])
    if variant == "meta":
        model.to_empty(device="cpu")
        mfsdp_ext.reset_parameters(model)
    return model


def _case_host_path(variant: str):
    """The CUDA path's logic on the host (_host_path) trains bit for bit as no offload, for each strategy, precision
    and way of holding gradients, over microbatches; its main weights and gradients are apart from the device's
    buffers, and full_state_dict gathers them."""
    models = {kind: _host_path_model(kind, variant) for kind in ("ours_host", "ours_plain")}
    opts = {kind: _optimizer(m, flat=True) for kind, m in models.items()}
    mode = "every" if variant in ("bf16", "keep_grads") else "microbatch"
    losses = {kind: _train(m, opts[kind], range(STEPS), microbatches=2, mode=mode,
                           set_to_none=variant != "keep_grads") for kind, m in models.items()}
    assert losses["ours_host"] == losses["ours_plain"], losses
    full = {kind: full_state_dict(m) for kind, m in models.items()}
    assert _equal(full["ours_host"], full["ours_plain"])
    grads = [g.grads.main_grad for m in models["ours_host"].modules() if isinstance(m, mfsdp_ext.FsdpModule)
             for g in m._mfsdp_unit.groups if g.grads.main_grad is not None]
    assert (len(grads) > 0) == (variant == "keep_grads")
    # the host path's gradients went through the worker thread, which is drained when backward returns
    assert any(t.name.startswith("mfsdp_ext-offload") for t in threading.enumerate())
    assert not registry.OFFLOAD_WORKER["worker"].pending
    return {"losses": losses["ours_host"]}


@pytest.mark.parametrize("variant", list(HOST_PATH_VARIANTS))
def test_host_path(cpu_pool, variant):
    print(cpu_pool.run(_case_host_path, variant)[0])


# ------------------------------------------------------------------------------------------ step in backward
def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _backward(model, step: int, microbatches: int, mode: str) -> torch.Tensor:
    """This rank's slice of global batch ``step``, forward and backward in ``microbatches``; its summed loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = batch(step, GLOBAL_BATCH)
    tokens, targets = tokens.chunk(world)[rank], targets.chunk(world)[rank]
    total = torch.zeros(())
    for i, (t, y) in enumerate(zip(tokens.chunk(microbatches), targets.chunk(microbatches))):
        with _microbatch(model, mode, i == 0, i == microbatches - 1, False):
            loss = lm_loss(model, t, y) / microbatches
            loss.backward()
        total += loss.detach()
    return total


def _case_step_in_backward(mode: str):
    """AdamW(step_in_backward=True) on the host path: every offloaded parameter has its new value when backward
    returns, the next forward gathers the compute-dtype shards the worker cast after those steps, and the run equals
    stepping after backward bit for bit (losses, parameters, optimizer state; fp32 and bf16 compute, HSDP), with the
    learning rate changed by a scheduler at every step, over microbatches whose earlier reductions are not final
    (mfsdp_ext.microbatch) or skipped (set_requires_gradient_sync(False))."""
    microbatches = 3 if mode in ("microbatch", "no_sync") else 1
    kwargs = dict(mp_policy=MixedPrecisionPolicy(param_dtype=BF16)) if mode == "bf16" else {}
    if mode == "hsdp":  # the replicas' sum on the device at each reduction, then the step
        kwargs = dict(mesh=init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                            mesh_dim_names=("replicate", "shard")))
    runs = {}
    for in_backward in (False, True):
        model = _model("ours_host", 2, **kwargs)
        groups = [g for m in model.modules() if isinstance(m, mfsdp_ext.FsdpModule) for g in m._mfsdp_unit.groups]
        opt = mfsdp_ext.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, step_in_backward=in_backward)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        losses, stepped_in_backward = [], []
        for step in range(STEPS):
            before = _snapshot(model)
            total = _backward(model, step, microbatches, mode)
            after = _snapshot(model)
            stepped_in_backward.append(sum(not torch.equal(after[n], before[n]) for n in before))
            # stepping in backward: every weights version after the first was gathered from the compute-dtype shard
            # the offload worker cast right behind the step that made it (else cast at the gather)
            ahead = step if in_backward else 0
            assert all(g.stats.casts_ahead_taken == ahead and g.stats.weight_syncs == step + 1 for g in groups), \
                (step, [(g.stats.casts_ahead_taken, g.stats.weight_syncs) for g in groups])
            opt.step()
            schedule.step()
            opt.zero_grad()
            dist.all_reduce(total)
            losses.append(total.item())
        runs[in_backward] = losses, _snapshot(model), opt.state_dict(), stepped_in_backward
    (losses, params, state, moved), (losses_ib, params_ib, state_ib, moved_ib) = runs[False], runs[True]
    assert losses_ib == losses and _equal(params_ib, params), (losses_ib, losses)
    assert state_ib["param_groups"] == state["param_groups"]
    for key, entry in state["state"].items():
        for name, value in entry.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            other = state_ib["state"][key][name]
            assert torch.equal(local, other.to_local() if isinstance(other, DTensor) else other), (key, name)
    held = sum(t.numel() > 0 for t in params.values())  # on 4 ranks a small parameter may leave a rank no rows
    assert moved == [0] * STEPS and moved_ib == [held] * STEPS, (moved, moved_ib, held)
    return {"losses": losses_ib, "stepped_in_backward": moved_ib}


@pytest.mark.parametrize("mode", ["every", "bf16", "hsdp", "microbatch", "no_sync"])
def test_step_in_backward(cpu_pool, mode):
    print(cpu_pool.run(_case_step_in_backward, mode)[0])


def _case_step_in_backward_refusals():
    """Where a step in backward would differ from the step after it, an error says so: gradients changed (clipping)
    or hyperparameters changed between backward and step(), a second final reduction before step(); after such an
    error the next forward gathers the weights as the step in backward left them. And the option is refused on
    parameters that are not offloaded, or on groups another such optimizer steps."""
    messages = {}

    def built():
        model = _model("ours_host", 3)
        return model, mfsdp_ext.optim.AdamW(model.parameters(), lr=1e-2, step_in_backward=True)

    model, opt = built()
    _backward(model, 0, 1, "every")
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    messages["clip"] = _expect(RuntimeError, "changed or released after the backward", opt.step)
    model, opt = built()
    _backward(model, 0, 1, "every")
    opt.param_groups[0]["lr"] = 1e-3
    messages["lr"] = _expect(RuntimeError, "hyperparameters changed", opt.step)
    # the weights changed in backward and no step was counted: the next forward casts them afresh
    groups = [g for m in model.modules() if isinstance(m, mfsdp_ext.FsdpModule) for g in m._mfsdp_unit.groups]
    syncs = [g.stats.weight_syncs for g in groups]
    _backward(model, 1, 1, "every")
    assert [g.stats.weight_syncs for g in groups] == [n + 1 for n in syncs], syncs
    assert all(g.stats.casts_ahead_taken == 0 for g in groups)
    model, opt = built()
    _backward(model, 0, 1, "every")
    messages["twice"] = _expect(RuntimeError, "already stepped", lambda: _backward(model, 1, 1, "every"))
    messages["second_optimizer"] = _expect(ValueError, "already steps in backward", lambda: mfsdp_ext.optim.AdamW(
        model.parameters(), step_in_backward=True))
    plain = _model("ours_plain", 3)
    messages["not_offloaded"] = _expect(ValueError, "none of the parameters given is offloaded",
                                        lambda: mfsdp_ext.optim.AdamW(plain.parameters(), step_in_backward=True))
    return messages


def test_step_in_backward_refusals(cpu_pool):
    print(cpu_pool.run(_case_step_in_backward_refusals)[0])


# ------------------------------------------------------------------------------------------ refusals
def _expect(exc_type, fragment: str, fn) -> str:
    with pytest.raises(exc_type, match=fragment) as err:
        fn()
    return str(err.value)


def _case_refusals():
    """What offload does not take is refused by name, with the way out."""
    fp8 = MixedPrecisionPolicy(param_dtype=BF16, fp8=Fp8Policy())
    messages = {
        "fp8": _expect(ValueError, r"FP8 weights \(MixedPrecisionPolicy", lambda: fully_shard(
            nn.Linear(16, 16), offload_policy=CPUOffloadPolicy(), mp_policy=fp8)),
        "type": _expect(TypeError, "offload_policy must be", lambda: fully_shard(nn.Linear(4, 4),
                                                                                 offload_policy="cpu")),
    }
    if not torch.cuda.is_available():  # no pinned memory without an accelerator
        with _host_path():
            messages["pinned"] = _expect(RuntimeError, r"CPUOffloadPolicy\(pin_memory=False\)", lambda: fully_shard(
                nn.Linear(4, 4), offload_policy=CPUOffloadPolicy(pin_memory=True)))
    model = _model("ours_host", 7)
    opt = _optimizer(model)
    _train(model, opt, range(1))
    tokens, _ = batch(0, 2)
    with _seen_as_capturing():
        messages["capture"] = _expect(CaptureError, "offload_policy=CPUOffloadPolicy", lambda: model(tokens))
    _train(model, opt, range(1, 2))  # nothing was changed: it trains on eagerly
    return messages


def test_refusals(cpu_pool):
    print(cpu_pool.run(_case_refusals)[0])


# ------------------------------------------------------------------------------------------ GPU
def _gpu_run(kind: str, pin_memory: bool, *, flat: bool, mesh=None, **kwargs) -> dict:
    """Train one model on the GPU from the same seed: its losses, local shards, the first step's gradients as
    backward left them, and the GPU memory it took at most (above what was allocated before it was built)."""
    gc.collect()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(8)
    model = TinyLM(vocab=512, dim=256, ffn=1024, n_layers=4)  # on the CPU: fully_shard moves what the GPU holds
    shard = fsdp2_fully_shard if kind == "fsdp2" else fully_shard
    if kind != "ours_plain":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    for b in model.blocks:
        shard(b, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    opt = _optimizer(model, flat=flat)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = batch(0, GLOBAL_BATCH, vocab=512)
    lm_loss(model, tokens.chunk(world)[rank], targets.chunk(world)[rank]).backward()
    first_grads = {n: p.grad.to_local().detach().cpu().clone() for n, p in model.named_parameters()}
    if kind != "ours_plain":  # on the host when backward returns (ours: pinned when asked); the optimizer's state too
        for n, p in model.named_parameters():
            for what, t in (("param", p.to_local()), ("grad", p.grad.to_local())):
                pinned_as_asked = kind == "fsdp2" or t.is_pinned() == pin_memory
                assert t.device.type == "cpu" and pinned_as_asked, (n, what, t.device, t.is_pinned())
    opt.step()
    opt.zero_grad()
    if kind != "ours_plain":
        assert all(v.to_local().device.type == "cpu" for s in opt.state.values() for v in s.values()
                   if isinstance(v, DTensor))
    losses = []
    for step in range(1, STEPS):
        tokens, targets = batch(step, GLOBAL_BATCH, vocab=512)
        total = torch.zeros((), device=rank_device())
        for t, y in zip(tokens.chunk(world)[rank].chunk(2), targets.chunk(world)[rank].chunk(2)):
            loss = lm_loss(model, t, y) / 2  # two microbatches, reduced at each: the host adds them
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    torch.cuda.synchronize()
    out = {"losses": losses, "params": _params(model), "first_grads": first_grads,
           "peak": torch.cuda.max_memory_allocated() - start}
    del model, opt
    torch.cuda.empty_cache()
    return out


def _case_gpu_offload(pin_memory: bool, layout: str):
    """Offloaded training on the GPU equals itself not offloaded and FSDP2 offloaded (fp32, 1e-6), with torch's and
    mfsdp_ext's AdamW, with the compute-dtype shard kept on the GPU or not; .grad is complete when backward returns;
    parameters, .grad (pinned when asked) and optimizer state are CPU tensors; the GPU's peak is lower than without
    offload, and not above FSDP2's offloaded unless the shard is kept."""
    mesh = None
    if layout == "hsdp":
        mesh = init_device_mesh("cuda", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    runs = {"plain": _gpu_run("ours_plain", pin_memory, flat=False, mesh=mesh),
            "ours": _gpu_run("ours", pin_memory, flat=False, mesh=mesh),
            "ours_flat": _gpu_run("ours", pin_memory, flat=True, mesh=mesh),
            "ours_kept": _gpu_run("ours", pin_memory, flat=True, mesh=mesh,
                                  mp_policy=MixedPrecisionPolicy(cache_model_weight=True)),
            "fsdp2": _gpu_run("fsdp2", pin_memory, flat=False, mesh=mesh)}
    errs = {}
    for name in ("ours", "ours_flat", "ours_kept", "fsdp2"):
        errs[name] = max(_max_err(runs[name]["params"], runs["plain"]["params"]),
                         _max_err(runs[name]["first_grads"], runs["plain"]["first_grads"]))
    errs["ours_vs_fsdp2"] = _max_err(runs["ours"]["params"], runs["fsdp2"]["params"])
    assert max(errs.values()) <= 1e-6, errs
    peaks = {name: run["peak"] for name, run in runs.items()}
    assert peaks["ours"] < peaks["plain"] and peaks["ours_flat"] < peaks["plain"], peaks
    # by default the GPU holds no shard of an offloaded group (the gathers copy the host's), as FSDP2's offload;
    # cache_model_weight=True keeps one. At this size the transients decide the peak against FSDP2's (ours 11% above
    # in the 1-D layout, 18% below under HSDP, 2 x H200); at the 8B shape the two peaks are equal (benchmark:
    # scripts/gpu_check.sh offload)
    assert peaks["ours"] < peaks["ours_kept"] and peaks["ours"] <= 1.15 * peaks["fsdp2"], peaks
    return {"errs": errs, "peaks": peaks}


@pytest.mark.gpu
@pytest.mark.parametrize("pin_memory", [True, False])
@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
def test_gpu_offload(gpu_pool, pin_memory, layout):
    print(gpu_pool.run(_case_gpu_offload, pin_memory, layout)[0])


def _case_gpu_comm_options(option: str):
    """Offload with the other collectives (they read and write device buffers only: the kept model weight and the
    reduced shard) trains as the same collectives without offload (on more than 2 ranks, symmetric memory sums in
    another order than the default reduce-scatter, so each is compared with itself); bf16 compute takes the default
    narrow gradient wire (summed on arrival, on the device, before the copy to the host)."""
    kwargs = {"native": dict(native_collectives=True), "symm_mem": dict(use_symm_mem=True),
              "copy_engines": dict(copy_engine_all_gather=True, copy_engine_reduce_scatter=True),
              "bf16": dict(mp_policy=MixedPrecisionPolicy(param_dtype=BF16))}[option]
    try:
        run = _gpu_run("ours", True, flat=True, **kwargs)
    except RuntimeError as e:  # not on this machine (the message names why): the option is refused as without offload
        if "fully_shard(" not in str(e):
            raise
        return {"skipped": str(e)}
    base = _gpu_run("ours_plain", True, flat=True, **kwargs)
    err = _max_err(run["params"], base["params"])
    # fp32: the same sums, and the host's AdamW equals the device's (test_gpu_offload); bf16: the two kernels may
    # round a last bit apart, then bf16 computes on it
    assert err <= (1e-3 if option == "bf16" else 1e-6), err
    return {"err": err}


@pytest.mark.gpu
@pytest.mark.parametrize("option", ["native", "symm_mem", "copy_engines", "bf16"])
def test_gpu_comm_options(gpu_pool, option):
    print(gpu_pool.run(_case_gpu_comm_options, option)[0])


def _case_gpu_graph_refused():
    """mfsdp_ext.graphed refuses an offloaded model before it captures anything, naming the option."""
    model = _model("ours", 9)
    step = lm_train_step(model, mfsdp_ext.optim.AdamW(model.parameters(), lr=1e-3))
    graphed = mfsdp_ext.graphed(step, warmup=1)
    tokens, targets = batch(0, 2)
    graphed(tokens, targets)
    with pytest.raises(CaptureError, match="offload_policy=CPUOffloadPolicy") as err:
        graphed(tokens, targets)
    step(tokens, targets)  # eager training goes on
    return str(err.value)


@pytest.mark.gpu
def test_gpu_graph_refused(gpu_pool):
    print(gpu_pool.run(_case_gpu_graph_refused)[0])
