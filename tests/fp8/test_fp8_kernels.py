"""Tests of the FP8 activation quantizer (fp8_quantize: one tensor, per-tensor current scaling, optional
transpose in the same pass) and of the FP8 transpose, in tests/native/test_kernels.py's style.

CPU: bit-equal to a float64 reference of the arithmetic (amax, scale = fp8_max / max(amax, eps) rounded to
fp32, x * scale rounded to fp32, then round-to-nearest-even onto the FP8 grid with saturation), written
without torch's FP8 conversions. GPU (``-m gpu``): CUDA bits == CPU bits for every algorithm, alignment and
shape class (vector and scalar tile paths), launch counts and CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch

from mfsdp_ext import _native as N
from mfsdp_ext.fp8.tensor import quantize
from tests.native.test_kernels import (
    DEVICES,
    F8,
    FLOATS,
    HAS_CUDA,
    _count_kernels,
    assert_bits_equal,
    assert_identical,
    bits,
    gen,
    poison,
    rand_values,
)

FMT = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}  # mantissa bits, min exp, max
EPS = 1e-12


# ----------------------------------------------------------------------------------------------
# float64 reference
# ----------------------------------------------------------------------------------------------
def ref_round_fp8(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 values -> the nearest FP8 value (ties to even), saturated to +-max, as float64; NaN stays NaN."""
    mbits, min_exp, fmax = FMT[dtype]
    a = v.abs()
    _, e = torch.frexp(torch.where(torch.isfinite(a), a, torch.ones_like(a)))
    e = torch.clamp(e.double() - 1, min=min_exp)              # a in [2^e, 2^(e+1)); subnormals share min_exp
    q = torch.exp2(e - mbits)                                 # spacing of the FP8 grid there
    r = torch.round(a / q) * q                                # a / q is exact; torch.round: half to even
    r = torch.where(torch.isinf(a), torch.full_like(a, fmax), torch.clamp(r, max=fmax))
    return torch.where(torch.isnan(v), v, torch.copysign(r, v))


def ref_quantize(x: torch.Tensor, dtype: torch.dtype, eps: float = EPS):
    """(fp8 tensor, scale_inv, amax) by float64 arithmetic with the kernel's two fp32 roundings."""
    fmax = FMT[dtype][2]
    x64 = x.double().reshape(-1)
    amax = x64.abs().max() if x64.numel() else torch.zeros((), dtype=torch.float64)
    eps32 = float(torch.tensor(eps, dtype=torch.float32))
    if amax == 0 or not torch.isfinite(amax):
        scale = torch.ones((), dtype=torch.float64)
    else:
        scale = (fmax / torch.clamp(amax, min=eps32)).float().double()  # correctly rounded fp32 quotient
    scale_inv = (1.0 / scale).float()
    prod = (x64 * scale).float().double()                            # x * scale, one fp32 rounding
    q = ref_round_fp8(prod, dtype)
    out = q.to(dtype)  # exact: q is on the FP8 grid (or NaN)
    return out.view(x.shape), scale_inv, amax.float()


def run_quantize(x, dtype, device, transpose=False, algo="auto", eps=EPS):
    x = x.to(device)
    dst = poison(torch.empty(x.shape, dtype=dtype, device=device))
    sinv = torch.full((), float("nan"), device=device)
    amax = torch.full((1,), float("nan"), device=device)
    dst_t = None
    if transpose:
        cols = x.shape[-1]
        dst_t = poison(torch.empty(cols, x.numel() // max(cols, 1), dtype=dtype, device=device))
    N.fp8_quantize(x, dst, sinv, amax, dst_t, eps, algo)
    return dst, sinv, amax, dst_t


def check_against_reference(x, dtype, got, what):
    dst, sinv, amax, dst_t = got
    ref, ref_sinv, ref_amax = ref_quantize(x, dtype)
    assert_bits_equal(dst, ref, f"{what}: data")
    assert_bits_equal(sinv.reshape(()), ref_sinv, f"{what}: scale_inv")
    assert_bits_equal(amax.reshape(()), ref_amax, f"{what}: amax")
    if dst_t is not None:
        assert torch.equal(bits(dst_t).cpu(), bits(dst).cpu().reshape(-1, x.shape[-1]).t()), f"{what}: transpose"


# ----------------------------------------------------------------------------------------------
# the reference itself
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", F8)
def test_reference_rounding_matches_every_fp8_value_and_midpoint(dtype):
    """The float64 reference reproduces torch's FP8 grid: each code maps to itself, and values a little
    above/below every midpoint between neighbours round to the nearer one (exact ties: to the even code)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    vals = codes.double()
    fin = torch.isfinite(vals)
    vals = vals[fin].unique()  # sorted, +-0 collapsed
    assert torch.equal(ref_round_fp8(vals, dtype), vals)
    mid = (vals[1:] + vals[:-1]) / 2
    lo, hi = ref_round_fp8(mid - mid.abs() * 1e-9, dtype), ref_round_fp8(mid + mid.abs() * 1e-9, dtype)
    assert torch.equal(lo[mid > 0], vals[:-1][mid > 0]) and torch.equal(hi[mid > 0], vals[1:][mid > 0])
    ties = ref_round_fp8(mid, dtype)
    tie_codes = ties.to(dtype).view(torch.uint8) & 1
    assert not tie_codes[mid.abs() > 0].any(), "ties must round to the even code"
    assert ref_round_fp8(torch.tensor([1e300, -float("inf")], dtype=torch.float64), dtype).tolist() == \
        [FMT[dtype][2], -FMT[dtype][2]]


# ----------------------------------------------------------------------------------------------
# CPU (and CUDA) against the reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("src_dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1,), (7,), (33, 17), (4, 5, 48), (1000, 130), (200_003,)])
def test_quantize_bits_equal_float64_reference(device, dtype, src_dtype, shape):
    g = gen(sum(shape))
    x = rand_values(torch.Size(shape).numel(), g, specials=False, spread=10).to(src_dtype).view(shape)
    transpose = len(shape) > 1
    got = run_quantize(x, dtype, device, transpose=transpose)
    check_against_reference(x, dtype, got, f"{src_dtype}->{dtype} {shape}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_quantize_ties_and_subnormals(device, dtype, src_dtype):
    """With fp8_max in the tensor the scale is exactly 1, so the cast itself is checked on chosen values:
    every midpoint between neighbouring FP8 values (ties to even), values just off them and the subnormal
    range. (Saturation: test_quantize_special_values.)"""
    fmax = FMT[dtype][2]
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).double()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([mid, mid * (1 + 2.0**-10), mid * (1 - 2.0**-10), grid])
    vals = torch.cat([vals, -vals, torch.tensor([fmax])]).to(src_dtype)
    assert int(torch.isin(vals.double().abs(), mid).sum()) >= 2 * len(mid)  # the ties survive the source dtype
    got = run_quantize(vals, dtype, device)
    assert float(got[1]) == 1.0
    check_against_reference(vals, dtype, got, f"ties {src_dtype}->{dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", F8)
def test_quantize_special_values(device, dtype):
    """inf or NaN in the tensor: amax is inf / NaN, so the scale is 1 (saturating cast, NaN stays NaN);
    all zeros: scale 1; all below eps: scale = fp8_max / eps; empty: scale_inv 1, amax 0."""
    g = gen(3)
    x = rand_values(5000, g, specials=False, spread=4)
    for special in (float("inf"), float("nan"), -3.0e38):
        y = x.clone()
        y[17] = special
        got = run_quantize(y.view(50, 100), dtype, device, transpose=True)
        check_against_reference(y.view(50, 100), dtype, got, f"with {special}")
        if special != -3.0e38:
            assert float(got[1]) == 1.0
    for z in (torch.zeros(64, 16), torch.full((64, 16), 1e-14), torch.full((64, 16), -1e-13)):
        got = run_quantize(z, dtype, device, transpose=True)
        check_against_reference(z, dtype, got, "zeros / below eps")
    got = run_quantize(torch.full((64, 16), 1e-14), dtype, device, eps=1e-3)
    assert float(got[1]) == float(torch.tensor(1.0) / (torch.tensor(FMT[dtype][2]) / torch.tensor(1e-3)))
    empty = run_quantize(torch.empty(0, 32), dtype, device, transpose=True)
    assert float(empty[1]) == 1.0 and float(empty[2]) == 0.0 and empty[3].shape == (32, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_python_helper(device):
    x = rand_values(96 * 64, gen(4), specials=False, spread=3).view(96, 64).to(torch.bfloat16).to(device)
    q = quantize(x, transpose=True)
    ref, ref_sinv, _ = ref_quantize(x.cpu(), torch.float8_e4m3fn)
    assert_bits_equal(q.data, ref, "quantize()")
    assert q.scale_inv.shape == () and float(q.scale_inv) == float(ref_sinv)
    assert torch.equal(bits(q.data_t), bits(q.data).t())
    q2 = quantize(x)
    assert q2.data_t is None
    assert torch.equal(bits(q2.transposed()), bits(q.data_t))  # made by the transpose kernel on demand
    deq = q.dequantize(torch.float32)
    err = (deq.cpu() - x.cpu().float()).abs()
    assert bool((err <= x.cpu().float().abs() * 2.0**-4 + float(ref_sinv) * 2.0**-9).all())  # e4m3 half-ulp
    with pytest.raises(TypeError, match="float8_e4m3fn or torch.float8_e5m2"):
        quantize(x, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# transpose
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 128), (100, 300), (128, 4096), (200, 48), (0, 5), (7, 0)])
def test_transpose_exact(device, dtype, shape):
    codes = torch.randint(0, 256, shape, generator=gen(shape[0] * 1000 + shape[1]), dtype=torch.int32)
    src = codes.to(torch.uint8).view(dtype).to(device)
    dst = poison(torch.empty(shape[1], shape[0], dtype=dtype, device=device))
    N.fp8_transpose(src, dst)
    assert torch.equal(bits(dst).cpu(), bits(src).cpu().t())


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_quantize_and_transpose_bad_inputs(device):
    d = device
    x = torch.randn(32, 16, device=d, dtype=torch.bfloat16)
    q = torch.empty(32, 16, dtype=torch.float8_e4m3fn, device=d)
    s = torch.empty((), device=d)
    buf = torch.empty(32 * 16 * 2, dtype=torch.uint8, device=d)
    cases = [
        (TypeError, "src must be float32, bfloat16 or float16", lambda: N.fp8_quantize(x.int(), q, s)),
        (TypeError, "src must be float32, bfloat16 or float16", lambda: N.fp8_quantize(q, q, s)),
        (TypeError, "dst must be float8_e4m3fn or float8_e5m2", lambda: N.fp8_quantize(x, x.clone(), s)),
        (ValueError, "src must be contiguous", lambda: N.fp8_quantize(x.t(), q, s)),
        (ValueError, "same number of elements", lambda: N.fp8_quantize(x, q[:31], s)),
        (TypeError, "scale_inv must be float32", lambda: N.fp8_quantize(x, q, s.double())),
        (ValueError, "scale_inv must have one element", lambda: N.fp8_quantize(x, q, torch.empty(2, device=d))),
        (TypeError, "amax must be float32", lambda: N.fp8_quantize(x, q, s, amax=s.half())),
        (ValueError, r"dst_t must have shape \(16, 32\)", lambda: N.fp8_quantize(x, q, s, dst_t=q.clone())),
        (TypeError, "dst_t must have dst's dtype",
         lambda: N.fp8_quantize(x, q, s, dst_t=torch.empty(16, 32, dtype=torch.float8_e5m2, device=d))),
        (ValueError, "algo must be one of", lambda: N.fp8_quantize(x, q, s, algo="fast")),
        (ValueError, "eps must be a positive", lambda: N.fp8_quantize(x, q, s, eps=0.0)),
        (ValueError, "eps must be a positive", lambda: N.fp8_quantize(x, q, s, eps=float("nan"))),
        (ValueError, "must not overlap",
         lambda: N.fp8_quantize(buf.view(torch.bfloat16).view(32, 16), buf[:512].view(torch.float8_e4m3fn), s)),
        (ValueError, "src must be 2-D", lambda: N.fp8_transpose(q.view(-1), q.view(-1))),
        (ValueError, r"dst must have shape \(16, 32\)", lambda: N.fp8_transpose(q, q.clone())),
        (TypeError, "src must be float8_e4m3fn or float8_e5m2", lambda: N.fp8_transpose(x, x.t().contiguous())),
        (TypeError, "dst must have src's dtype",
         lambda: N.fp8_transpose(q, torch.empty(16, 32, dtype=torch.float8_e5m2, device=d))),
        (ValueError, "dst must be contiguous", lambda: N.fp8_transpose(q, q.t())),
    ]
    for exc, msg, fn in cases:
        print(f"bad input case: {msg}", flush=True)
        with pytest.raises(exc, match=msg):
            fn()


def test_meta_tensors_only_check_shapes():
    x = torch.empty(64, 32, device="meta", dtype=torch.bfloat16)
    q = torch.empty(64, 32, device="meta", dtype=torch.float8_e4m3fn)
    N.fp8_quantize(x, q, torch.empty((), device="meta"), dst_t=torch.empty(32, 64, device="meta",
                                                                            dtype=torch.float8_e4m3fn))
    N.fp8_transpose(q, torch.empty(32, 64, device="meta", dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="dst_t must have shape"):
        N.fp8_quantize(x, q, torch.empty((), device="meta"), dst_t=q)


# ----------------------------------------------------------------------------------------------
# GPU only: CUDA == CPU bit for bit, algorithms, launches, graphs
# ----------------------------------------------------------------------------------------------
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")]

# (shape, misalign in elements): vector tiles, ragged edge tiles, rows % 8 != 0, cols * size % 16 != 0,
# misaligned source (scalar tile path / shifted vector loads), large
GPU_CASES = [((1024, 4096), 0), ((4096, 11008), 0), ((1000, 4096), 0), ((64, 128), 0), ((65, 129), 0),
             ((1028, 1032), 0), ((512, 1000), 0), ((3, 5, 4096), 0), ((777,), 0), ((2048, 4096), 1),
             ((4096, 256), 3), ((1, 16), 0), ((0, 64), 0)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("src_dtype", FLOATS)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}+{c[1]}")
def test_quantize_cuda_equals_cpu(dtype, src_dtype, case):
    shape, mis = case
    n = torch.Size(shape).numel()
    x = rand_values(n, gen(n + mis), specials=False, spread=8).to(src_dtype).view(shape)
    cpu = run_quantize(x, dtype, "cpu", transpose=len(shape) > 1)
    buf = torch.empty(n + mis, dtype=src_dtype, device="cuda")
    xc = buf[mis:].view(shape)
    xc.copy_(x)
    for algo in ("two_pass", "fused", "auto"):
        for transpose in (len(shape) > 1, False):
            got = run_quantize(xc, dtype, "cuda", transpose=transpose, algo=algo)
            for a, b, what in zip(cpu, got, ("data", "scale_inv", "amax", "dst_t")):
                if b is not None:
                    assert_identical(a, b, f"{algo} transpose={transpose} {what}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
@pytest.mark.parametrize("shape", [(4096, 4096), (11008, 4096), (4096, 11008), (1000, 1000), (129, 65), (16, 48)])
def test_transpose_cuda_equals_cpu(shape):
    src = torch.randint(0, 256, shape, generator=gen(shape[0]), dtype=torch.int32).to(torch.uint8)
    src = src.view(torch.float8_e4m3fn)
    dst = poison(torch.empty(shape[1], shape[0], dtype=src.dtype, device="cuda"))
    N.fp8_transpose(src.cuda(), dst)
    assert torch.equal(bits(dst).cpu(), bits(src).t())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_quantize_launches_and_graph_capture():
    x = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(1024, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    qt = torch.empty(4096, 1024, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty((), device="cuda")
    N.fp8_quantize(x, q, s, dst_t=qt)
    assert len(_count_kernels(lambda: N.fp8_quantize(x, q, s))) == 2
    assert len(_count_kernels(lambda: N.fp8_quantize(x, q, s, dst_t=qt))) == 2
    assert len(_count_kernels(lambda: N.fp8_quantize(x, q, s, algo="fused"))) == 1
    assert len(_count_kernels(lambda: N.fp8_quantize(x, q, s, dst_t=qt, algo="fused"))) == 1
    assert len(_count_kernels(lambda: N.fp8_transpose(q, qt))) == 1
    # the programmatic dependent launch under stream capture; "fused" runs two-pass there
    for algo, dst_t in (("two_pass", qt), ("fused", qt), ("two_pass", None)):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            N.fp8_quantize(x, q, s, dst_t=dst_t, algo=algo)
        x.mul_(-3.0)
        graph.replay()
        torch.cuda.synchronize()
        ref = run_quantize(x.cpu(), torch.float8_e4m3fn, "cpu", transpose=dst_t is not None)
        assert_identical(q, ref[0], f"{algo} replayed data")
        assert_identical(s, ref[1], f"{algo} replayed scale_inv")
        if dst_t is not None:
            assert_identical(qt, ref[3], "replayed transpose")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_quantize_runs_on_current_stream():
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(4096, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    qt = torch.empty(4096, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty((), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        N.fp8_quantize(x, q, s, dst_t=qt)
    side.synchronize()
    ref = run_quantize(x.cpu(), torch.float8_e4m3fn, "cpu", transpose=True)
    assert_identical(q, ref[0], "data")
    assert_identical(qt, ref[3], "transpose")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_quantize_fused_beside_busy_sms_and_on_two_streams():
    """The fused kernel needs no co-residency: it finishes (with the right bits) while a long GEMM holds SMs on
    another stream, and two streams run it at once (each has its own counters, reset after every launch)."""
    xs = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * (i + 1) for i in range(2)]
    refs = [run_quantize(x.cpu(), torch.float8_e5m2, "cpu", transpose=True) for x in xs]
    outs = [(torch.empty(4096, 4096, dtype=torch.float8_e5m2, device="cuda"),
             torch.empty(4096, 4096, dtype=torch.float8_e5m2, device="cuda"), torch.empty((), device="cuda"))
            for _ in xs]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    streams = [torch.cuda.Stream() for _ in range(3)]
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    for rep in range(3):
        with torch.cuda.stream(streams[2]):
            for _ in range(4):
                a = (a @ a).clamp_(-1, 1)  # keeps the SMs busy meanwhile
        for x, (q, qt, s), st in zip(xs, outs, streams):
            with torch.cuda.stream(st):
                N.fp8_quantize(x, q, s, dst_t=qt, algo="fused")
        torch.cuda.synchronize()
        for (q, qt, s), ref in zip(outs, refs):
            assert_identical(q, ref[0], f"rep {rep} data")
            assert_identical(qt, ref[3], f"rep {rep} transpose")
            assert_identical(s, ref[1], f"rep {rep} scale_inv")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
@pytest.mark.parametrize("algo", ["fused", "two_pass"])
@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transpose"])
@pytest.mark.parametrize("shape", [(1024, 4096), (4096, 4096)], ids=lambda s: "x".join(map(str, s)))
def test_quantize_many_back_to_back_launches_on_one_stream(algo, transpose, shape):
    """200 launches on one stream (4 rounds of 50 with no other kernel between them, as benchmarks/kernels.py
    times them), inputs with amax 4x, 2x, 1x taken in turn (tile counters, held-tile flags or an amax left over
    by the previous launch would show), each launch writing outputs of its own: every launch's bits equal the
    CPU kernel's. 1024 x 4096 bf16 is the benchmark's 8 MiB case (512 tiles; 4096 x 4096: 2048)."""
    dt = torch.float8_e4m3fn
    base = rand_values(shape[0] * shape[1], gen(shape[0]), specials=False, spread=4).to(torch.bfloat16).view(shape)
    xs_cpu = [base * f for f in (4.0, 2.0, 1.0)]  # exact in bf16: three amax values, largest first
    refs = []
    for x in xs_cpu:
        q, s, a, qt = run_quantize(x, dt, "cpu", transpose=transpose)
        refs.append([bits(t).cuda() if t is not None else None for t in (q, qt, s.reshape(()), a.reshape(()))])
    xs = [x.cuda() for x in xs_cpu]
    ring = 50
    outs = [(torch.empty(shape, dtype=dt, device="cuda"),
             torch.empty(shape[::-1], dtype=dt, device="cuda") if transpose else None,
             torch.empty((), device="cuda"), torch.empty(1, device="cuda")) for _ in range(ring)]
    for rnd in range(4):
        for q, qt, s, a in outs:
            for t in (q, qt, a):
                if t is not None:
                    poison(t)
            s.fill_(float("nan"))
        torch.cuda.synchronize()
        for i, (q, qt, s, a) in enumerate(outs):
            N.fp8_quantize(xs[(rnd * ring + i) % 3], q, s, a, qt, algo=algo)
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            k = rnd * ring + i
            ref = refs[k % 3]
            for what, got, want in zip(("data", "transpose", "scale_inv", "amax"), out, ref):
                if got is not None and not torch.equal(bits(got.reshape(want.shape)), want):
                    assert_identical(got.reshape(want.shape).cpu(), want.cpu().view(got.dtype),
                                     f"launch {k} of 200 ({algo}, input x{4 >> (k % 3)}): {what}")
