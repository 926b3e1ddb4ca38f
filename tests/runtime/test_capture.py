"""CUDA graph capture of forward and backward (mfsdp_ext/capture.py): what the CPU can show.

A CPU cannot capture, so these cases make the root see a capture (DeviceHandle.capturing answers True and
DeviceHandle.capture_id names the capture) and check the decisions taken there: the refusals of what waits on the
host, the state every replay starts from, and the guard on the gradients a graph writes. Capture and replay
themselves, bit for bit against eager steps, are GPU tests (test_captured_forward_backward at the end,
scripts/graph_probe.py).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

from mfsdp_ext import MixedPrecisionPolicy, fully_shard, microbatch
from mfsdp_ext.core.device import DeviceHandle
from mfsdp_ext.runtime.capture import CaptureError
from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, rank_device, shard_tiny_lm


@contextlib.contextmanager
def _seen_as_capturing(capture_id: int = 1):
    original = DeviceHandle.capturing, DeviceHandle.capture_id
    DeviceHandle.capturing = lambda self: True
    DeviceHandle.capture_id = lambda self: capture_id
    try:
        yield
    finally:
        DeviceHandle.capturing, DeviceHandle.capture_id = original


def _model(**kwargs) -> TinyLM:
    torch.manual_seed(3)
    return shard_tiny_lm(TinyLM(tie=False).to(rank_device()), fully_shard, **kwargs)


def _step(model, opt=None, set_to_none=True):
    tokens, targets = batch(0, 2 * dist.get_world_size())
    lm_loss(model, tokens, targets).backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


def _case_refusals():
    """What waits on the host is refused at the capture's first forward, naming it; nothing was changed."""
    messages = {}
    model = _model()
    _step(model)  # lazy init, eagerly
    model.set_reduce_scatter_unused_params(False)
    tokens, _ = batch(0, 2)
    with _seen_as_capturing(), pytest.raises(CaptureError, match="set_reduce_scatter_unused_params") as err:
        model(tokens)
    messages["unused"] = str(err.value)
    model.set_reduce_scatter_unused_params(True)
    with _seen_as_capturing(), microbatch(model, is_first=False, is_last=False), \
            pytest.raises(CaptureError, match="is_first=False") as err:
        model(tokens)
    messages["microbatch"] = str(err.value)
    checked = _model(check_finite_grads=True)
    _step(checked)
    with _seen_as_capturing(), pytest.raises(CaptureError, match="check_finite_grads") as err:
        checked(tokens)
    messages["finite"] = str(err.value)
    return messages


def _case_capture_starts_from_rest():
    """At the capture's first forward every unit is resharded (no gather of before the capture is waited for),
    a new weights epoch makes every cast and gather part of the graph, and the optimizer stops gathering ahead
    (the replay gathers by itself)."""
    model = _model()
    opt = __import__("mfsdp_ext").optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt)  # the step gathers the next forward's first units ahead (step_prefetch)
    ctx = model._mfsdp_unit.context
    gathered_ahead = [u.name for u in ctx.units if u.unshard_event is not None or u.sharded_state.name == "UNSHARDED"]
    epoch = ctx.iteration.weights_epoch
    tokens, targets = batch(1, 2)
    with _seen_as_capturing():
        lm_loss(model, tokens, targets).backward()
    assert ctx.capture.graphed and ctx.capture.capturing and ctx.iteration.weights_epoch == epoch + 1
    opt.step()  # no gathers issued ahead once graphed
    assert all(u.sharded_state.name == "SHARDED" for u in ctx.units)
    model(tokens)  # the first forward outside the capture leaves it
    assert not ctx.capture.capturing and ctx.capture.graphed
    return {"gathered_ahead_before": gathered_ahead}


def _case_capture_after_capture():
    """A second capture right after the first, with only replays (and eager optimizer steps) between them, also
    starts from rest: the root tells captures apart by their CUDA ids, not by whether one is under way."""
    model = _model()
    opt = __import__("mfsdp_ext").optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt)
    ctx = model._mfsdp_unit.context
    tokens, targets = batch(1, 2)
    with _seen_as_capturing(capture_id=7):
        lm_loss(model, tokens, targets).backward()
        epoch = ctx.iteration.weights_epoch
        lm_loss(model, tokens, targets).backward()  # the same capture: one more microbatch in it, nothing reset
    assert ctx.iteration.weights_epoch == epoch and ctx.capture.id == 7
    opt.step()  # as after a replay
    with _seen_as_capturing(capture_id=8):
        model(tokens)
        assert ctx.capture.id == 8 and ctx.iteration.weights_epoch == epoch + 1  # every cast and gather captured again
    return {"epochs": [epoch, ctx.iteration.weights_epoch]}


def test_capture_after_capture(cpu_pool):
    print(cpu_pool.run(_case_capture_after_capture)[0])


def _case_graph_gradients_guarded():
    """The gradients a graph writes are kept by their groups; a step after zero_grad(set_to_none=True) dropped
    their .grad views raises instead of silently skipping them; zero_grad(set_to_none=False) keeps training."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model)  # gradients from before the capture: the graph would accumulate into them
    for m in model.modules():
        for g in getattr(getattr(m, "_mfsdp_unit", None), "groups", []):
            g.grads.keep_for_graph()
    opt.step()
    opt.zero_grad(set_to_none=False)  # the graph overwrites them: fine
    _step(model)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="no longer its .grad"):
        opt.step()
    return {"ok": True}


def test_refusals(cpu_pool):
    print(cpu_pool.run(_case_refusals)[0])


def test_capture_starts_from_rest(cpu_pool):
    print(cpu_pool.run(_case_capture_starts_from_rest)[0])


def test_graph_gradients_guarded(cpu_pool):
    print(cpu_pool.run(_case_graph_gradients_guarded)[0])


# ----------------------------------------------------------------------------------------------- GPU: captured
def _accumulate(model, tokens, targets, microbatches: int) -> torch.Tensor:
    """Forward and backward of ``microbatches`` slices (microbatch API); the summed loss."""
    total = torch.zeros((), device=tokens.device)
    for i, (t, y) in enumerate(zip(tokens.chunk(microbatches), targets.chunk(microbatches))):
        with microbatch(model, is_first=i == 0, is_last=i == microbatches - 1):
            loss = lm_loss(model, t, y) / microbatches
            loss.backward()
        total += loss.detach()
    return total


def _case_captured_forward_backward(fp8: bool, microbatches: int, grads_made_in_capture: bool):
    """torchtitan's recipe: torch.cuda.graph around forward, loss and backward (microbatches inside), the optimizer
    eager; 5 replays, then a second capture with no eager step before it and 3 replays of it, equal 8 eager steps
    of a twin bit for bit (losses and fp32 shards). bf16 or FP8 weights. The gradients exist before the first
    capture (warm-up's zero_grad(set_to_none=False)), or the capture makes them (set_to_none=True: they then live
    in the graph's pool)."""
    import mfsdp_ext

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  fp8=mfsdp_ext.Fp8Policy() if fp8 else None)
    torch.manual_seed(11)
    base = TinyLM(vocab=64, dim=64, ffn=128, n_layers=3, tie=False).to(rank_device())
    graphed, twin = copy.deepcopy(base), copy.deepcopy(base)
    for m in (graphed, twin):
        shard_tiny_lm(m, fully_shard, mp_policy=policy)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (graphed, twin)]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def fwd_bwd(model, tokens, targets):
        return _accumulate(model, tokens, targets, microbatches)

    def data(step):
        tokens, targets = batch(step, 32 * world, seq=16, vocab=64)
        return tokens.chunk(world)[rank], targets.chunk(world)[rank]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step in range(2):  # eager warm-up of both, the same steps
            for model, opt in zip((graphed, twin), opts):
                fwd_bwd(model, *data(step))
                opt.step()
                opt.zero_grad(set_to_none=grads_made_in_capture)
    torch.cuda.current_stream().wait_stream(stream)
    static_tokens, static_targets = (t.clone() for t in data(2))
    ours, theirs = [], []
    for first, last in ((2, 7), (7, 10)):  # the second capture right after the first one's replays
        grads_before = [p.grad for p in graphed.parameters()]
        assert all((g is None) == (grads_made_in_capture and first == 2) for g in grads_before)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = fwd_bwd(graphed, static_tokens, static_targets)
        # the capture made the gradients, or wrote into the ones it found
        assert all(p.grad is not None and (g is None or p.grad is g)
                   for p, g in zip(graphed.parameters(), grads_before))
        for step in range(first, last):
            tokens, targets = data(step)
            static_tokens.copy_(tokens)
            static_targets.copy_(targets)
            graph.replay()
            ours.append(static_loss.item())
            theirs.append(fwd_bwd(twin, tokens, targets).item())
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=False)
    assert ours == theirs, (ours, theirs)
    for (name, p), q in zip(graphed.named_parameters(), twin.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), name
    return {"losses": ours}


@pytest.mark.gpu
@pytest.mark.parametrize("fp8,microbatches,grads_made_in_capture",
                         [(False, 1, False), (False, 2, True), (True, 2, True)],
                         ids=["bf16", "bf16-mb2-fresh-grads", "fp8-mb2-fresh-grads"])
def test_captured_forward_backward(gpu_pool_from_one, fp8, microbatches, grads_made_in_capture):
    print(gpu_pool_from_one.run(_case_captured_forward_backward, fp8, microbatches, grads_made_in_capture)[0])
