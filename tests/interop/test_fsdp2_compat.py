"""What code written for FSDP2 finds in mfsdp_ext's units: torch's FSDPModule and its methods, torch's policies,
FSDP2's list form as one unit, torch's register_fsdp_forward_method, and the switch (mfsdp_ext.use_as_fsdp2).

The ``_case_*`` functions run on every rank of a gloo pool (tests/dist_pool.py); FSDP2 runs beside ours in the
same processes where the numbers are compared.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

import mfsdp_ext
from mfsdp_ext import fully_shard
from mfsdp_ext.comm.policy import CommPolicy
from mfsdp_ext.testing.models import TinyLM, batch, rank_device, rel_err
from tests.test_fully_shard import ScoringLM

STEPS = 3
GLOBAL_BATCH = 8


def _shard(model: TinyLM, shard_fn, tail: list, blocks_reshard: bool = True, **kwargs) -> TinyLM:
    """torchtitan's wrapping: each block, the model's tail as one list unit, then the root. ``blocks_reshard=False``:
    the blocks keep their weights from forward to backward (torchtitan's blocks under pipeline parallel)."""
    for b in model.blocks:
        shard_fn(b, reshard_after_forward=blocks_reshard, **kwargs)
    shard_fn(tail, reshard_after_forward=False, **kwargs)
    shard_fn(model, **kwargs)
    return model


def _tail(model: TinyLM, tie: bool) -> list:
    return [model.emb, model.norm, model.head] if tie else [model.norm, model.head]


# ----------------------------------------------------------------------------------------------- the class
def _case_recognised_as_fsdp2():
    torch.manual_seed(1)
    model = TinyLM(tie=False).to(rank_device())
    tail = _tail(model, tie=False)
    assert _shard(model, fully_shard, tail) is model
    units = [model, *model.blocks, *tail]
    assert all(isinstance(m, TorchFSDPModule) and isinstance(m, mfsdp_ext.FsdpModule) for m in units)
    assert model.norm._mfsdp_unit is model.head._mfsdp_unit  # FSDP2's list form: one unit
    # every public method of torch's FSDPModule is mfsdp_ext's own (implemented, or refused by name)
    ours = [c for c in mfsdp_ext.FsdpModule.__mro__ if c.__module__.startswith("mfsdp_ext.")]
    inherited = [n for n, v in vars(TorchFSDPModule).items() if callable(v) and not n.startswith("__")
                 and not any(n in vars(c) for c in ours)]
    assert not inherited, inherited
    refused = {"set_all_reduce_hook": (lambda t: None,),
               "set_allocate_memory_from_process_group_for_comm": (True,), "_set_unshard_async_op": (True,)}
    for name, args in refused.items():
        with pytest.raises(NotImplementedError, match=f"FSDPModule.{name} is not supported"):
            getattr(model, name)(*args)
    with pytest.raises(TypeError, match="FSDP2's Comm interface"):
        model.set_custom_all_gather(None)
    with pytest.raises(AttributeError, match="has no FSDP2 state '_training_state'"):
        _ = model._get_fsdp_state()._training_state  # FSDP2's state: only what torch's own code reads exists
    # accepted with FSDP2's meaning (what they change is tested below and in test_fully_shard.py)
    model.set_is_last_backward(False)
    model.set_force_sum_reduction_for_comms(True)
    model.set_reduce_scatter_max_input_buffers(2)
    with pytest.raises(ValueError, match="positive int"):
        model.set_reduce_scatter_max_input_buffers(0)
    with pytest.raises(RuntimeError, match="set_symm_mem_for_comm: NCCL symmetric memory is unavailable"):
        model.blocks[0].set_symm_mem_for_comm()
    unit = model.blocks[1]._mfsdp_unit
    for name in ("copy_engine_all_gather", "copy_engine_reduce_scatter"):
        unit.set_comm_policy(CommPolicy(**{name: True}))  # as fully_shard(name=True) on GPUs
        with pytest.raises(ValueError, match=f"{name}=True; symmetric memory and the copy engines"):
            model.blocks[1].set_symm_mem_for_comm()
    unit.set_comm_policy(CommPolicy())
    # FSDPModule.__new__ rebuilds the original class (container slicing), as for FSDP2's units
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(rank_device())
    fully_shard(seq)
    assert type(seq[0:1]) is nn.Sequential
    return {"units": len(units)}


def _case_policies_and_keywords():
    """torch's MixedPrecisionPolicy maps onto ours exactly (the same bits); OffloadPolicy() is the default;
    what is not supported is refused by name."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import OffloadPolicy

    torch.manual_seed(2)
    base = TinyLM(tie=False).to(rank_device())
    ours = copy.deepcopy(base)
    theirs_policy = copy.deepcopy(base)
    kw = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _shard(ours, fully_shard, _tail(ours, False), mp_policy=mfsdp_ext.MixedPrecisionPolicy(**kw))
    _shard(theirs_policy, fully_shard, _tail(theirs_policy, False), mp_policy=TorchPolicy(**kw),
           offload_policy=OffloadPolicy())
    a, b = _train(ours), _train(theirs_policy)
    assert a == b, (a, b)
    for kwargs, match in ((dict(offload_policy="cpu"), "offload_policy must be"),
                          (dict(dp_mesh_dims=object()), "dp_mesh_dims"),
                          (dict(mp_policy="bf16"), "mp_policy must be")):
        with pytest.raises((ValueError, TypeError), match=match):
            fully_shard(nn.Linear(4, 4).to(rank_device()), **kwargs)
    return {"losses": a}


class ChunkableLM(TinyLM):
    """TinyLM whose forward stops after the final norm when ``chunked``, as torchtitan's model does under its chunked
    loss (the head then runs per chunk, outside the model's forward)."""

    chunked = False

    def forward(self, tokens):
        if not self.chunked:
            return super().forward(tokens)
        h = self.emb(tokens)
        for b in self.blocks:
            h = b(h)
        return self.norm(h)


def _train(model, steps: int = STEPS, head_chunks: int = 0) -> list[float]:
    """AdamW on this rank's slice of the global batches, gradients clipped; with ``head_chunks`` the loss is computed
    as torchtitan's ChunkedLossWrapper does it (see _chunked_loss_backward)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        tokens, targets = batch(step, GLOBAL_BATCH)
        tokens, targets = tokens.chunk(world)[rank], targets.chunk(world)[rank]
        if head_chunks:
            loss = _chunked_loss_backward(model, tokens, targets, head_chunks)
        else:
            logits, aux = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) + 0.1 * aux.float().square().mean()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _chunked_loss_backward(model: ChunkableLM, tokens, targets, chunks: int) -> torch.Tensor:
    """torchtitan 0.3.0's ChunkedLossWrapper on FSDP units: the model's forward stops before the head; the head runs
    per sequence chunk on a detached copy, each chunk with a backward of its own, the head's reduction deferred to
    the last chunk and its weights kept gathered through them (found by isinstance(head, FSDPModule)); then one
    backward of the accumulated gradient through the rest of the model. A sum loss, unscaled gradients."""
    model.chunked = True
    try:
        h = model(tokens)
    finally:
        model.chunked = False
    head = model.head
    assert isinstance(head, TorchFSDPModule)
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    head.unshard()
    total, grads = torch.zeros((), device=h.device), []
    for i, (h_chunk, y_chunk) in enumerate(zip(h.detach().chunk(chunks, dim=1), targets.chunk(chunks, dim=1))):
        h_chunk.requires_grad_(True)
        if i == chunks - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        loss = F.cross_entropy(head(h_chunk).flatten(0, 1).float(), y_chunk.flatten(), reduction="sum")
        loss.backward()
        grads.append(h_chunk.grad)
        total += loss.detach()
    head.set_reshard_after_forward(True)
    head.set_reshard_after_backward(True)
    head.reshard()
    h.backward(torch.cat(grads, dim=1))
    return total


def _case_list_unit_vs_fsdp2(tie: bool, chunks: int, blocks_reshard: bool = True):
    """The list form as torchtitan uses it (the tail [norm, head], or [emb, norm, head] with tied embeddings):
    one unit, trained to FSDP2's numbers; with ``chunks``, torchtitan's chunked loss with its gradient division
    turned off through the FSDPModule check (set_gradient_divide_factor(1.0) on every FSDPModule). With
    ``blocks_reshard=False`` (torchtitan's blocks under pipeline parallel) the head's per-chunk backwards leave the
    blocks gathered for the backward of the rest, as FSDP2's do: the same gathers in all as FSDP2's."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp2_group
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    torch.manual_seed(3)
    base = ChunkableLM(tie=tie).to(rank_device())
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    _shard(ours, fully_shard, _tail(ours, tie), blocks_reshard)
    _shard(theirs, fsdp2_fully_shard, _tail(theirs, tie), blocks_reshard)
    for model in (ours, theirs):
        for m in model.modules():
            if chunks and isinstance(m, TorchFSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # FSDP2 on gloo: no PREMUL_SUM
    if chunks:  # the aux head is unused under the chunked loss: FSDP2 leaves it without a gradient, ours gives zeros
        ours.set_reduce_scatter_unused_params(False)  # unless told (docs/limits.md), as here
    groups = ours.head._mfsdp_unit.groups
    gathers_before = sum(g.stats.all_gathers for g in groups)
    reduces_before = sum(g.stats.reduces for g in groups)
    our_losses = _train(ours, head_chunks=chunks)
    all_groups = [g for u in ours._mfsdp_unit.context.units for g in u.groups]
    our_gathers = sum(g.stats.all_gathers for g in all_groups)
    their_gathers, fsdp2_gather = [0], fsdp2_group.foreach_all_gather

    def counted_gather(*args, **kwargs):
        their_gathers[0] += 1
        return fsdp2_gather(*args, **kwargs)

    fsdp2_group.foreach_all_gather = counted_gather
    try:
        their_losses = _train(theirs, head_chunks=chunks)
    finally:
        fsdp2_group.foreach_all_gather = fsdp2_gather
    # tied: one gather more per step than FSDP2, the embedding's own in its backward (below)
    assert our_gathers == their_gathers[0] + (STEPS if tie else 0), (our_gathers, their_gathers[0])
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(our_losses, their_losses))
    ours_p, theirs_p = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert ours_p.keys() == theirs_p.keys()
    param_err = max(rel_err(ours_p[k].full_tensor(), theirs_p[k].full_tensor()) for k in ours_p)
    assert loss_err <= 1e-6 and param_err <= 1e-6, (loss_err, param_err, our_losses, their_losses)
    # The tail unit, per step: gathered at its first module and kept into backward (reshard_after_forward=False),
    # reduced when its backward ends. A tied embedding's backward comes after the blocks': gathered and reduced once
    # more for it. Chunked: the head's reduction once, at the last chunk; the norm's in the backward of the rest.
    gathers = (sum(g.stats.all_gathers for g in groups) - gathers_before) / STEPS
    reduces = (sum(g.stats.reduces for g in groups) - reduces_before) / STEPS
    assert (gathers, reduces) == (1, 1) if not (tie or chunks) else (2, 2), (gathers, reduces)
    return {"loss_err": loss_err, "param_err": param_err, "tail_gathers": gathers, "tail_reduces": reduces,
            "gathers": our_gathers}


def _case_torch_register_forward_method():
    """torch's own register_fsdp_forward_method, as the HF Trainer calls it for generate(), on our units."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    torch.manual_seed(5)
    model = ScoringLM(tie=False).to(rank_device())
    ref = copy.deepcopy(model)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    register_fsdp_forward_method(model, "score")
    tokens, targets = batch(0, 4)
    ours, theirs = model.score(tokens, targets), ref.score(tokens, targets)
    assert rel_err(ours.detach(), theirs.detach()) <= 1e-6, (ours, theirs)
    (-ours).backward()
    (-theirs).backward()
    err = max(rel_err(p.grad.full_tensor(), dict(ref.named_parameters())[n].grad) for n, p in model.named_parameters())
    assert err <= 1e-5, err
    assert model._mfsdp_unit.forward_method_depth == 0
    return {"grad_err": err}


def _case_lifecycle_controls():
    """reset_iter_state() after a failed forward, and set_post_optim_event: the next step trains as usual."""
    torch.manual_seed(6)
    model = TinyLM(tie=False).to(rank_device())
    _shard(model, fully_shard, _tail(model, False))
    tokens, targets = batch(0, 4)
    model(tokens)[0].sum().backward()
    with pytest.raises(RuntimeError, match="root module"):
        model.blocks[0].reset_iter_state()
    logits, _ = model(tokens)  # a forward whose backward never comes: reset by hand, as FSDP2 asks
    model.reset_iter_state()
    assert not model._mfsdp_unit.context.iteration.open
    if rank_device().type == "cuda":
        model.set_post_optim_event(torch.cuda.current_stream().record_event())
    model(tokens)[0].sum().backward()
    return {"ok": True}


# ----------------------------------------------------------------------------------------------- the switch
def test_use_as_fsdp2_switches_and_restores():
    from torch.distributed import fsdp as torch_fsdp
    from torch.distributed._composable import fsdp as composable_fsdp
    from torch.distributed.fsdp._fully_shard import _fully_shard as torch_impl

    framework = types.ModuleType("a_framework")  # a module that bound FSDP2's names when it was imported
    framework.fully_shard, framework.forward_method = torch_impl.fully_shard, torch_impl.register_fsdp_forward_method
    sys.modules["a_framework"] = framework
    try:
        with mfsdp_ext.use_as_fsdp2() as switch:
            assert torch_fsdp.fully_shard is mfsdp_ext.fully_shard
            assert composable_fsdp.fully_shard is mfsdp_ext.fully_shard
            assert torch_fsdp.register_fsdp_forward_method is mfsdp_ext.register_fsdp_forward_method
            assert framework.fully_shard is mfsdp_ext.fully_shard
            assert framework.forward_method is mfsdp_ext.register_fsdp_forward_method
            assert torch_impl.fully_shard is not mfsdp_ext.fully_shard  # FSDP2's own module keeps FSDP2
            from torch.distributed.fsdp import fully_shard as imported_after
            assert imported_after is mfsdp_ext.fully_shard
            assert "a_framework.fully_shard" in switch.names
        assert torch_fsdp.fully_shard is torch_impl.fully_shard
        assert framework.fully_shard is torch_impl.fully_shard
    finally:
        del sys.modules["a_framework"]


def test_as_fsdp2_runs_a_module(tmp_path):
    (tmp_path / "uses_fsdp2.py").write_text(textwrap.dedent("""
        import sys
        from torch.distributed.fsdp import fully_shard
        import mfsdp_ext
        assert __name__ == "__main__" and sys.argv[1:] == ["--flag", "x"], (__name__, sys.argv)
        print("switched" if fully_shard is mfsdp_ext.fully_shard else "not switched")
    """))
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mfsdp_ext.__file__)))  # the package tested here
    out = subprocess.run([sys.executable, "-m", "mfsdp_ext.as_fsdp2", "uses_fsdp2", "--flag", "x"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), package_root])})
    assert out.returncode == 0 and out.stdout.strip() == "switched", (out.stdout, out.stderr)


def test_as_fsdp2_runs_a_script(tmp_path):
    """``python -m mfsdp_ext.as_fsdp2 path/to/SCRIPT.py ARGS`` runs the file as ``python SCRIPT.py`` would: as
    __main__, its arguments in sys.argv, its folder first on sys.path (the sibling module imports; the working
    directory is elsewhere), FSDP2's fully_shard switched."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "sibling.py").write_text("WHERE = 'beside the script'\n")
    (job / "train.py").write_text(textwrap.dedent("""
        import sys
        from torch.distributed.fsdp import fully_shard
        import mfsdp_ext
        import sibling
        assert __name__ == "__main__" and sys.argv[1:] == ["--flag", "x"], (__name__, sys.argv)
        print(sibling.WHERE, "switched" if fully_shard is mfsdp_ext.fully_shard else "not switched")
    """))
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mfsdp_ext.__file__)))  # the package tested here
    out = subprocess.run([sys.executable, "-m", "mfsdp_ext.as_fsdp2", os.path.join("job", "train.py"), "--flag", "x"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": package_root})
    assert out.returncode == 0 and out.stdout.strip() == "beside the script switched", (out.stdout, out.stderr)


# ----------------------------------------------------------------------------------------------- pytest
def test_recognised_as_fsdp2(cpu_pool):
    print(cpu_pool.run(_case_recognised_as_fsdp2)[0])


def test_policies_and_keywords(cpu_pool):
    print(cpu_pool.run(_case_policies_and_keywords)[0])


@pytest.mark.parametrize("tie,chunks,blocks_reshard", [(False, 0, True), (True, 0, True), (False, 3, True),
                                                       (False, 3, False)],
                         ids=["tail", "tied", "chunked", "chunked_blocks_kept"])
def test_list_unit_vs_fsdp2(cpu_pool, tie, chunks, blocks_reshard):
    print(cpu_pool.run(_case_list_unit_vs_fsdp2, tie, chunks, blocks_reshard)[0])


def test_torch_register_forward_method(cpu_pool):
    print(cpu_pool.run(_case_torch_register_forward_method)[0])


def test_lifecycle_controls(cpu_pool):
    print(cpu_pool.run(_case_lifecycle_controls)[0])
