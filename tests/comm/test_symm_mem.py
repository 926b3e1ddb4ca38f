"""NCCL symmetric-memory collectives (mfsdp_ext.comm.symmetric.comm / mfsdp_ext._C.SymmComm).

CPU tests (always): the module imports without CUDA, is_available() says why not, the environment checks,
and the deterministic offset allocator behind the pool (when _C is built).

GPU tests (``-m gpu``; need >= 2 CUDA devices and the NCCL build): the shared NCCL rank pool (2 and, when
present, 4 ranks; init_process_group("nccl", device_id=...))
allocate from our pool, all-gather / reduce-scatter with ours and with plain torch, compare (exact, the
inputs are small integers), check the error messages, and check with the profiler that NCCL's symmetric
kernels (ncclSymk*) ran for ours. Both the borrowed ProcessGroupNCCL communicator and one created by the
extension are exercised. Then fully_shard on symmetric memory (use_symm_mem=True, "auto"): parity with the default
collectives, ncclSymk kernels in a step and the plain ones after release_symmetric_memory(), which also works with
a graphed step alive.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from mfsdp_ext import _C, MixedPrecisionPolicy, fully_shard, microbatch
from mfsdp_ext.comm import symmetric
from mfsdp_ext.comm.dist_ops import _all_gather_flat, _reduce_scatter_flat
from mfsdp_ext.comm.symmetric import comm as symm_mem
from mfsdp_ext.interop.checkpoint import full_state_dict
from mfsdp_ext.testing.models import (
    TinyLM,
    batch,
    lm_train_step,
    rank_device,
    rel_err,
    run_profiled,
    shard_tiny_lm,
    train,
)
from tests.runtime.test_overlap_and_memory import _stack

MiB = 1 << 20


# ----------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------
def test_module_reloads_and_api_present():
    mod = importlib.reload(symm_mem)
    for name in ("SymmetricComm", "is_available", "nccl_version", "MIN_NCCL_VERSION"):
        assert hasattr(mod, name), name
    assert mod.MIN_NCCL_VERSION == 22807
    # the package face's names are the constants the extension exports (defined once, in C++)
    assert symmetric.MIN_NCCL_VERSION == _C.MIN_NCCL_VERSION and symmetric.ALIGNMENT == _C.SYMM_ALIGNMENT == 4096
    assert mod.format_nccl_version(22809) == "2.28.9"
    assert mod.format_nccl_version(23203) == "2.32.3"
    assert mod.format_nccl_version(None) == "none"


def test_is_available_returns_reason():
    ok, why = symm_mem.is_available()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    if torch.version.cuda is None:
        assert not ok
        assert "CUDA" in why and "CPU-only" in why
    elif not torch.cuda.is_available():
        assert not ok and "CUDA device" in why


def test_env_reason(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    monkeypatch.delenv("NCCL_LOCAL_REGISTER", raising=False)
    assert symm_mem._env_reason() is None
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert symm_mem._env_reason() is None
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert "NCCL_NVLS_ENABLE" in symm_mem._env_reason()
    assert symm_mem._env_reason(allow_nvls=True) is None
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    assert "NCCL_CUMEM_ENABLE" in symm_mem._env_reason()


def test_symmetric_comm_refuses_without_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="process group"):
        symm_mem.SymmetricComm()


def _native_or_skip():
    if not hasattr(_C, "SymmOffsetAllocator"):
        pytest.skip("mfsdp_ext._C has no SymmOffsetAllocator: csrc/symm_comm.cpp is not compiled into this "
                    "build (setup.py compiles it only when CUDA and nccl.h are found)")
    return _C


def test_native_build_info_is_consistent():
    C = _native_or_skip()
    info = C.symm_comm_build_info()
    assert info["alignment"] == 4096 and info["min_runtime_version"] == 22807
    assert isinstance(info["reason"], str) and info["reason"]
    assert info["built"] == hasattr(C, "SymmComm")
    if not info["built"]:
        ok, why = symm_mem.is_available()
        assert not ok and why


def test_offset_allocator_is_deterministic_and_coalesces():
    C = _native_or_skip()

    def run():
        a = C.SymmOffsetAllocator()
        assert a.alignment == 4096
        assert a.add_region(10 * 4096) == 0
        assert a.add_region(3000) == 10 * 4096  # rounded up to one 4096-byte page
        offs = [a.alloc(n) for n in (1, 4096, 4097, 0, 5 * 4096)]
        assert all(o % 4096 == 0 for o in offs if o >= 0)
        a.free(offs[1])
        again = a.alloc(100)  # first fit reuses the freed page
        return a, offs, again

    a1, offs1, again1 = run()
    a2, offs2, again2 = run()
    assert offs1 == offs2 and again1 == again2  # same calls -> same offsets
    assert offs1 == [0, 4096, 8192, 16384, 20480]
    assert again1 == 4096
    assert a1.alloc(4096) == 10 * 4096  # the second region
    assert a1.alloc(1) == -1  # full
    with pytest.raises(RuntimeError):
        a1.free(12345)  # not an allocation start
    # free everything: neighbours coalesce back into whole regions
    for off, _ in a1.allocations():
        a1.free(off)
    assert a1.used == 0 and a1.largest_free == 10 * 4096
    assert a1.alloc(10 * 4096) == 0
    assert a1.find_allocation(4096, 8) == 0 and a1.find_allocation(10 * 4096 + 1, 1) == -1
    assert a1.region_index(10 * 4096) == 1


# ----------------------------------------------------------------------------------------------
# GPU: two ranks
# ----------------------------------------------------------------------------------------------
def _gpu_skip_reason():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs >= 2 CUDA devices"
    ok, why = symm_mem.is_available()
    if not ok:
        return f"NCCL symmetric memory unavailable: {why}"
    return None


def _kernels(fn):
    return [name for name, _, _ in run_profiled(fn)[1]]


def _check_comm(comm, rank, world, device):
    """All checks on one SymmetricComm. Every rank runs the same sequence of pool calls."""
    n = 3 * 4096 + 8  # not a multiple of anything nice
    # --- all-gather: in place and out of place, every supported dtype, exact against plain torch
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8]
    dtypes += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]
    for dtype in dtypes:
        for in_place in (True, False):
            full = comm.alloc_tensor(world * n, dtype)
            assert full.device == device and full.dtype == dtype and full.numel() == world * n
            assert comm.native.offset_of(full) % 4096 == 0
            src = ((torch.arange(n, device=device) * 7 + 11 * rank) % 100).to(torch.float32)
            if in_place:
                inp = full.narrow(0, rank * n, n)
            else:
                inp = comm.alloc_tensor(n, dtype)
            inp.copy_(src.to(dtype))
            comm.all_gather_into(full, inp)
            # reference: plain torch all-gather of the same bytes, on ordinary tensors
            ref = torch.empty(world * n, dtype=dtype, device=device)
            _all_gather_flat(ref.view(torch.uint8), inp.clone().view(torch.uint8))
            torch.cuda.synchronize()
            assert torch.equal(full.view(torch.uint8), ref.view(torch.uint8)), (dtype, in_place)
            if not in_place:
                comm.free_tensor(inp)
            comm.free_tensor(full)

    # --- reduce-scatter: sum and average, bf16/fp16/fp32, exact against plain torch (small integers)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for average in (False, True):
            inp = comm.alloc_tensor(world * n, dtype)
            out = comm.alloc_tensor(n, dtype)
            inp.copy_(((torch.arange(world * n, device=device) % 17) + 2 * rank).to(dtype))
            comm.reduce_scatter_into(out, inp, average=average)
            ref = torch.empty(n, dtype=dtype, device=device)
            _reduce_scatter_flat(ref, inp.clone())
            if average:
                ref.mul_(1.0 / world)
            torch.cuda.synchronize()
            torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=f"{dtype} average={average}")
            comm.free_tensor(out)
            comm.free_tensor(inp)

    # --- in-place reduce-scatter (output = this rank's slot of the input)
    inp = comm.alloc_tensor(world * n, torch.float32)
    inp.copy_((torch.arange(world * n, device=device) % 5 + rank).float())
    ref = torch.empty(n, device=device)
    _reduce_scatter_flat(ref, inp.clone())
    out = inp.narrow(0, rank * n, n)
    comm.reduce_scatter_into(out, inp)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    comm.free_tensor(inp)

    # --- clear errors (all local checks: no rank reaches NCCL)
    a = comm.alloc_tensor(world * 1024, torch.bfloat16)
    b = comm.alloc_tensor(1024, torch.bfloat16)
    outside = torch.empty(world * 1024, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match="symmetric window"):
        comm.all_gather_into(outside, b)
    with pytest.raises(RuntimeError, match="symmetric window"):
        comm.reduce_scatter_into(b, outside)
    with pytest.raises(RuntimeError, match="elements"):
        comm.all_gather_into(a, a.narrow(0, 0, 1000))
    with pytest.raises(RuntimeError, match="elements"):
        comm.reduce_scatter_into(b.narrow(0, 0, 1000), a)
    with pytest.raises(RuntimeError, match="dtype"):
        comm.all_gather_into(a.view(torch.int16), b)
    with pytest.raises(RuntimeError, match="not supported"):
        comm.reduce_scatter_into(b.view(torch.int16), a.view(torch.int16))
    with pytest.raises(RuntimeError, match="contiguous"):
        comm.all_gather_into(a, a[::world])
    with pytest.raises(RuntimeError, match="overlaps"):
        comm.all_gather_into(a, a.narrow(0, 1, 1024))  # inside the output but not this rank's slot
    assert comm.owns(a) and not comm.owns(outside)

    # --- NCCL's symmetric kernels ran for ours
    ag_names = _kernels(lambda: comm.all_gather_into(a, a.narrow(0, rank * 1024, 1024)))
    rs_names = _kernels(lambda: comm.reduce_scatter_into(b, a))
    assert any(nm.startswith("ncclSymk") and "AllGather" in nm for nm in ag_names), ag_names
    assert any(nm.startswith("ncclSymk") and "ReduceScatter" in nm for nm in rs_names), rs_names
    kernels = {"all_gather": sorted(set(ag_names)), "reduce_scatter": sorted(set(rs_names))}
    comm.free_tensor(b)
    comm.free_tensor(a)

    # --- growth beyond the reserved pool (collective: same sequence on every rank)
    cap = comm.native.capacity
    big = comm.alloc_tensor(cap + 1, torch.uint8)  # cannot fit: reserves another region
    assert comm.native.capacity > cap
    assert comm.native.stats()["num_allocations"] == 1
    comm.free_tensor(big)
    assert comm.native.bytes_in_use == 0
    return kernels


def _case_symmetric_collectives() -> dict:
    """Runs on every rank of the NCCL rank pool (init_process_group("nccl", device_id=...) done there)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    dist.barrier(device_ids=[device.index])
    ok, why = symm_mem.is_available(dist.group.WORLD)
    assert ok, why
    seen = {}
    for borrow in (True, False):
        comm = symm_mem.SymmetricComm(dist.group.WORLD, pool_bytes=16 * MiB, grow_bytes=8 * MiB, borrow=borrow)
        assert comm.rank == rank and comm.world_size == world
        if not borrow:
            assert not comm.borrowed and comm.native.owns_comm
        elif comm.borrowed:
            assert not comm.native.owns_comm
        seen["borrowed" if comm.borrowed else "owned"] = _check_comm(comm, rank, world, device)
        view = comm.alloc_tensor(16, torch.float32)
        comm.close()
        comm.close()  # idempotent
        assert comm.closed
        view.fill_(1.0)  # views stay valid after close (the memory lives until the last view dies)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="closed"):
            comm.alloc_tensor(16, torch.float32)
        del view
    dist.barrier(device_ids=[device.index])
    assert "borrowed" in seen, ("ProcessGroupNCCL's communicator could not be borrowed "
                                "(pg._get_backend(dev)._comm_ptr())")
    return seen


@pytest.mark.gpu
def test_symmetric_collectives(gpu_pool):
    reason = _gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    print(gpu_pool.run(_case_symmetric_collectives)[0])


# ----------------------------------------------------------------------------------------------- GPU: fully_shard
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


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


@pytest.mark.gpu
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
    others = {op.name for u in ctx.units for g in u.groups for op in g.collectives[1:]
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


@pytest.mark.gpu
@pytest.mark.parametrize("native", [False, True], ids=["plain", "native"])
def test_symm_mem_auto(gpu_pool, native):
    print(gpu_pool.run(_case_symm_auto, native)[0])


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


@pytest.mark.gpu
@pytest.mark.parametrize("use_symm_mem", [False, True], ids=["plain", "symm"])
def test_symm_mem_kernels(gpu_pool, use_symm_mem):
    print(gpu_pool.run(_case_symm_kernels, use_symm_mem)[0])


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


@pytest.mark.gpu
def test_release_symmetric_memory_graphed(gpu_pool):
    print(gpu_pool.run(_case_release_symmetric_memory_graphed)[0])
