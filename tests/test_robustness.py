"""A failed step, freezing after fully_shard, hand-written updates: the model stays right (gloo ranks;
failed-step recovery and resting memory also on 2 GPUs: the GPU tests at the end).

A failed step is compared with a run of the same model that never took that step's batch: fp32, same code path,
so the losses must be equal exactly.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mfsdp_ext import MixedPrecisionPolicy, fully_shard, microbatch
from mfsdp_ext.core.device import DeviceHandle
from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, rank_device, rel_err, shard_tiny_lm
from tests.conftest import get_pool
from tests.test_fully_shard import GLOBAL_BATCH, _compare_params

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class _Boom(RuntimeError):
    pass


def _raise(*args):
    raise _Boom("this step fails")


def _fail_in(model: TinyLM, where: str):
    """A hook on the middle block that raises in its forward, or when the backward reaches its output (after the
    last block has reduced its gradients)."""
    if where == "forward":
        return model.blocks[1].register_forward_hook(_raise)

    def raise_on_grad(module, args, out) -> None:
        out.register_hook(_raise)

    return model.blocks[1].register_forward_hook(raise_on_grad)


def _train_with_failures(model, steps: int, fail: dict[int, str], microbatches: int = 1) -> list[float]:
    """AdamW on this rank's slice of each step's batch; fail[step] is "forward" or "backward" (that step raises
    there, is caught on every rank and followed by zero_grad, as a training loop that skips a bad batch does)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        if fail.get(step) == "skip":  # the reference: this batch is never seen
            losses.append(None)
            continue
        tokens, targets = batch(step, GLOBAL_BATCH, device=rank_device())
        tokens, targets = tokens.chunk(world)[rank], targets.chunk(world)[rank]
        total = torch.zeros((), device=rank_device())
        try:
            for i, (t, y) in enumerate(zip(tokens.chunk(microbatches), targets.chunk(microbatches))):
                with microbatch(model, is_first=i == 0, is_last=i == microbatches - 1):
                    fails_here = step in fail and i == microbatches // 2  # midway through the microbatches
                    handle = _fail_in(model, fail[step]) if fails_here else None
                    try:
                        loss = lm_loss(model, t, y) / microbatches
                        loss.backward()
                    finally:
                        if handle is not None:
                            handle.remove()
                total += loss.detach()
        except _Boom:
            opt.zero_grad()
            losses.append(None)
            continue
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append((total / world).item())
    return losses


def _case_failed_step(where: str, microbatches: int, strategy: str):
    torch.manual_seed(30)
    base = TinyLM()
    failing = shard_tiny_lm(copy.deepcopy(base), fully_shard, sharding_strategy=strategy)
    clean = shard_tiny_lm(copy.deepcopy(base), fully_shard, sharding_strategy=strategy)
    steps, failed_step = 5, 2
    got = _train_with_failures(failing, steps, {failed_step: where}, microbatches)
    # the clean run takes the same batches except the failed one: run it with the same step numbers
    want = _train_with_failures(clean, steps, {failed_step: "skip"}, microbatches)
    assert got[failed_step] is None
    if rank_device().type == "cpu":
        assert got == want, (got, want)
    else:  # GPU kernels (e.g. atomics in an embedding's backward) need not repeat bit for bit across two models
        assert all((a is None) == (b is None) and (a is None or abs(a - b) <= 1e-6 * abs(b))
                   for a, b in zip(got, want)), (got, want)
    for m in failing.modules():  # at rest: sharded parameters, gathered storage freed, no stale grads
        unit = getattr(m, "_mfsdp_unit", None)
        if unit is not None and strategy == "optim_grads_params":
            assert all(g.unsharded.nbytes() == 0 for g in unit.groups), unit.name
            assert not any(g.grads.has_unsharded() for g in unit.groups), unit.name
    return {"losses": got}



class _TokenDevice(DeviceHandle):
    """A CPU DeviceHandle whose gather events are tokens and whose waits are logged: the stream bookkeeping that
    CUDA runs (a unit computes only after its compute stream waited for the gather it uses) checked on gloo."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.waited = set()

    def record_event(self, stream):
        return object()

    def wait_event(self, event) -> None:
        if event is not None:
            self.waited.add(event)


def _case_gather_waited_after_failed_step(strategy: str):
    """After a backward that raised midway through microbatches, the next forward computes each unit only after
    waiting for the last gather issued for it. (A gather issued in the failed backward, for a unit that stays
    gathered into the next microbatch's forward, once lost its event: that forward then read the buffer while NCCL
    could still be writing it, which on 2 GPUs now and then gave the next steps other losses.)"""
    torch.manual_seed(32)
    model = shard_tiny_lm(TinyLM(), fully_shard, sharding_strategy=strategy)
    _train_with_failures(model, 1, {}, microbatches=3)  # lazy init
    units = [m._mfsdp_unit for m in model.modules() if hasattr(m, "_mfsdp_unit")]
    device = units[0].context.device = _TokenDevice(units[0].context.device.device)
    last_gather, unwaited = {}, []

    def note_gather(unit, unshard):
        def wrapped(*args, **kwargs):
            before = unit.unshard_event
            unshard(*args, **kwargs)
            if unit.unshard_event is not None and unit.unshard_event is not before:
                last_gather[unit] = unit.unshard_event
        return wrapped

    def check_waited(unit):
        def hook(module, args):  # runs after the unit's own pre-forward hook (registered before this one)
            if unit in last_gather and last_gather[unit] not in device.waited:
                unwaited.append(unit.name)
        return hook

    for unit in units:
        unit.unshard = note_gather(unit, unit.unshard)
        unit.module.register_forward_pre_hook(check_waited(unit))
    losses = _train_with_failures(model, 3, {0: "backward"}, microbatches=3)
    assert losses[0] is None and all(loss is not None for loss in losses[1:]), losses
    assert not unwaited, f"computed before waiting for their gather: {unwaited}"
    return {"gathers": len(last_gather), "waits": len(device.waited)}


def _case_gather_in_flight_after_failed_step():
    """CUDA: the same as _case_gather_waited_after_failed_step on real streams. The failing backward's gathers are
    held back on the all-gather stream (a ~0.1 s spin queued before block 1's pre-backward prefetches block 0);
    the next step's forward of block 0, which stays gathered between microbatches, must start on the compute
    stream after that gather has finished, not while it is pending."""
    torch.manual_seed(33)
    model = shard_tiny_lm(TinyLM(), fully_shard)
    _train_with_failures(model, 1, {}, microbatches=3)  # lazy init
    ag_stream = model._mfsdp_unit.context.ag_stream
    marks = {}

    def on_output_grad(fn):
        def forward_hook(module, args, out):
            out.register_hook(fn)  # returns None: the module's output stays as it is
        return forward_hook

    def hold_back_gathers(grad):  # block 2's output gradient: before block 1's pre-backward
        with torch.cuda.stream(ag_stream):
            torch.cuda._sleep(200_000_000)

    def fail_after_prefetch(grad):  # block 1's output gradient: after its pre-backward prefetched block 0
        marks["gathered"] = ag_stream.record_event(torch.cuda.Event(enable_timing=True))
        raise _Boom("this step fails")

    def note_compute(module, args):  # after block 0's own pre-forward hook, which waits for what it needs
        marks.setdefault("computed", torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True)))

    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = batch(0, GLOBAL_BATCH, device=rank_device())
    pieces = list(zip(tokens.chunk(world)[rank].chunk(3), targets.chunk(world)[rank].chunk(3)))
    for i, (t, y) in enumerate(pieces[:2]):  # a step that fails in its second microbatch's backward
        with microbatch(model, is_first=i == 0, is_last=False):
            hooks = [model.blocks[2].register_forward_hook(on_output_grad(hold_back_gathers)),
                     model.blocks[1].register_forward_hook(on_output_grad(fail_after_prefetch))] if i == 1 else []
            try:
                lm_loss(model, t, y).backward()
            except _Boom:
                pass
            finally:
                for h in hooks:
                    h.remove()
    assert "gathered" in marks
    model.zero_grad()
    hook = model.blocks[0].register_forward_pre_hook(note_compute)
    for i, (t, y) in enumerate(pieces):  # the next step
        with microbatch(model, is_first=i == 0, is_last=i == 2):
            lm_loss(model, t, y).backward()
    hook.remove()
    torch.cuda.synchronize()
    after_ms = marks["gathered"].elapsed_time(marks["computed"])
    # Not ">= 0": the mark is queued behind the gather on the all-gather stream and lands a few microseconds after
    # the event the compute stream waits for. A forward that does not wait starts ~100 ms early (the hold-back).
    assert after_ms > -10.0, f"block 0 computed {-after_ms:.3f} ms before its gather finished"
    return {"block 0 computed after its gather by ms": after_ms}


def _case_freeze_after_fully_shard():
    """requires_grad_(False) after fully_shard: no gradient, the weights unchanged, the rest trains as in one
    process."""
    torch.manual_seed(31)
    model = TinyLM(tie=False)
    ref = copy.deepcopy(model).to(rank_device())
    shard_tiny_lm(model, fully_shard)
    for m in (model, ref):
        m.blocks[0].fc1.weight.requires_grad_(False)
        m.head.weight.requires_grad_(False)
    frozen_before = {n: p.full_tensor().clone() for n, p in model.named_parameters() if not p.requires_grad}
    losses, ref_losses = _plain_steps(model, sharded=True), _plain_steps(ref, sharded=False)
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, n
            assert torch.equal(p.full_tensor(), frozen_before[n]), n
    loss_err = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    param_err = _compare_params(model, ref)
    assert loss_err <= 1e-5 and param_err <= 1e-5, (loss_err, param_err)
    return {"loss_err": loss_err, "param_err": param_err}


def _plain_steps(model, sharded: bool, steps: int = 4, update=None) -> list[float]:
    """AdamW (or ``update(model)``) on the same global batches; a sharded model sees this rank's slice."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2) if update is None else None
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step, GLOBAL_BATCH, device=rank_device())
        loss = lm_loss(model, tokens.chunk(world)[rank], targets.chunk(world)[rank])
        loss.backward()
        if update is None:
            opt.step()
            opt.zero_grad()
        else:
            update(model)
        loss = loss.detach()
        if sharded:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


def _case_hand_written_update():
    """A hand-written SGD update (no torch.optim) under bf16 is seen by the next forward's cast: the same losses as
    torch.optim.SGD(foreach=False), which performs the same in-place update."""
    torch.manual_seed(32)
    base = TinyLM()
    by_hand = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=BF16)
    with_optim = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=BF16)

    @torch.no_grad()
    def sgd(model):
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.1)
            p.grad = None

    sgd_optim = torch.optim.SGD(with_optim.parameters(), lr=0.1, foreach=False)

    def optim_step(model):
        sgd_optim.step()
        sgd_optim.zero_grad()

    a = _plain_steps(by_hand, sharded=True, update=sgd)
    b = _plain_steps(with_optim, sharded=True, update=optim_step)
    assert a == b, (a, b)
    return {"losses": a}


def _case_evaluation_between_steps():
    """Forwards under no_grad / inference_mode / eval() between steps reduce nothing, leave every unit at rest,
    and training goes on with exactly the losses of a run without them."""
    from tests.runtime.test_strategies import count_collectives

    torch.manual_seed(33)
    base = TinyLM()
    evaluated = shard_tiny_lm(copy.deepcopy(base), fully_shard)
    plain = shard_tiny_lm(copy.deepcopy(base), fully_shard)
    tokens, _ = batch(99, GLOBAL_BATCH, device=rank_device())
    eval_counts = []

    def evaluate_then_update(model):
        opt_step(model)
        for mode in ("no_grad", "inference_mode", "eval"):
            ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
            with count_collectives() as counts, ctx:
                model.train(mode != "eval")
                model(tokens)
            model.train()
            eval_counts.append(dict(counts))
            for m in model.modules():
                unit = getattr(m, "_mfsdp_unit", None)
                if unit is not None:
                    assert all(g.unsharded.nbytes() == 0 for g in unit.groups), (mode, unit.name)
                    assert all(isinstance(p, DTensor) for p in m.parameters()), (mode, unit.name)

    opts = {}

    def opt_step(model):
        opt = opts.setdefault(id(model), torch.optim.AdamW(model.parameters(), lr=1e-2))
        opt.step()
        opt.zero_grad()

    a = _plain_steps(evaluated, sharded=True, update=evaluate_then_update)
    b = _plain_steps(plain, sharded=True, update=opt_step)
    assert a == b, (a, b)
    assert all(c.get("reduce_scatter_into", 0) == 0 and c.get("all_reduce", 0) == 0 for c in eval_counts), eval_counts
    return {"losses": a, "collectives per evaluation": eval_counts[:3]}


def _case_weights_swapped_through_data(policy: str):
    """EMA-style evaluation: after each step, evaluate, write half the weights through ``.data`` (no version
    counter sees it), evaluate again, write them back. Where a cast is reused (a kept compute-dtype copy, FP8
    scales) each evaluation forward must still see the weights as they are, and training must go on exactly as in
    a run that makes the same writes on the parameters themselves (which bump their version counters)."""
    from mfsdp_ext import Fp8Policy

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, cache_model_weight=True) if policy == "kept_bf16" else
          MixedPrecisionPolicy(param_dtype=torch.bfloat16, fp8=Fp8Policy(compute=False, modules=lambda fqn, m: True)))
    torch.manual_seed(35)
    base = TinyLM(dim=16, ffn=32)
    through_data = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=mp)
    in_place = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=mp)
    tokens, _ = batch(99, GLOBAL_BATCH, device=rank_device())
    evaluations = {id(through_data): [], id(in_place): []}
    opts = {}

    @torch.no_grad()
    def scale(model, factor: float) -> None:
        for p in model.parameters():
            (p.data if model is through_data else p).mul_(factor)  # powers of two: exact both ways

    def step_then_evaluate(model):
        opt = opts.setdefault(id(model), torch.optim.AdamW(model.parameters(), lr=1e-2))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            evaluations[id(model)].append(model(tokens)[0])
            scale(model, 0.5)
            evaluations[id(model)].append(model(tokens)[0])
            scale(model, 2.0)

    a = _plain_steps(through_data, sharded=True, update=step_then_evaluate)
    b = _plain_steps(in_place, sharded=True, update=step_then_evaluate)
    seen = [torch.equal(x, y) for x, y in zip(evaluations[id(through_data)], evaluations[id(in_place)])]
    assert all(seen), seen
    assert a == b, (a, b)
    # a model that only evaluates (a frozen teacher) keeps its cast: one for any number of forwards
    teacher = fully_shard(torch.nn.Linear(16, 16).requires_grad_(False), mp_policy=mp)
    with torch.no_grad():
        for _ in range(3):
            teacher(torch.randn(2, 16, device=rank_device(), dtype=torch.bfloat16))
    syncs = [g.stats.scale_syncs if g.fp8 else g.stats.weight_syncs for g in teacher._mfsdp_unit.groups
             if g.fp8 or g.cast.keep]  # (the others cast at every gather, as FSDP2)
    assert syncs and syncs == [1] * len(syncs), syncs
    return {"losses": a, "evaluations": len(seen), "teacher casts": syncs}


def _case_resting_memory_flat(steps: int = 50):
    """GPU: 50 steps with microbatches, an evaluation every 7th step and a failed step every 10th: the bytes
    allocated at rest after each completed step stay flat (no gathered buffer, gradient or event leaks)."""
    torch.manual_seed(34)
    model = shard_tiny_lm(TinyLM(vocab=512, dim=256, ffn=1024), fully_shard, mp_policy=BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    at_rest, after_eval = [], []
    for step in range(steps):
        tokens, targets = batch(step, GLOBAL_BATCH, vocab=512, device=rank_device())
        tokens, targets = tokens.chunk(world)[rank], targets.chunk(world)[rank]
        failed = False
        try:
            for i, (t, y) in enumerate(zip(tokens.chunk(3), targets.chunk(3))):
                with microbatch(model, is_first=i == 0, is_last=i == 2):
                    handle = _fail_in(model, "backward") if step % 10 == 9 and i == 1 else None
                    try:
                        (lm_loss(model, t, y) / 3).backward()
                    finally:
                        if handle is not None:
                            handle.remove()
            opt.step()
        except _Boom:
            failed = True  # its unreduced gradients are dropped at the next forward: measured after that step
        opt.zero_grad()
        if step % 7 == 6:
            with torch.no_grad():
                model(tokens)
        gc.collect()  # a failed step's traceback cycles hold tensors until the collector runs: garbage, not a leak
        torch.cuda.synchronize()
        if not failed:
            (after_eval if step % 7 == 6 else at_rest).append(torch.cuda.memory_allocated())
    settled = at_rest[2:]  # optimizer state exists from the first steps on
    assert max(settled) == min(settled), [b - settled[0] for b in settled]
    # zero_grad freed the gradient shards already: an evaluation's forward changes nothing
    assert max(after_eval) == min(after_eval) == min(settled), (after_eval, settled[0])
    return {"bytes at rest (first, last)": (at_rest[0], at_rest[-1]), "after an evaluation": after_eval[-1],
            "steps": steps}


def _case_bad_input_errors():
    """Inputs fully_shard cannot take are refused at once, with a message that says what to do."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    def refused(fn) -> str:
        with pytest.raises(ValueError) as err:
            fn()
        return str(err.value)

    msgs = {"sparse": refused(lambda: fully_shard(torch.nn.Embedding(10, 4, sparse=True)))}
    assert "sparse=False" in msgs["sparse"], msgs
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fsdp2_fully_shard(mixed[0])
    msgs["fsdp2_inside"] = refused(lambda: fully_shard(mixed))
    assert "FSDP2" in msgs["fsdp2_inside"] and "'0'" in msgs["fsdp2_inside"], msgs
    complex_param = torch.nn.Linear(4, 4)
    complex_param.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))
    msgs["complex"] = refused(lambda: fully_shard(complex_param))
    assert "non-floating dtype torch.complex64" in msgs["complex"], msgs
    return msgs


def _case_optimizer_built_before_fully_shard():
    """An optimizer built before fully_shard holds parameters the model no longer uses: its first step raises
    (torch's and ours), naming one; so does a step after add_param_group brings one in. One built after steps."""
    import mfsdp_ext.optim

    torch.manual_seed(3)
    model = TinyLM()
    stale = {"torch": torch.optim.AdamW(model.parameters()), "ours": mfsdp_ext.optim.AdamW(model.parameters())}
    stale_norm = model.norm.weight
    shard_tiny_lm(model, fully_shard)
    tokens, targets = batch(0, 4)
    lm_loss(model, tokens, targets).backward()
    msgs = {}
    for name, opt in stale.items():
        with pytest.raises(RuntimeError, match="before fully_shard") as err:
            opt.step()
        msgs[name] = str(err.value)
        assert "before fully_shard" in msgs[name] and "Build the optimizer after fully_shard" in msgs[name], msgs
    fresh = torch.optim.AdamW(model.parameters())
    trained = [p for p in model.parameters() if p.grad is not None]
    before = [p.detach().full_tensor().clone() for p in trained]
    fresh.step()  # checked once, then skipped while its parameter list stays the same
    fresh.step()
    assert trained and all(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, trained))
    fresh.add_param_group({"params": [stale_norm]})
    with pytest.raises(RuntimeError, match="before fully_shard"):
        fresh.step()
    # built on meta, sharded, optimizer made before to_empty: the meta parameters are replaced too
    with torch.device("meta"):
        meta_model = TinyLM()
    shard_tiny_lm(meta_model, fully_shard)
    early = torch.optim.AdamW(meta_model.parameters())
    meta_model.to_empty(device=rank_device())
    with pytest.raises(RuntimeError, match="on the meta device, before to_empty"):
        early.step()
    return msgs


def _case_grad_set_to_none_by_hand():
    """Accumulating over several backwards, one parameter's .grad set to None by hand in between: it starts
    afresh (as torch's accumulation into a None .grad), the others keep accumulating; as a single process."""
    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(rank_device())
    ref = copy.deepcopy(model)
    fully_shard(model[0])
    fully_shard(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    for k in range(3):
        x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(k)).to(rank_device())
        model(x[4 * rank:4 * (rank + 1)]).square().mean().backward()
        for r in range(world):
            (ref(x[4 * r:4 * (r + 1)]).square().mean() / world).backward()
        if k == 1:
            model[0].weight.grad = None
            ref[0].weight.grad = None
    errs = [rel_err(p.grad.full_tensor(), q.grad) for p, q in zip(model.parameters(), ref.parameters())]
    assert max(errs) <= 1e-5, errs
    return max(errs)


# ----------------------------------------------------------------------------------------------- pytest

@pytest.mark.parametrize("where,microbatches,strategy", [
    ("backward", 1, "optim_grads_params"), ("forward", 1, "optim_grads_params"),
    ("backward", 3, "optim_grads_params"), ("forward", 3, "optim_grads_params"), ("backward", 3, "optim")])
def test_failed_step_leaves_model_usable(cpu_pool, where, microbatches, strategy):
    print(cpu_pool.run(_case_failed_step, where, microbatches, strategy)[0])


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_gather_waited_after_failed_step(cpu_pool, strategy):
    print(cpu_pool.run(_case_gather_waited_after_failed_step, strategy)[0])


def test_freeze_after_fully_shard(cpu_pool):
    print(cpu_pool.run(_case_freeze_after_fully_shard)[0])


def test_hand_written_update_seen(cpu_pool):
    print(cpu_pool.run(_case_hand_written_update)[0])


def test_bad_input_errors(cpu_pool):
    print(cpu_pool.run(_case_bad_input_errors)[0])


def test_optimizer_built_before_fully_shard(cpu_pool):
    print(cpu_pool.run(_case_optimizer_built_before_fully_shard)[0])


def test_grad_set_to_none_by_hand(cpu_pool):
    print(cpu_pool.run(_case_grad_set_to_none_by_hand)[0])


@pytest.mark.parametrize("policy", ["kept_bf16", "fp8_weights"])
def test_weights_swapped_through_data(cpu_pool, policy):
    print(cpu_pool.run(_case_weights_swapped_through_data, policy)[0])


def test_evaluation_between_steps(cpu_pool):
    print(cpu_pool.run(_case_evaluation_between_steps)[0])


def test_parameters_on_another_device_refused():
    """The device check of fully_shard (no GPU here: the check on torch.device values, as fully_shard calls it)."""
    from types import SimpleNamespace

    from mfsdp_ext.sharding.params import check_devices, device_problem

    cpu, cuda0, cuda1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    for found in (torch.device("meta"), cpu, cuda0):
        assert device_problem("w", found, cuda0) is None, found  # taken (CPU rows are copied, as FSDP2 moves them)
    assert device_problem("w", cpu, cpu) is None and device_problem("w", torch.device("meta"), cpu) is None
    gloo = device_problem("blocks.0.w", cuda0, cpu)
    assert "'blocks.0.w' is on cuda:0 but the mesh's device is cpu" in gloo and "nccl" in gloo, gloo
    other_gpu = device_problem("w", cuda1, cuda0)
    assert "torch.cuda.set_device(local_rank)" in other_gpu, other_gpu
    other_kind = device_problem("w", torch.device("xpu", 0), cuda0)
    assert "build the model on the CPU, on meta" in other_kind, other_kind
    with pytest.raises(ValueError, match="set_device"):
        check_devices([("w", SimpleNamespace(device=cuda1), [])], cuda0)


# ----------------------------------------------------------------------------------------------- GPU (NCCL)
@pytest.mark.gpu
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_failed_step_recovery(where):
    print(get_pool(2, "nccl").run(_case_failed_step, where, 3, "optim_grads_params")[0])


@pytest.mark.gpu
def test_gather_in_flight_after_failed_step():
    print(get_pool(2, "nccl").run(_case_gather_in_flight_after_failed_step)[0])


@pytest.mark.gpu
def test_resting_memory_flat():
    print(get_pool(2, "nccl").run(_case_resting_memory_flat)[0])
