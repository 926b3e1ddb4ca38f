"""The parity cases on 2 and 4 GPUs with NCCL, plus what only a GPU shows: overlap and peak memory.

Run on a GPU machine: ``pytest -m gpu tests/test_gpu.py`` (spawns one process per GPU itself).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from mfsdp_ext import MixedPrecisionPolicy, fully_shard, microbatch
from mfsdp_ext.interop.checkpoint import full_state_dict

from tests.interop import test_checkpoint as ck
from tests.sharding import test_no_shard as ns
from tests.comm import test_reduce_comm_dtype as rcd
from tests import test_robustness as rb
from tests import test_fully_shard as fs
from tests.runtime import test_strategies as st
from tests.conftest import get_pool
from mfsdp_ext.testing.models import (Block, TinyLM, batch, lm_loss, lm_train_step, rank_device, rel_err,
                                      run_profiled, shard_tiny_lm, train)

pytestmark = pytest.mark.gpu
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def test_fp32_parity(gpu_pool):
    print(gpu_pool.run(fs._case_fp32_parity)[0])


def test_grad_accumulation(gpu_pool):
    print(gpu_pool.run(fs._case_grad_accumulation, 3)[0])


def test_frozen_params(gpu_pool):
    print(gpu_pool.run(fs._case_frozen_params)[0])


def test_parameterless_parent(gpu_pool):
    print(gpu_pool.run(fs._case_parameterless_parent)[0])


def test_unsharded_storage_released(gpu_pool):
    print(gpu_pool.run(fs._case_unsharded_storage_released)[0])


def test_main_grad_released_after_zero_grad(gpu_pool):
    print(gpu_pool.run(fs._case_main_grad_released_after_zero_grad)[0])


def test_meta_init(gpu_pool):
    print(gpu_pool.run(fs._case_meta_init)[0])


def test_bf16_no_worse_than_fsdp2(gpu_pool):
    print(gpu_pool.run(fs._case_bf16_vs_fsdp2)[0])


def test_strategy_matrix(gpu_pool):
    for line in gpu_pool.run(st._case_strategy_matrix)[0].items():
        print(*line)


def test_weight_sync_once_per_step(gpu_pool):
    print(gpu_pool.run(st._case_weight_sync_once_per_step, False)[0])


def test_hsdp_2x2():
    print(get_pool(4, "nccl").run(st._case_hsdp, 3)[0])


# ----------------------------------------------------------------------------------------------- overlap
def _stack(n_blocks: int, dim: int, ffn: int, **shard_kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(dim, ffn) for _ in range(n_blocks)])
    for b in model:
        fully_shard(b, mp_policy=BF16, **shard_kwargs)
    return fully_shard(model, mp_policy=BF16, **shard_kwargs)


def _overlapping(kind: str, kernels) -> tuple[int, int]:
    """(number of `kind` NCCL kernels, how many of them overlap a GEMM kernel in time)."""
    gemm = [(s, e) for n, s, e in kernels if any(k in n.lower() for k in ("gemm", "nvjet", "xmma", "cutlass"))]
    comm = [(s, e) for n, s, e in kernels if kind in n]
    hits = sum(1 for cs, ce in comm if any(min(ce, ge) > max(cs, gs) for gs, ge in gemm))
    return len(comm), hits


def _timeline(kernels, limit: int = 60) -> list[str]:
    """Kernels in start order, as 'start_us +dur name' relative to the first: for reading a failure."""
    kernels = sorted(kernels, key=lambda k: k[1])
    t0 = kernels[0][1] if kernels else 0
    return [f"{(s - t0):9.1f} +{(e - s):7.1f} {n[:60]}" for n, s, e in kernels[:limit]]


def _case_overlap(n_blocks: int):
    dev = rank_device()
    # Blocks large enough that each all-gather (~1 ms on 2 H200) outlasts the host's gap between issuing the
    # prefetch and the next GEMM (~0.45 ms under the profiler on a slow host): at dim 4096 / ffn 8192 a 2-GPU gather
    # took 0.27 ms and could end before Python launched the GEMM it was meant to hide behind.
    dim = 8192
    model = _stack(n_blocks, dim, 2 * dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(2, 1024, dim, device=dev)
    for _ in range(2):  # the first iteration records the execution order that prefetching follows
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    loss, fwd_kernels = run_profiled(lambda: model(x).float().square().mean())
    _, bwd_kernels = run_profiled(loss.backward)
    fwd_ag, fwd_ag_overlap = _overlapping("AllGather", fwd_kernels)
    bwd_rs, bwd_rs_overlap = _overlapping("ReduceScatter", bwd_kernels)
    result = {"forward_all_gathers": fwd_ag, "overlapping_gemm": fwd_ag_overlap,
              "backward_reduce_scatters": bwd_rs, "rs_overlapping_gemm": bwd_rs_overlap,
              "forward_timeline": _timeline(fwd_kernels)}
    print({k: v for k, v in result.items() if k != "forward_timeline"}, flush=True)
    assert fwd_ag == n_blocks and fwd_ag_overlap >= n_blocks - 1, result
    assert bwd_rs == n_blocks and bwd_rs_overlap >= n_blocks - 1, result
    return result


def test_overlap_profile(gpu_pool):
    print(gpu_pool.run(_case_overlap, 6)[0])


# ----------------------------------------------------------------------------------------------- memory
FORWARD_BOUND_UNITS = 3  # the unit computing, the one prefetched, one freed in stream order
BACKWARD_BOUND_UNITS = 6  # gathered + prefetched units, this unit's grads, the pending reduction's buffers


def _case_peak_memory():
    dev = rank_device()
    n_blocks, dim = 6, 4096
    model = _stack(n_blocks, dim, dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(1, 16, dim, device=dev)  # tiny activations: the gathered weights dominate
    for _ in range(2):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    unit = model[0]._mfsdp_unit.groups[0].layout.total_numel * 2  # bf16 gathered bytes of one block
    slack = 16 << 20
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = model(x).float().square().mean()
    torch.cuda.synchronize()
    fwd = torch.cuda.max_memory_allocated() - base
    base_bwd = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    bwd = torch.cuda.max_memory_allocated() - base_bwd
    # The gradient shards the backward creates are its result, not its working set: zero_grad let the last ones
    # go (as FSDP2 frees its sharded grads), so each unit's reduction allocates its shard again.
    grads = sum(g.grads.main_grad.data.untyped_storage().nbytes() for m in model.modules() if hasattr(m, "_mfsdp_unit")
                for g in m._mfsdp_unit.groups if g.grads.main_grad is not None)
    result = {"unit_MiB": unit / 2**20, "forward_peak_units": fwd / unit, "backward_peak_units": bwd / unit,
              "gradient_shard_units": grads / unit}
    assert fwd <= FORWARD_BOUND_UNITS * unit + slack, result
    assert bwd - grads <= BACKWARD_BOUND_UNITS * unit + slack, result
    return result


def test_peak_memory_bound(gpu_pool):
    print(gpu_pool.run(_case_peak_memory)[0])


# ----------------------------------------------------------------------------------------------- symmetric memory
def _train_side_by_side(seed: int, mp, k: int, global_batch: int, reference: dict | None = None, **shard_kwargs):
    """A TinyLM sharded with the default collectives (or the keywords ``reference``) and one sharded with
    ``shard_kwargs``, trained alike for 5 steps: (plain, other, max relative loss difference, max relative parameter
    difference, losses, losses)."""
    torch.manual_seed(seed)
    base = TinyLM(vocab=512, dim=256, ffn=1024)
    plain = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=mp, **(reference or {}))
    other = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=mp, **shard_kwargs)
    a = train(plain, 5, global_batch, sharded=True, microbatches=k, microbatch_ctx=microbatch)
    b = train(other, 5, global_batch, sharded=True, microbatches=k, microbatch_ctx=microbatch)
    loss_err = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    pa, pb = full_state_dict(plain), full_state_dict(other)
    return plain, other, loss_err, max(rel_err(pb[n], pa[n]) for n in pa), a, b


def _case_symm_parity(bf16: bool, k: int):
    mp = BF16 if bf16 else MixedPrecisionPolicy()
    _, symm, loss_err, param_err, a, b = _train_side_by_side(20, mp, k, 24, use_symm_mem=True)
    print(f"symm parity bf16={bf16} k={k}: loss_err {loss_err:.2e} param_err {param_err:.2e}", flush=True)
    if bf16:  # different reduction order in bf16: losses agree to bf16 precision (params drift under AdamW)
        assert loss_err <= 2e-2, (loss_err, a, b)
    else:
        assert loss_err <= 1e-6 and param_err <= 1e-5, (loss_err, param_err, a, b)
    assert symm._mfsdp_unit.context.comm.symmetric is not None
    symm.release_symmetric_memory()  # collective: the ranks free the NCCL communicator together
    assert symm._mfsdp_unit.context.comm.symmetric is None
    return {"loss_err": loss_err, "param_err": param_err}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_symm_mem_parity(gpu_pool, bf16, k):
    print(gpu_pool.run(_case_symm_parity, bf16, k)[0])


def _case_symm_auto(native: bool):
    """use_symm_mem="auto": every rank decides alike, only the stages in use are allocated, same losses; with
    native_collectives, the groups that keep the plain path keep the native one."""
    import torch.distributed as dist

    torch.manual_seed(21)
    base = TinyLM(vocab=512, dim=512, ffn=4096)  # blocks of ~5M parameters: both outcomes are plausible
    plain = shard_tiny_lm(copy.deepcopy(base), fully_shard)
    auto = shard_tiny_lm(copy.deepcopy(base), fully_shard, use_symm_mem="auto", native_collectives=native)
    a = train(plain, 3, 24, sharded=True)
    b = train(auto, 3, 24, sharded=True)
    ctx = auto._mfsdp_unit.context
    chosen = [(g.collectives.all_gather.name == "symmetric", g.collectives.reduce_scatter.name == "symmetric")
              for u in ctx.units for g in u.groups]
    others = {op.name for u in ctx.units for g in u.groups for op in (g.collectives.all_gather, g.collectives.reduce_scatter)
              if op.name != "symmetric"}
    assert others <= {"native" if native else "plain"}, others
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, chosen)
    assert all(c == chosen for c in everyone), everyone
    symmetric = ctx.comm.symmetric
    uses_ag, uses_rs = any(ag for ag, _ in chosen), any(rs for _, rs in chosen)
    if symmetric is None:
        assert not (uses_ag or uses_rs), chosen
    else:  # a stage exists exactly when some group uses it
        assert (symmetric.ag_stage is not None, symmetric.rs_stage is not None) == (uses_ag, uses_rs), chosen
    loss_err = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    assert loss_err <= 1e-6, (loss_err, a, b)
    pool = 0 if symmetric is None else symmetric.comm.native.capacity
    auto.release_symmetric_memory()
    return {"chosen (all_gather, reduce_scatter) per group": chosen, "pool_MiB": pool / 2**20, "loss_err": loss_err}


@pytest.mark.parametrize("native", [False, True], ids=["plain", "native"])
def test_symm_mem_auto(gpu_pool, native):
    print(gpu_pool.run(_case_symm_auto, native)[0])


# ----------------------------------------------------------------------------------------------- native collectives
def _case_shard_dim1(mode: str):
    """shard_placement_fn answering Shard(1) for every matrix, with each collective path (the plain grouped
    all-gather into the staging area, the native transport, symmetric memory's rank-major gather unpacked by column
    runs; a bf16 compute copy): the numbers of the default Shard(0) model on the same path (fp32: each path sums
    the ranks' gradients in its own order)."""
    from torch.distributed.tensor import Shard

    kwargs = {"plain": {}, "native": dict(native_collectives=True), "symm": dict(use_symm_mem=True)}.get(mode, {})
    mp = BF16 if mode == "bf16" else MixedPrecisionPolicy()
    rows, columns, loss_err, param_err, a, b = _train_side_by_side(
        23, mp, 3, 24, reference=kwargs, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None, **kwargs)
    assert columns.emb.weight.placements == (Shard(1),), columns.emb.weight.placements
    if mode == "bf16":  # the same bf16 casts of the same weights; sums in another order
        assert loss_err <= 2e-2, (loss_err, a, b)
    else:
        assert loss_err <= 1e-6 and param_err <= 1e-5, (loss_err, param_err, a, b)
    if mode == "symm":
        columns.release_symmetric_memory()
        rows.release_symmetric_memory()
    return {"loss_err": loss_err, "param_err": param_err}


@pytest.mark.parametrize("mode", ["plain", "native", "symm", "bf16"])
def test_shard_dim1(gpu_pool, mode):
    print(gpu_pool.run(_case_shard_dim1, mode)[0])


def test_shard_dim1_strategies():
    print(get_pool(4, "nccl").run(st._case_shard_dim1)[0])


def _pg_collectives_in_backward(model) -> list[str]:
    """The ProcessGroupNCCL collectives (c10d:: ops) one forward + backward of ``model`` calls."""
    from torch.profiler import ProfilerActivity, profile

    tokens, targets = batch(0, 48, device=rank_device())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        lm_loss(model, tokens, targets).backward()
        torch.cuda.synchronize()
    model.zero_grad()
    return [e.name for e in prof.events() if e.name.startswith("c10d::")]


def _case_native_collectives(mode: str, k: int):
    """native_collectives=True trains as the torch.distributed path does (fp32: to 1e-6), every sharded group
    uses the native transport, and a forward + backward calls no ProcessGroupNCCL collective."""
    from mfsdp_ext import Fp8Policy

    mp = {"fp32": MixedPrecisionPolicy(), "bf16": BF16,
          "fp8": MixedPrecisionPolicy(param_dtype=torch.bfloat16, fp8=Fp8Policy(compute=True))}[mode]
    # 48 sequences of 6 tokens: every microbatch's GEMMs have M a multiple of 16 (FP8)
    plain, native, loss_err, param_err, a, b = _train_side_by_side(22, mp, k, 48, native_collectives=True)
    groups = [g for u in native._mfsdp_unit.context.units for g in u.groups if g.world > 1]
    assert groups and all(g.collectives.all_gather.name == g.collectives.reduce_scatter.name == "native" for g in groups)
    assert mode != "fp8" or any(g.fp8 for g in groups)
    pg_plain, pg_native = _pg_collectives_in_backward(plain), _pg_collectives_in_backward(native)
    assert pg_plain and not pg_native, (pg_plain, pg_native)
    if mode == "fp32":
        assert loss_err <= 1e-6 and param_err <= 1e-5, (loss_err, param_err, a, b)
    else:  # bf16 / FP8 rounding: losses agree to their precision (params drift under AdamW)
        assert loss_err <= 2e-2, (loss_err, a, b)
    return {"loss_err": loss_err, "param_err": param_err, "torch collectives per fwd+bwd (plain)": len(pg_plain)}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp8"])
def test_native_collectives_parity(gpu_pool, mode, k):
    print(gpu_pool.run(_case_native_collectives, mode, k)[0])


def _case_native_all_to_all():
    """Our communicator's all-to-all (reduce_comm_dtype's exchange) equals torch.distributed's, bf16 and FP8 bytes,
    and refuses two dtypes, or a numel the world size does not divide."""
    import torch.distributed as dist

    from mfsdp_ext.comm.native import NcclTransport

    world, rank = dist.get_world_size(), dist.get_rank()
    transport = NcclTransport(dist.group.WORLD, rank_device())
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        src = (torch.arange(world * 1000, device=rank_device(), dtype=torch.float32) + 10_000 * rank).to(dtype)
        got, want = torch.empty_like(src), torch.empty_like(src)
        transport.all_to_all_into(got, src, dist.group.WORLD)
        dist.all_to_all_single(want.view(torch.uint8), src.view(torch.uint8))
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), dtype
    x = torch.empty(world * 10, device=rank_device())
    with pytest.raises(RuntimeError, match="must have one dtype"):
        transport.all_to_all_into(torch.empty_like(x, dtype=torch.bfloat16), x, dist.group.WORLD)
    if world > 1:
        odd = torch.empty(world * 10 + 1, device=rank_device())
        with pytest.raises(RuntimeError, match="divisible by the world size"):
            transport.all_to_all_into(torch.empty_like(odd), odd, dist.group.WORLD)
    return {"world": world}


@pytest.mark.parametrize("world", [1, 2])
def test_native_all_to_all(world):
    print(get_pool(world, "nccl").run(_case_native_all_to_all)[0])


def _case_grouped_collectives():
    """A unit's groups share one call (collectives.all_gather_together / reduce_scatter_together): an all-gather of
    bf16 and uint8 (FP8 bytes) pairs and a grouped reduce-scatter of two float32 pairs, through torch.distributed
    (ProcessGroupNCCL's coalesced calls) and through our communicator, equal to one collective per pair."""
    import torch.distributed as dist

    from mfsdp_ext.comm.collectives import TORCH_TRANSPORT
    from mfsdp_ext.comm.native import NcclTransport

    world, rank, dev = dist.get_world_size(), dist.get_rank(), rank_device()
    group = dist.group.WORLD
    for transport in (TORCH_TRANSPORT, NcclTransport(group, dev)):
        inputs = [(torch.arange(1000, device=dev) + 1000 * rank).to(torch.bfloat16),
                  (torch.arange(777, device=dev) % 251 + rank).to(torch.uint8)]
        outputs = [torch.empty(world * x.numel(), dtype=x.dtype, device=dev) for x in inputs]
        transport.all_gather_into(outputs, inputs, group)
        for out, x in zip(outputs, inputs):
            want = torch.empty_like(out)
            dist.all_gather_into_tensor(want, x)
            assert torch.equal(out, want), (transport.name, x.dtype)
        packed = [torch.randn(world * n, device=dev, generator=torch.Generator(dev).manual_seed(rank * 10 + n))
                  for n in (4096, 333)]
        reduced = [torch.empty(x.numel() // world, device=dev) for x in packed]
        transport.grouped_reduce_scatter_into(reduced, packed, group)
        for out, x in zip(reduced, packed):
            want = torch.empty_like(out)
            dist.reduce_scatter_tensor(want, x.clone())
            assert torch.equal(out, want), transport.name
    return {"world": world}


@pytest.mark.parametrize("world", [1, 2])
def test_grouped_collectives(world):
    print(get_pool(world, "nccl").run(_case_grouped_collectives)[0])


def _case_native_comm_memory():
    """Our own communicator's device memory (NCCL's, outside PyTorch's allocator, so no peak in step.py shows it):
    the free memory lost by creating it and running a first all-gather, reduce-scatter and all-reduce, minus what
    PyTorch's allocator reserved meanwhile. Also checks the three collectives' results."""
    import torch.distributed as dist

    from mfsdp_ext.comm.native import NcclTransport

    dev, world, n = rank_device(), dist.get_world_size(), 1 << 20
    torch.cuda.synchronize()
    free0, reserved0 = torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev)
    transport = NcclTransport(dist.group.WORLD, dev)
    full = torch.empty(world * n, dtype=torch.bfloat16, device=dev)
    transport.all_gather_into([full], [torch.full((n,), dist.get_rank() + 1.0, dtype=torch.bfloat16, device=dev)], None)
    reduced = torch.empty(n, device=dev)
    transport.reduce_scatter_into(reduced, torch.ones(world * n, device=dev), None)
    amax = torch.tensor([float(dist.get_rank()), 1.0], device=dev)
    transport.all_reduce_max(amax, None)
    torch.cuda.synchronize()
    free1, reserved1 = torch.cuda.mem_get_info(dev)[0], torch.cuda.memory_reserved(dev)
    assert torch.equal(full.view(world, n)[:, 0].float().cpu(), torch.arange(1.0, world + 1))
    assert reduced.eq(world).all() and amax.tolist() == [world - 1.0, 1.0]
    nccl_mib = ((free0 - free1) - (reserved1 - reserved0)) / 2**20
    assert nccl_mib < 2048, nccl_mib
    return {"native communicator MiB": round(nccl_mib, 1)}


def test_native_comm_memory(gpu_pool):
    print(gpu_pool.run(_case_native_comm_memory))


def _case_symm_kernels(use_symm_mem):
    dev = rank_device()
    model = _stack(4, 1024, 4096, use_symm_mem=use_symm_mem)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(2, 256, 1024, device=dev)

    def step():
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    def collective_kernels_of_one_step() -> dict:
        names = [n for n, _, _ in run_profiled(step)[1]]
        symk = [n for n in names if n.startswith("ncclSymk")]
        return {"symk_all_gather": sum("AllGather" in n for n in symk),
                "symk_reduce_scatter": sum("ReduceScatter" in n for n in symk),
                "plain_all_gather": sum("AllGather" in n and not n.startswith("ncclSymk") for n in names),
                "plain_reduce_scatter": sum("ReduceScatter" in n and not n.startswith("ncclSymk") for n in names)}

    step()
    step()
    torch.cuda.synchronize()
    counts = collective_kernels_of_one_step()
    # 4 blocks: 4 forward + 3 backward all-gathers (the last block stays gathered for the backward that
    # starts with it), 4 reduce-scatters per step
    plain = {"symk_all_gather": 0, "symk_reduce_scatter": 0, "plain_all_gather": 7, "plain_reduce_scatter": 4}
    if use_symm_mem:
        assert counts == {"symk_all_gather": 7, "symk_reduce_scatter": 4, "plain_all_gather": 0,
                          "plain_reduce_scatter": 0}, counts
        # released (collectively): the same model goes on with the plain collectives
        model.release_symmetric_memory()
        after_release = collective_kernels_of_one_step()
        assert after_release == plain, after_release
        return {"symm": counts, "after_release": after_release}
    assert counts == plain, counts
    return counts


@pytest.mark.parametrize("use_symm_mem", [False, True], ids=["plain", "symm"])
def test_symm_mem_kernels(gpu_pool, use_symm_mem):
    print(gpu_pool.run(_case_symm_kernels, use_symm_mem)[0])


# ----------------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_resume_bit_exact(tmp_path):
    pool = get_pool(2, "nccl")
    pool.run(ck._case_save, str(tmp_path))
    pool.restart()  # fresh processes load the checkpoint
    print(pool.run(ck._case_resume, str(tmp_path))[0])


@pytest.mark.parametrize("saved_on,loaded_on", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_checkpoint_reshard(tmp_path, saved_on, loaded_on):
    get_pool(saved_on, "nccl").run(ck._case_save_for_reshard, str(tmp_path))
    print(get_pool(loaded_on, "nccl").run(ck._case_load_resharded, str(tmp_path))[0])


@pytest.mark.parametrize("saved_by,loaded_by", [("fsdp2", "ours"), ("ours", "fsdp2")])
def test_checkpoint_interop_with_fsdp2(gpu_pool, tmp_path, saved_by, loaded_by):
    gpu_pool.run(ck._case_save, str(tmp_path), saved_by)
    print(gpu_pool.run(ck._case_resume, str(tmp_path), loaded_by, 1e-6, saved_by)[0])


def test_full_state_dicts(gpu_pool, tmp_path):
    print(gpu_pool.run(ck._case_full_state_dicts, str(tmp_path))[0])


def test_dcp_load_in_place(gpu_pool, tmp_path):
    gpu_pool.run(ck._case_dcp_load_in_place, str(tmp_path))


def test_dtensor_semantics_match_fsdp2(gpu_pool):
    print(gpu_pool.run(ck._case_dtensor_semantics_match_fsdp2)[0])


def test_hf_llama_resume(gpu_pool, tmp_path):
    """The issue's repro: a HuggingFace LlamaForCausalLM checkpointed the torchtitan way resumes bit-exactly."""
    pytest.importorskip("transformers")
    print(gpu_pool.run(ck._case_hf_llama_resume, str(tmp_path))[0])


# ----------------------------------------------------------------------------------------------- bf16 wire, fp32 sum
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_bf16_wire_matches_fp32_reduce_scatter(strategy):
    print(get_pool(2, "nccl").run(rcd._case_matches_fp32_reduce_scatter, strategy, 2, False)[0])


def test_bf16_wire_native_collectives():
    print(get_pool(2, "nccl").run(rcd._case_matches_fp32_reduce_scatter, "optim_grads_params", 2, False, True)[0])


def test_bf16_wire_hsdp():
    print(get_pool(4, "nccl").run(rcd._case_matches_fp32_reduce_scatter, "optim_grads_params", 2, True)[0])


# ----------------------------------------------------------------------------------------------- robustness, no_shard
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_failed_step_recovery(where):
    print(get_pool(2, "nccl").run(rb._case_failed_step, where, 3, "optim_grads_params")[0])


def test_gather_in_flight_after_failed_step():
    print(get_pool(2, "nccl").run(rb._case_gather_in_flight_after_failed_step)[0])


def test_resting_memory_flat():
    print(get_pool(2, "nccl").run(rb._case_resting_memory_flat)[0])


def test_no_shard_parity():
    print(get_pool(2, "nccl").run(ns._case_no_shard_parity, 3)[0])


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


@pytest.mark.parametrize("fp8,microbatches,grads_made_in_capture",
                         [(False, 1, False), (False, 2, True), (True, 2, True)],
                         ids=["bf16", "bf16-mb2-fresh-grads", "fp8-mb2-fresh-grads"])
def test_captured_forward_backward(gpu_pool_from_one, fp8, microbatches, grads_made_in_capture):
    print(gpu_pool_from_one.run(_case_captured_forward_backward, fp8, microbatches, grads_made_in_capture)[0])


def _case_graphed_whole_step(fp8: bool, microbatches: int, optimizer: str):
    """mfsdp_ext.graphed over the whole step (forward, backward with microbatches, clipping-free AdamW/SGD step with
    a scheduler changing the lr every step, zero_grad): 20 graphed steps equal 20 eager steps of a twin bit for
    bit (losses and fp32 shards). The graph holds the forward's first two units gathered across replays; an
    evaluation between graphed steps runs eagerly and leaves the graph valid; a write to a held unit's weights
    outside the graph is seen: the next call captures again (2 captures in all), holding none from then on."""
    import mfsdp_ext

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  fp8=mfsdp_ext.Fp8Policy() if fp8 else None)
    torch.manual_seed(13)
    base = TinyLM(vocab=64, dim=64, ffn=128, n_layers=3, tie=False).to(rank_device())
    models = [shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=policy) for _ in range(2)]
    make = (lambda m: mfsdp_ext.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)) if optimizer == "adamw" \
        else (lambda m: mfsdp_ext.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9))
    opts = [make(m) for m in models]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def make_step(model, opt):
        def train_step(tokens, targets):
            total = _accumulate(model, tokens, targets, microbatches)
            opt.step()
            opt.zero_grad()
            return total
        return train_step

    graphed = mfsdp_ext.graphed(make_step(models[0], opts[0]), warmup=2)
    eager = make_step(models[1], opts[1])
    ours, theirs, evaluated, held = [], [], [], []
    for step in range(20):
        tokens, targets = (t.chunk(world)[rank] for t in batch(step, 32 * world, seq=16, vocab=64))
        if step == 8:  # evaluation between graphed steps
            for m in models:
                m.eval()
                with torch.no_grad():
                    evaluated.append(lm_loss(m, tokens, targets).item())
                m.train()
        if step == 12:  # a hand-written update of the root's (a held unit's) weights, outside the graph
            with torch.no_grad():
                for m in models:
                    m.emb.weight.mul_(0.5)
        ours.append(graphed(tokens, targets).item())
        theirs.append(eager(tokens, targets).item())
        for s in scheds:
            s.step()
        if step == 5:
            held = [u.name for u in models[0]._mfsdp_unit.context.units if u.held_for_graph]
    assert len(held) == 2, held
    assert graphed.captures == 2 and not graphed.hold_first_units, (graphed.captures, graphed.hold_first_units)
    assert evaluated[0] == evaluated[1], evaluated
    assert ours == theirs, (ours, theirs)
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p.to_local(), q.to_local()), name
    assert opts[0].state_dict()["state"].keys() == opts[1].state_dict()["state"].keys()
    return {"first": ours[:3], "last": ours[-1]}


@pytest.mark.parametrize("fp8,microbatches,optimizer", [(False, 1, "adamw"), (False, 2, "sgd"), (True, 2, "adamw")],
                         ids=["bf16-adamw", "bf16-mb2-sgd", "fp8-mb2-adamw"])
def test_graphed_whole_step(gpu_pool_from_one, fp8, microbatches, optimizer):
    print(gpu_pool_from_one.run(_case_graphed_whole_step, fp8, microbatches, optimizer)[0])


def _case_graphed_two_optimizers():
    """A graphed step with two optimizers, the blocks' stepped first and the root's after it: the first one's step
    gathers the held units before the second has updated the root, and the graph's end gathers the root again.
    10 graphed steps equal an eager twin's bit for bit, with one capture and two units held."""
    import mfsdp_ext

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(19)
    base = TinyLM(vocab=64, dim=64, ffn=128, n_layers=3, tie=False).to(rank_device())
    models = [shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=policy) for _ in range(2)]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def make_step(model):
        blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
        root = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
        first, second = mfsdp_ext.optim.AdamW(blocks, lr=1e-3), mfsdp_ext.optim.AdamW(root, lr=2e-3)

        def train_step(tokens, targets):
            loss = lm_loss(model, tokens, targets)
            loss.backward()
            for opt in (first, second):
                opt.step()
                opt.zero_grad()
            return loss.detach()
        return train_step

    graphed, eager = mfsdp_ext.graphed(make_step(models[0]), warmup=2), make_step(models[1])
    ours, theirs = [], []
    for step in range(10):
        tokens, targets = (t.chunk(world)[rank] for t in batch(step, 32 * world, seq=16, vocab=64))
        ours.append(graphed(tokens, targets).item())
        theirs.append(eager(tokens, targets).item())
    held = [u.name for u in models[0]._mfsdp_unit.context.units if u.held_for_graph]
    assert graphed.captures == 1 and len(held) == 2, (graphed.captures, held)
    assert ours == theirs, (ours, theirs)
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p.to_local(), q.to_local()), name
    return {"losses": ours[-3:], "held": held}


def test_graphed_two_optimizers(gpu_pool_from_one):
    print(gpu_pool_from_one.run(_case_graphed_two_optimizers)[0])


def _case_copy_engines():
    """fully_shard(copy_engine_all_gather=True, copy_engine_reduce_scatter=True): every unit's bf16 weights gathered
    and its bf16 gradients exchanged by the copy engines through the peers' symmetric buffers. 3 eager steps, then 8
    steps of its whole step graphed (mfsdp_ext.graphed: the held units gathered inside the optimizer step, all of it
    replayed) with an eager evaluation forward before the last two, equal an eager twin on NCCL's collectives bit
    for bit (losses and fp32 shards); the FP8 groups of an FP8 model keep the plain all-gather."""
    import mfsdp_ext

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(23)
    base = TinyLM(vocab=64, dim=64, ffn=128, n_layers=3, tie=False).to(rank_device())
    ours = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=policy, copy_engine_all_gather=True,
                         copy_engine_reduce_scatter=True)
    twin = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=policy)
    opts = [mfsdp_ext.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, twin)]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def make_step(model, opt):
        def train_step(tokens, targets):
            loss = lm_loss(model, tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return train_step

    eager_ours, eager_twin = make_step(ours, opts[0]), make_step(twin, opts[1])
    graphed = mfsdp_ext.graphed(eager_ours, warmup=2)
    losses, twin_losses = [], []
    for step in range(11):
        tokens, targets = (t.chunk(world)[rank] for t in batch(step, 32 * world, seq=16, vocab=64))
        if step == 9:  # an eager forward between replays: its gathers wait at a barrier first (copy_engine.py)
            with torch.no_grad():
                losses.append(lm_loss(ours, tokens, targets).item())
                twin_losses.append(lm_loss(twin, tokens, targets).item())
        losses.append((eager_ours if step < 3 else graphed)(tokens, targets).item())
        twin_losses.append(eager_twin(tokens, targets).item())
    ops = {op.name for u in ours._mfsdp_unit.context.units for g in u.groups
           for op in (g.collectives.all_gather, g.collectives.reduce_scatter)}
    assert ops == ({"copy_engine"} if world > 1 else {"plain"}), ops
    assert graphed.captures == 1, graphed.captures
    assert losses == twin_losses, (losses, twin_losses)
    for (name, p), q in zip(ours.named_parameters(), twin.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), name
    fp8 = shard_tiny_lm(copy.deepcopy(base), fully_shard, copy_engine_all_gather=True,
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, fp8=mfsdp_ext.Fp8Policy()))
    lm_loss(fp8, tokens, targets).backward()
    fp8_ops = {(g.fp8, g.collectives.all_gather.name) for u in fp8._mfsdp_unit.context.units for g in u.groups}
    assert all(name == ("plain" if is_fp8 or world == 1 else "copy_engine") for is_fp8, name in fp8_ops), fp8_ops
    return {"losses": losses[-3:], "ops": sorted(ops)}


def test_copy_engines(gpu_pool_from_one):
    print(gpu_pool_from_one.run(_case_copy_engines)[0])


def _case_release_symmetric_memory_graphed():
    """A model on symmetric memory, its whole step graphed: release_symmetric_memory() with the graphed step still
    alive returns (NCCL keeps the windows of a live graph: ours is let go first), and the next call captures again
    on the plain collectives; every step equals an eager twin's (symmetric memory released at the same step), bit
    for bit."""
    import warnings

    import mfsdp_ext

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(17)
    base = TinyLM(vocab=64, dim=64, ffn=128, n_layers=3, tie=False).to(rank_device())
    graphed_model = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=policy, use_symm_mem=True)
    twin = shard_tiny_lm(copy.deepcopy(base), fully_shard, mp_policy=policy, use_symm_mem=True)  # the same paths
    opts = [mfsdp_ext.optim.AdamW(m.parameters(), lr=1e-3) for m in (graphed_model, twin)]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    step, eager = mfsdp_ext.graphed(lm_train_step(graphed_model, opts[0]), warmup=2), lm_train_step(twin, opts[1])
    ours, theirs = [], []
    for i in range(6):
        if i == 4:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no warning: no graph of the user's own holds the windows
                graphed_model.release_symmetric_memory()
            twin.release_symmetric_memory()
        tokens, targets = (t.chunk(world)[rank] for t in batch(i, 32 * world, seq=16, vocab=64))
        ours.append(step(tokens, targets).item())
        theirs.append(eager(tokens, targets).item())
    assert step.captures == 2, step.captures
    assert ours == theirs, (ours, theirs)
    return {"losses": ours}


def test_release_symmetric_memory_graphed(gpu_pool):
    print(gpu_pool.run(_case_release_symmetric_memory_graphed)[0])


def test_main_job_cuda_graph(tmp_path):
    """The main job on 2 GPUs with --cuda-graph (the whole step, clipping included, through mfsdp_ext.graphed)
    against the same job without it: every step's loss equal, bit for bit (--deterministic: SDPA's math backend).
    The graphed run checkpoints at step 6; resumed from there, graphed again, steps 7-12 equal too."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    losses = {}
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "6"]
    for name, extra in (("eager", []), ("graph", ["--cuda-graph", *ckpt]),
                        ("resumed", ["--cuda-graph", *ckpt, "--resume"])):
        if name == "resumed":
            shutil.rmtree(tmp_path / "ckpt" / "step-00000012")
        metrics = tmp_path / f"{name}.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(root, "examples", "train_gpt.py"), "--steps", "12", "--optimizer", "fused",
               "--deterministic", "--metrics-file", str(metrics), *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                             env={**os.environ, "PYTHONPATH": root})
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        with open(metrics) as f:
            losses[name] = {row["step"]: row["loss"] for row in map(json.loads, f)}
    assert losses["graph"] == losses["eager"], losses
    assert sorted(losses["resumed"]) == list(range(7, 13)), sorted(losses["resumed"])
    assert all(losses["resumed"][k] == losses["eager"][k] for k in losses["resumed"]), losses
