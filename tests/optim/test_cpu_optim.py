"""The CPU optimizer kernels' code paths (csrc/optim_cpu.cpp: "avx512" = AVX-512F, "avx" = AVX + FMA + F16C,
"scalar") against torch's CPU AdamW and SGD, each path forced in turn with ``_C.set_cpu_simd`` (a path this CPU
lacks is skipped, with the reason).

How exact:
  * AdamW against torch.optim.AdamW (foreach=False, the default, foreach=True) with torch's sqrt made correctly
    rounded (``ExactSqrt``; everything else torch's own code): params, exp_avg and exp_avg_sq bit-identical. torch's
    own CPU sqrt (MKL VML) is one ulp off for ~15% of inputs and the kernel's is exact, so against plain
    torch.optim.AdamW exp_avg / exp_avg_sq stay bit-identical and params differ by rounding flips only
    (``test_adamw_vs_plain_torch`` bounds them).
  * SGD against torch.optim.SGD (all three modes): bit-identical.
  * The paths against each other, with infinities, subnormals and NaN in the data: the same bits.
  * mfsdp_ext.optim.AdamW / SGD on a 1-rank fully_shard model (every path): the same bits as torch's optimizer
    (exact sqrt), the same step counts and state_dict structure, and state dicts that load both ways exactly.
    test_optim.py covers 2 and 4 ranks on the default path (parity, crossing with training continued).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

import mfsdp_ext.optim as mo
from mfsdp_ext import _C, _native, fully_shard
from mfsdp_ext.testing.models import TinyLM, batch, lm_loss, shard_tiny_lm
from tests.conftest import get_pool

PATHS = ("scalar", "avx", "avx512")
SIZES = (1, 7, 33, 1023, 4097, 100003)  # odd on purpose: vector tails, unaligned starts, several threads' chunks
GAP = 3  # elements between parameters (alignment padding in a real layout): never touched


@pytest.fixture(params=PATHS)
def simd_path(request):
    """Force one code path for the test, then restore the one before."""
    path = request.param
    if path not in _C.cpu_simd_paths():
        pytest.skip(f"this CPU cannot run the '{path}' path (supported: {_C.cpu_simd_paths()})")
    before = _C.set_cpu_simd(path)
    assert _C.cpu_simd() == path
    yield path
    _C.set_cpu_simd(before)


class ExactSqrt(TorchFunctionMode):
    """torch's sqrt correctly rounded (through float64, which rounds to the exact float32 sqrt)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.sqrt, torch.Tensor.sqrt):
            return args[0].double().sqrt().to(args[0].dtype)
        if func is torch._foreach_sqrt:
            return [t.double().sqrt().to(t.dtype) for t in args[0]]
        return func(*args, **kwargs)


def _layout(sizes=SIZES):
    """[(start, end)] of each parameter in a flat buffer, GAP elements apart, and the buffer's length."""
    runs, off = [], 0
    for s in sizes:
        runs.append((off, off + s))
        off += s + GAP
    return runs, off


def _gaps_mask(runs, n):
    mask = torch.ones(n, dtype=torch.bool)
    for a, b in runs:
        mask[a:b] = False
    return mask


# AdamW groups: weight decay on / off, maximize, both forms of torch's lerp (1 - beta1 < 0.5 and >= 0.5)
ADAMW_GROUPS = (dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, maximize=False),
                dict(lr=3e-3, betas=(0.4, 0.999), eps=1e-6, weight_decay=0.0, maximize=True))
SGD_GROUPS = (dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, maximize=False),
              dict(lr=0.05, momentum=0.5, dampening=0.1, weight_decay=0.0, nesterov=False, maximize=True),
              dict(lr=0.2, momentum=0.0, dampening=0.0, weight_decay=0.1, nesterov=False, maximize=False))


def _adamw_coeffs(h: dict, step: int) -> list[float]:
    """The kernel's per-run coefficients as mfsdp_ext.optim.AdamW computes them (host doubles, rounded to fp32)."""
    (b1, b2), lr, wd = h["betas"], h["lr"], h["weight_decay"]
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    return [1 - lr * wd, 1 - b1, b2, 1 - b2, bc2**0.5, h["eps"], -(lr / bc1), -1.0 if h["maximize"] else 1.0]


def _sgd_coeffs(h: dict, first: bool) -> list[float]:
    flags = (1 | (2 if first else 0) | (4 if h["nesterov"] else 0)) if h["momentum"] else 0
    return [h["weight_decay"], h["momentum"], 1 - h["dampening"], -h["lr"], -1.0 if h["maximize"] else 1.0, flags,
            0.0, 0.0]


def _group_of(i: int, groups) -> int:
    return i % len(groups)


def _run_adamw(grad_dtype, foreach, steps: int, exact_sqrt: bool):
    """Ours over a flat buffer and torch.optim.AdamW over separate parameters, on the same data; returns both."""
    runs, n = _layout()
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(n, generator=g)
    flat[_gaps_mask(runs, n)] = float("nan")  # in no run: must stay as they are
    m, v = torch.zeros(n), torch.zeros(n)
    params = [nn.Parameter(flat[a:b].clone()) for a, b in runs]
    groups = [{"params": [p for i, p in enumerate(params) if _group_of(i, ADAMW_GROUPS) == k], **h}
              for k, h in enumerate(ADAMW_GROUPS)]
    opt = torch.optim.AdamW(groups, foreach=foreach)
    run_table = torch.tensor(runs)
    for step in range(1, steps + 1):
        grad = torch.randn(n, generator=g).to(grad_dtype)
        for p, (a, b) in zip(params, runs):
            p.grad = grad[a:b].float()  # the values the kernel reads from the bf16 / fp16 grad
        coeffs = torch.tensor([_adamw_coeffs(ADAMW_GROUPS[_group_of(i, ADAMW_GROUPS)], step)
                               for i in range(len(runs))], dtype=torch.float32)
        _native.adamw_step(flat, grad, m, v, run_table, coeffs)
        if exact_sqrt:
            with ExactSqrt():
                opt.step()
        else:
            opt.step()
    return runs, n, (flat, m, v), params, opt


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("foreach", [False, None, True], ids=["for_loop", "default", "foreach"])
def test_adamw_equals_torch(simd_path, foreach, grad_dtype):
    runs, n, (flat, m, v), params, opt = _run_adamw(grad_dtype, foreach, steps=4, exact_sqrt=True)
    for p, (a, b) in zip(params, runs):
        st = opt.state[p]
        assert torch.equal(flat[a:b], p.detach()), (simd_path, b - a)
        assert torch.equal(m[a:b], st["exp_avg"]) and torch.equal(v[a:b], st["exp_avg_sq"]), (simd_path, b - a)
        assert st["step"].item() == 4
    gaps = _gaps_mask(runs, n)
    assert flat[gaps].isnan().all() and not m[gaps].any() and not v[gaps].any()


def test_adamw_vs_plain_torch(simd_path):
    """Against torch's own CPU sqrt: the moments bit-identical, params apart by rounding flips only. Each torch
    sqrt one ulp off moves that step's update by ~2^-23 of itself, which may flip the rounding of the param: per
    step at most an ulp of the param plus 2^-22 of lr, accumulated over the steps. Measured here (10 steps):
    2.4e-7 at most (one ulp of a param in [2, 4)), on ~2% of the elements."""
    steps = 10
    runs, n, (flat, m, v), params, opt = _run_adamw(torch.float32, False, steps=steps, exact_sqrt=False)
    lr = max(h["lr"] for h in ADAMW_GROUPS)
    worst, differ = 0.0, 0
    for p, (a, b) in zip(params, runs):
        ours, theirs = flat[a:b], p.detach()
        assert torch.equal(m[a:b], opt.state[p]["exp_avg"]) and torch.equal(v[a:b], opt.state[p]["exp_avg_sq"])
        bound = steps * (torch.maximum(ours.abs(), theirs.abs()) * 2.0**-23 + lr * 2.0**-22)
        assert ((ours - theirs).abs() <= bound).all(), ((ours - theirs).abs() - bound).max()
        worst = max(worst, (ours - theirs).abs().max().item())
        differ += (ours != theirs).sum().item()
    print(f"max |ours - torch| {worst:.3g}, {differ} of {sum(SIZES)} params differ")
    assert differ < 0.05 * sum(SIZES), differ


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("foreach", [False, None, True], ids=["for_loop", "default", "foreach"])
def test_sgd_equals_torch(simd_path, foreach, grad_dtype):
    runs, n = _layout()
    g = torch.Generator().manual_seed(1)
    flat = torch.randn(n, generator=g)
    buf = torch.full((n,), float("nan"))  # the first step must not read it, nor any step outside momentum runs
    params = [nn.Parameter(flat[a:b].clone()) for a, b in runs]
    groups = [{"params": [p for i, p in enumerate(params) if _group_of(i, SGD_GROUPS) == k], **h}
              for k, h in enumerate(SGD_GROUPS)]
    opt = torch.optim.SGD(groups, foreach=foreach)
    run_table = torch.tensor(runs)
    for step in range(4):
        grad = torch.randn(n, generator=g).to(grad_dtype)
        for p, (a, b) in zip(params, runs):
            p.grad = grad[a:b].float()
        coeffs = torch.tensor([_sgd_coeffs(SGD_GROUPS[_group_of(i, SGD_GROUPS)], step == 0)
                               for i in range(len(runs))], dtype=torch.float32)
        _native.sgd_step(flat, grad, buf, run_table, coeffs)
        opt.step()
    for i, (p, (a, b)) in enumerate(zip(params, runs)):
        assert torch.equal(flat[a:b], p.detach()), (simd_path, b - a)
        if SGD_GROUPS[_group_of(i, SGD_GROUPS)]["momentum"]:
            assert torch.equal(buf[a:b], opt.state[p]["momentum_buffer"])
        else:
            assert buf[a:b].isnan().all() and opt.state[p].get("momentum_buffer") is None
    assert buf[_gaps_mask(runs, n)].isnan().all()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bits where a is not NaN, NaN at the same places (x86 NaN payloads are not part of the contract)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_paths_agree_on_special_values(grad_dtype):
    """Every supported path gives the scalar path's bits, with infinities, NaN, subnormals and huge values in the
    grads, weights and moments, and hyperparameters drawn per run (both lerp forms, maximize, weight decay)."""
    g = torch.Generator().manual_seed(2)
    n, k = 50_000, 40
    cuts = torch.sort(torch.randperm(n, generator=g)[: 2 * k]).values.view(k, 2)  # sorted, disjoint runs
    tiny = torch.finfo(grad_dtype).tiny
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, tiny / 4, -tiny / 2, 3e4, -6e4])
    grad = torch.randn(n, generator=g) * 10
    grad[torch.randint(0, n, (500,), generator=g)] = special[torch.randint(0, len(special), (500,), generator=g)]
    grad = grad.to(grad_dtype)
    param0 = torch.randn(n, generator=g)
    param0[::997] = torch.tensor(1e-40)  # fp32 subnormal
    m0, v0 = torch.randn(n, generator=g), torch.rand(n, generator=g)
    rnd = torch.rand(k, 4, generator=g, dtype=torch.float64).tolist()
    adamw = torch.tensor([_adamw_coeffs(dict(lr=r[0] * 0.1, betas=(r[1], 0.9 + 0.1 * r[2]), eps=1e-8,
                                             weight_decay=0.1 * (r[3] > 0.5), maximize=r[3] < 0.3), 1 + i % 7)
                          for i, r in enumerate(rnd)], dtype=torch.float32)
    sgd = torch.tensor([_sgd_coeffs(dict(lr=r[0], momentum=0.9 * (r[1] > 0.3), dampening=0.1 * r[2],
                                         weight_decay=0.01 * (r[3] > 0.5), nesterov=r[3] > 0.7, maximize=r[2] < 0.2),
                                    first=i % 5 == 0) for i, r in enumerate(rnd)], dtype=torch.float32)
    out = {}
    before = _C.cpu_simd()
    try:
        for path in _C.cpu_simd_paths():
            _C.set_cpu_simd(path)
            p, m, v, b = param0.clone(), m0.clone(), v0.clone(), m0.clone()
            _native.adamw_step(p, grad, m, v, cuts, adamw)
            _native.sgd_step(p, grad, b, cuts, sgd)
            out[path] = (p, m, v, b)
    finally:
        _C.set_cpu_simd(before)
    assert "scalar" in out and len(out) == len(_C.cpu_simd_paths())
    assert out["scalar"][0].isnan().any()  # the specials went through
    for path, tensors in out.items():
        assert all(_bits_equal(a, b) for a, b in zip(tensors, out["scalar"])), path


def test_threads_do_not_change_bits(simd_path):
    """One thread or several (chunks split inside runs, on 64-byte multiples): the same bits."""
    n = 300_001
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(n, generator=g) for _ in range(3)]
    base[2] = base[2].abs()
    grad = torch.randn(n, generator=g).to(torch.bfloat16)
    runs = torch.tensor([[5, 70_001], [70_001, 70_002], [70_010, n]])
    coeffs = torch.tensor([_adamw_coeffs(ADAMW_GROUPS[i % 2], 3) for i in range(3)], dtype=torch.float32)
    threads = torch.get_num_threads()
    out = []
    try:
        for t in (1, max(2, threads), 3):
            torch.set_num_threads(t)
            p, m, v = (x.clone() for x in base)
            _native.adamw_step(p, grad, m, v, runs, coeffs)
            out.append((p, m, v))
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(out[0][0], base[0])
    for res in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(res, out[0]))


def test_kernels_run_on_torchs_threads():
    """_C's at::parallel_for can use more than one thread: with ATen's OpenMP backend that needs _C compiled with
    -fopenmp (without it every CPU kernel ran on one thread), and one OpenMP runtime, torch's (whose
    set_num_threads we follow)."""
    if "OpenMP" in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]:
        assert _native.build_info()["cpu_parallel"] == "openmp"
        gomp = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
        assert len(gomp) == 1, gomp
    else:
        assert _native.build_info()["cpu_parallel"] == "aten"


def test_choosing_a_path():
    paths = _C.cpu_simd_paths()
    assert paths[-1] == "scalar" and set(paths) <= set(PATHS)
    assert _native.build_info()["cpu_simd_paths"] == paths
    before = _C.cpu_simd()
    try:
        assert _C.set_cpu_simd("scalar") == before and _C.cpu_simd() == "scalar"
        assert _C.set_cpu_simd("auto") == "scalar" and _C.cpu_simd() == paths[0]
        with pytest.raises(ValueError, match="unknown CPU SIMD path 'sse9'"):
            _C.set_cpu_simd("sse9")
        assert _C.cpu_simd() == paths[0]  # unchanged by the refusal
        for path in set(PATHS) - set(paths):
            with pytest.raises(ValueError, match="does not support"):
                _C.set_cpu_simd(path)
    finally:
        _C.set_cpu_simd(before)


@pytest.mark.parametrize("value", ["scalar", "auto", "sse9"])
def test_env_var(value):
    """MFSDP_CPU_SIMD picks the path at the first step; an unknown value fails that step with the variable's name."""
    code = ("import torch\nfrom mfsdp_ext import _C, _native\n"
            "p, g, m, v = torch.zeros(40), torch.ones(40), torch.zeros(40), torch.zeros(40)\n"
            "c = torch.tensor([[1.0, 0.1, 0.99, 0.01, 0.1, 1e-8, -0.01, 1.0]])\n"
            "try:\n    _native.adamw_step(p, g, m, v, torch.tensor([[0, 40]]), c)\n"
            "    print('path', _C.cpu_simd())\nexcept ValueError as e:\n    print('error', e)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MFSDP_CPU_SIMD=value, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    expect = {"scalar": "path scalar", "auto": f"path {_C.cpu_simd_paths()[0]}",
              "sse9": "error mfsdp_ext: MFSDP_CPU_SIMD: unknown CPU SIMD path 'sse9'"}[value]
    assert out.stdout.strip().startswith(expect), out.stdout


# ---------------------------------------------------------------------------------------------- optimizer level
def _optimizers(kind: str, ours: bool, model, foreach=False):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    if kind == "adamw":
        groups = [{"params": decay, **ADAMW_GROUPS[0]}, {"params": rest, **ADAMW_GROUPS[1]}]
        return (mo.AdamW if ours else torch.optim.AdamW)(groups, foreach=foreach)
    groups = [{"params": decay, **SGD_GROUPS[0]}, {"params": rest, **SGD_GROUPS[1]}]
    return (mo.SGD if ours else torch.optim.SGD)(groups, foreach=foreach)


def _model():
    torch.manual_seed(0)
    return shard_tiny_lm(TinyLM(dim=24, ffn=40), fully_shard)


def _train(model, opt, steps: range) -> None:
    for step in steps:
        tokens, targets = batch(step, 4)
        lm_loss(model, tokens, targets).backward()
        if step % 3 == 1:
            model.blocks[1].fc1.bias.grad = None  # no grad this step: not stepped, its step count stays behind
        with ExactSqrt():
            opt.step()
        opt.zero_grad()


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _assert_same_state(ours: dict, theirs: dict) -> None:
    """Same param groups, same parameters with state, same keys in the same order, same types and bits."""
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys() and ours["state"]
    for idx, st in ours["state"].items():
        ref = theirs["state"][idx]
        assert list(st) == list(ref), (st.keys(), ref.keys())
        for key, value in st.items():
            other = ref[key]
            assert type(value) is type(other), key
            if isinstance(value, DTensor):
                assert value.placements == other.placements
            if value is None:
                continue
            assert value.dtype == other.dtype and value.shape == other.shape, key
            assert torch.equal(_local(value), _local(other)), (idx, key)


def _case_optimizer_paths(kind: str, paths: list[str]) -> str:
    """On every path: mfsdp_ext.optim's optimizer (the flat kernel) and torch's (exact sqrt) train identical models
    to the same bits, with the same state_dict; each state_dict loads into the other optimizer exactly."""
    before = _C.cpu_simd()
    weights = {}
    try:
        for path in paths:
            _C.set_cpu_simd(path)
            a, b = _model(), _model()
            oa, ob = _optimizers(kind, True, a), _optimizers(kind, False, b)
            _train(a, oa, range(5))
            _train(b, ob, range(5))
            for p, q in zip(a.parameters(), b.parameters()):
                assert torch.equal(_local(p), _local(q)), path
            sa, sb = oa.state_dict(), ob.state_dict()
            _assert_same_state(sa, sb)
            if kind == "adamw":
                assert {st["step"].item() for st in sa["state"].values()} == {3.0, 5.0}  # the dropped grad's 3
            weights[path] = [_local(p).clone() for p in a.parameters()]
            # crossing: ours -> torch's optimizer, torch's -> ours (into the flat buffers), exactly
            ot = _optimizers(kind, False, a)
            ot.load_state_dict(sa)
            _assert_same_state(ot.state_dict(), sa)
            oc = _optimizers(kind, True, b)
            oc.load_state_dict(sb)
            _assert_same_state(oc.state_dict(), sb)
            _train(a, ot, range(5, 7))
            _train(b, oc, range(5, 7))  # ours continuing from torch's state: the same bits as torch continuing ours
            for p, q in zip(a.parameters(), b.parameters()):
                assert torch.equal(_local(p), _local(q)), path
    finally:
        _C.set_cpu_simd(before)
    for path in paths:
        assert all(torch.equal(x, y) for x, y in zip(weights[path], weights[paths[0]]))
    return f"{kind}: {paths} bit-identical to torch"


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_optimizer_every_path(kind):
    print(get_pool(1).run(_case_optimizer_paths, kind, _C.cpu_simd_paths())[0])
