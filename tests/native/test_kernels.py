"""Tests of the native kernels (mfsdp_ext._C through mfsdp_ext._native).

Every kernel is checked against a plain-torch / float64 reference on fresh random data (odd sizes,
misaligned offsets, empty and tiny segments, NaN / inf / huge values, poisoned outputs), on CPU always and
on CUDA where present (``-m gpu``); the GPU tests also check CPU == CUDA bit for bit, every fp32 bit pattern
against torch's conversions, and that pack is one kernel launch.
"""

from __future__ import annotations

import math

import pytest
import torch

from mfsdp_ext import _native as N
from mfsdp_ext.testing.models import run_profiled

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")]
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]

F8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand_values(n: int, g: torch.Generator, specials: bool = True, spread: int = 12) -> torch.Tensor:
    """fp32 values with widely varying magnitudes (never all zeros); optional NaN / inf / huge / denormals."""
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-spread, spread + 1, (n,), generator=g).float())
    x[x == 0] = 1.0
    if specials and n >= 16:
        idx = torch.randperm(n, generator=g)[: max(8, n // 50)]
        pool = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0e38, -3.0e38, 1e-40, -1e-42, 0.0,
                             -0.0, 65519.0, 65520.0, 448.0, 464.0, -480.0, 57344.0, 61440.0, 1e5, -2e6])
        x[idx] = pool[torch.randint(0, len(pool), (len(idx),), generator=g)]
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_VIEW[t.element_size()])


def assert_bits_equal(got: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """Bit-for-bit equality, except that NaN only has to be NaN (any payload)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, ref.dtype, got.shape, ref.shape)
    got, ref = got.cpu(), ref.cpu()
    gn, rn = torch.isnan(got.float()), torch.isnan(ref.float())
    assert torch.equal(gn, rn), f"{what}: NaN positions differ ({int((gn != rn).sum())} elements)"
    diff = (bits(got) != bits(ref)) & ~gn
    if diff.any():
        i = int(diff.nonzero()[0])
        raise AssertionError(f"{what}: {int(diff.sum())} of {got.numel()} elements differ, first at {i}: "
                             f"got {got[i].float().item()!r} ({int(bits(got)[i])}), "
                             f"ref {ref[i].float().item()!r} ({int(bits(ref)[i])})")


def assert_identical(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Exactly the same bits, NaN payloads included (CPU vs CUDA)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    ba, bb = bits(a.cpu()).reshape(-1), bits(b.cpu()).reshape(-1)  # flat: the index below is a flat index
    if not torch.equal(ba, bb):
        d = (ba != bb).nonzero()
        raise AssertionError(f"{what}: {len(d)} elements differ, first at {int(d[0])}")


def poison(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).fill_(0xFF)  # NaN for every float dtype
    return t


def random_segments(total: int, n: int, g: torch.Generator, empty_frac: float = 0.2) -> torch.Tensor:
    """n sorted, non-overlapping [start, end) rows inside [0, total), with gaps and empty rows."""
    cuts = torch.sort(torch.randint(0, total + 1, (2 * n,), generator=g)).values.view(n, 2).clone()
    empty = torch.rand(n, generator=g) < empty_frac
    cuts[empty, 1] = cuts[empty, 0]
    return cuts


def ref_scales(amax: torch.Tensor, fp8_max: float, eps: float):
    amax = amax.float()
    scale = torch.tensor(fp8_max, dtype=torch.float32) / torch.clamp(amax, min=torch.tensor(eps).float().item())
    bad = (amax == 0) | ~torch.isfinite(amax)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    return scale, torch.tensor(1.0, dtype=torch.float32) / scale


def ref_fp8_cast(src, segments, amax, dtype, eps=1e-12):
    m = N.FP8_MAX[dtype]
    scale, scale_inv = ref_scales(amax, m, eps)
    out = torch.zeros(src.numel(), dtype=dtype)
    for i, (s, e) in enumerate(segments.tolist()):
        if e > s:
            out[s:e] = torch.clamp(src[s:e].float() * scale[i], -m, m).to(dtype)
    return out, scale_inv


def ref_amax(src, segments):
    x = src.double().abs()
    out = []
    for s, e in segments.tolist():
        if e == s:
            out.append(0.0)
        else:
            seg = x[s:e]
            out.append(float("nan") if torch.isnan(seg).any() else seg.max().item())
    return torch.tensor(out, dtype=torch.float64).float()


def mk(x: torch.Tensor, device: str, dtype=None, misalign: int = 0) -> torch.Tensor:
    """x on device, optionally as a view that starts `misalign` elements into a bigger buffer."""
    dtype = dtype or x.dtype
    buf = torch.empty(x.numel() + misalign, dtype=dtype, device=device)
    v = buf[misalign:]
    v.copy_(x.to(dtype)) if x.dtype != dtype else v.copy_(x)
    return v


# ----------------------------------------------------------------------------------------------
# build info
# ----------------------------------------------------------------------------------------------
def test_build_info():
    info = N.build_info()
    assert info["native"] is True and info["cpu"] is True
    for key in ("cuda", "nccl", "nccl_version", "cuda_arch"):
        assert key in info
    if HAS_CUDA:
        assert info["cuda"], "torch has CUDA but the extension was built without CUDA kernels"


# ----------------------------------------------------------------------------------------------
# cast
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,mis_src,mis_dst", [(1, 0, 0), (7, 1, 3), (4099, 0, 0), (100_003, 1, 1),
                                               (262_147, 3, 0), (65_536, 2, 6)])
def test_cast_matches_torch(device, dst_dtype, n, mis_src, mis_dst):
    x = rand_values(n, gen(n + mis_src))
    src = mk(x, device, misalign=mis_src)
    dst = poison(torch.empty(n + mis_dst, dtype=dst_dtype, device=device))[mis_dst:]
    N.cast(src, dst)
    assert_bits_equal(dst, x.to(dst_dtype), f"cast fp32->{dst_dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dst_dtype", FLOATS)
def test_cast_half_sources(device, src_dtype, dst_dtype):
    x = rand_values(10_001, gen(5), spread=6).to(src_dtype)
    dst = poison(torch.empty(x.numel(), dtype=dst_dtype, device=device))
    N.cast(x.to(device), dst)
    assert_bits_equal(dst, x.to(dst_dtype), f"cast {src_dtype}->{dst_dtype}")


def test_cast_rounding_ties_and_edges():
    # exact ties (round to even), values just above/below ties, overflow edges, subnormals
    base = torch.randint(-(2**31), 2**31 - 1, (20_000,), generator=gen(1), dtype=torch.int64)
    tie_bf16 = (base & ~0xFFFF) | 0x8000
    tie_f16 = (base & ~0x1FFF) | 0x1000
    raw = torch.cat([tie_bf16, tie_bf16 + 1, tie_bf16 - 1, tie_f16, tie_f16 + 1, tie_f16 - 1])
    raw = torch.where(raw >= 2**31, raw - 2**32, raw)
    raw = torch.where(raw < -(2**31), raw + 2**32, raw).to(torch.int32)
    x = raw.view(torch.float32)
    edges = torch.tensor([65504.0, 65519.99, 65520.0, 65536.0, 3.3895314e38, 3.4028235e38, 2.0**-24, 2.0**-25,
                          1.5 * 2.0**-25, 2.0**-14, 2.0**-133, 2.0**-149, -2.0**-25, 1e-45, -0.0])
    x = torch.cat([x, edges, -edges])
    for dt in (torch.bfloat16, torch.float16):
        out = torch.empty(x.numel(), dtype=dt)
        N.cast(x, out)
        assert_bits_equal(out, x.to(dt), f"ties {dt}")


# ----------------------------------------------------------------------------------------------
# pack / unpack
# ----------------------------------------------------------------------------------------------
def make_pack_case(sizes, g, gap_max=5, misalign=True):
    offsets, cur = [], 0
    for s in sizes:
        cur += int(torch.randint(0, gap_max + 1, (1,), generator=g)) if misalign else 0
        offsets.append(cur)
        cur += s
    total = cur + int(torch.randint(0, gap_max + 1, (1,), generator=g))
    return offsets, total


def ref_pack(tensors, offsets, total, dtype, scale):
    out = torch.zeros(total, dtype=dtype)
    s32 = torch.tensor(scale, dtype=torch.float32)
    for t, o in zip(tensors, offsets):
        v = t.reshape(-1).cpu().float()
        if float(s32) != 1.0:
            v = v * s32
        out[o:o + t.numel()] = v.to(dtype) if t.dtype != dtype or float(s32) != 1.0 else t.reshape(-1).cpu()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float16, torch.float32)])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_pack_matches_reference(device, src_dtype, out_dtype, scale):
    g = gen(11)
    sizes = [1, 0, 3, 17, 4096, 1000, 0, 65_537, 5, 12_345]
    tensors = [rand_values(s, g, specials=s > 100).to(src_dtype).to(device) for s in sizes]
    offsets, total = make_pack_case(sizes, g)
    out = poison(torch.empty(total, dtype=out_dtype, device=device))
    N.pack(tensors, offsets, out, scale)
    assert_bits_equal(out, ref_pack(tensors, offsets, total, out_dtype, scale), "pack")
    # against float64 too (semantics, not just torch's path)
    ref64 = torch.zeros(total, dtype=torch.float64)
    for t, o in zip(tensors, offsets):
        ref64[o:o + t.numel()] = t.cpu().double() * scale
    fin = torch.isfinite(ref64) & (ref64.abs() < 1e30)
    tol = 2.0**-7 if out_dtype == torch.bfloat16 or src_dtype != torch.float32 else 2.0**-20
    torch.testing.assert_close(out.cpu().double()[fin], ref64[fin], rtol=tol, atol=1e-30)


@pytest.mark.parametrize("device", DEVICES)
def test_pack_thousands_of_tiny_tensors_and_gaps(device):
    g = gen(12)
    sizes = torch.randint(0, 24, (3000,), generator=g).tolist()
    tensors = [rand_values(s, g, specials=False).to(device) for s in sizes]
    offsets, total = make_pack_case(sizes, g, gap_max=3)
    # shuffled order of the arguments: offsets need not be sorted
    perm = torch.randperm(len(sizes), generator=g).tolist()
    tensors = [tensors[i] for i in perm]
    offsets = [offsets[i] for i in perm]
    out = poison(torch.empty(total, dtype=torch.bfloat16, device=device))
    N.pack(tensors, offsets, out, 2.0)
    assert_bits_equal(out, ref_pack(tensors, offsets, total, torch.bfloat16, 2.0), "pack tiny")


@pytest.mark.parametrize("device", DEVICES)
def test_pack_mixed_dtypes_noncontiguous_and_empty(device):
    g = gen(13)
    a = rand_values(300, g).to(device)
    b = rand_values(40 * 30, g).view(40, 30).t().to(torch.bfloat16).to(device)  # non-contiguous
    c = rand_values(77, g).to(torch.float16).to(device)
    tensors, offsets = [a, b, c], [5, 400, 1700]
    out = poison(torch.empty(1800, dtype=torch.float32, device=device))
    N.pack(tensors, offsets, out, 0.5)
    assert_bits_equal(out, ref_pack(tensors, offsets, 1800, torch.float32, 0.5), "pack mixed")
    # no tensors at all: the output is all zeros
    out2 = poison(torch.empty(33, dtype=torch.bfloat16, device=device))
    N.pack([], [], out2)
    assert torch.equal(bits(out2).cpu(), torch.zeros(33, dtype=torch.int16))
    N.pack([], [], torch.empty(0, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype,out_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
def test_pack_pieces_matches_pack_of_slices(device, src_dtype, out_dtype):
    """pack_pieces == pack of the same slices, bit for bit; a None tensor leaves its ranges zero."""
    g = gen(19)
    shapes = [(7, 5), (1,), (300, 13), (0, 4), (64, 64), (33,)]
    tensors = [rand_values(math.prod(s), g).view(s).to(src_dtype).to(device) for s in shapes]
    world, pieces, slices, offsets, cur = 3, [], [], [], 0
    for i, t in enumerate(tensors):  # rank-major: each tensor's torch.chunk rows go to W places
        row = math.prod(t.shape[1:])
        for r, rows in enumerate(t.chunk(world) if t.numel() else []):
            offset = cur + 5 + r * 40_000
            pieces.append([i, r * -(-t.shape[0] // world) * row, rows.numel(), offset])
            slices.append(rows.reshape(-1))
            offsets.append(offset)
        cur += -(-t.shape[0] // world) * row + 7
    out, ref = (poison(torch.empty(3 * 40_000, dtype=out_dtype, device=device)) for _ in range(2))
    table = torch.tensor(pieces, dtype=torch.int64)
    N.pack_pieces(tensors, table, out, 0.25)
    N.pack(slices, offsets, ref, 0.25)
    assert_bits_equal(out, ref, "pack_pieces")
    N.pack_pieces([None if i == 2 else t for i, t in enumerate(tensors)], table, out, 0.25)
    keep = [k for k, p in enumerate(pieces) if p[0] != 2]
    N.pack([slices[k] for k in keep], [offsets[k] for k in keep], ref, 0.25)
    assert_bits_equal(out, ref, "pack_pieces with None")
    bad = [
        (ValueError, "names tensor 9", torch.tensor([[9, 0, 1, 0]])),
        (ValueError, r"reads \[0, 36\) of tensors\[0\]", torch.tensor([[0, 0, 36, 0]])),
        (ValueError, "does not fit in out", torch.tensor([[0, 0, 5, 3 * 40_000 - 2]])),
        (ValueError, "overlap in out", torch.tensor([[0, 0, 5, 0], [1, 0, 1, 4]])),
        (ValueError, r"shape \(n, 4\)", torch.tensor([[0, 0, 5]])),
    ]
    for exc, msg, pieces_table in bad:
        with pytest.raises(exc, match=msg):
            N.pack_pieces(tensors, pieces_table, out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16])
def test_unpack_matches_reference(device, flat_dtype):
    g = gen(14)
    total = 200_003
    flat = rand_values(total, g).to(flat_dtype).to(device)
    sizes = [0, 1, 33, 4097, 50_000, 7, 12_000]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16, torch.float32,
              torch.float32]
    offsets = [0, 3, 5, 101, 9000, 150_000, total - 12_000]  # overlapping reads are fine for unpack
    outs = [poison(torch.empty(s, dtype=d, device=device)) for s, d in zip(sizes, dtypes)]
    outs[4] = outs[4].view(100, 500)
    N.unpack(flat, offsets, outs)
    for o, off, d in zip(outs, offsets, dtypes):
        assert_bits_equal(o.reshape(-1), flat[off:off + o.numel()].cpu().to(d), "unpack")


@pytest.mark.parametrize("device", DEVICES)
def test_pack_unpack_roundtrip_many(device):
    g = gen(15)
    sizes = torch.randint(1, 300, (1500,), generator=g).tolist()
    tensors = [rand_values(s, g, specials=False).to(device) for s in sizes]
    offsets, total = make_pack_case(sizes, g, gap_max=2)
    flat = torch.empty(total, device=device)
    N.pack(tensors, offsets, flat)
    outs = [torch.empty_like(t) for t in tensors]
    N.unpack(flat, offsets, outs)
    for t, o in zip(tensors, outs):
        assert torch.equal(bits(t), bits(o))


# ----------------------------------------------------------------------------------------------
# segment amax / fp8 cast / dequantize
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype", FLOATS)
@pytest.mark.parametrize("total,nseg", [(1, 1), (1000, 7), (100_003, 40), (50_000, 3000)])
def test_segment_amax(device, src_dtype, total, nseg):
    g = gen(total + nseg)
    x = rand_values(total, g, specials=False).to(src_dtype)
    segs = random_segments(total, nseg, g)
    nonempty = (segs[:, 1] > segs[:, 0]).nonzero().flatten().tolist()
    if len(nonempty) >= 3:  # NaN in one segment, inf in another, a huge value in a third
        x[int(segs[nonempty[0], 0])] = float("nan")
        x[int(segs[nonempty[1], 1]) - 1] = -float("inf")
        x[int(segs[nonempty[2], 0])] = -6e4 if src_dtype == torch.float16 else -3e38
    amax = torch.full((nseg,), 123.0, device=device)
    N.segment_amax(x.to(device), segs.to(device), amax)
    assert_bits_equal(amax, ref_amax(x, segs), "segment_amax")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("total,nseg", [(5, 2), (10_007, 9), (300_001, 64), (40_000, 2500)])
def test_fp8_cast(device, dtype, src_dtype, total, nseg):
    g = gen(total * 3 + nseg)
    x = rand_values(total, g).to(src_dtype)
    segs = random_segments(total, nseg, g)
    amax = ref_amax(x, segs)
    # some segments get amax 0 / inf / NaN (scale 1), some an amax below the data (saturation)
    amax[torch.rand(nseg, generator=g) < 0.1] = 0.0
    amax[torch.rand(nseg, generator=g) < 0.05] = float("inf")
    amax[torch.rand(nseg, generator=g) < 0.05] = float("nan")
    low = torch.rand(nseg, generator=g) < 0.2
    amax[low] = amax[low] * 0.01
    dst = poison(torch.empty(total, dtype=dtype, device=device))
    scale_inv = torch.full((nseg,), float("nan"), device=device)
    N.fp8_cast(x.to(device), segs.to(device), amax.to(device), dst, scale_inv)
    ref, ref_inv = ref_fp8_cast(x, segs, amax, dtype)
    assert_bits_equal(dst, ref, f"fp8_cast {dtype}")
    assert_bits_equal(scale_inv, ref_inv, "scale_inv")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", F8)
def test_fp8_saturation_and_nan(device, dtype):
    m = N.FP8_MAX[dtype]
    x = torch.tensor([1e30, -1e30, float("inf"), -float("inf"), float("nan"), m * 1.01, -m * 1.5, m, 0.0, 1.0,
                      -1.0, 3.0e38, 1e-30])
    segs = torch.tensor([[0, x.numel()]])
    dst = poison(torch.empty(x.numel(), dtype=dtype, device=device))
    sinv = torch.empty(1, device=device)
    N.fp8_cast(x.to(device), segs.to(device), torch.ones(1, device=device) * 1.0, dst, sinv)  # scale = m
    got = dst.cpu().float()
    assert got[0] == m and got[1] == -m and got[2] == m and got[3] == -m, got
    assert math.isnan(got[4]) and got[5] == m and got[6] == -m and got[7] == m and got[11] == m
    assert got[9] == m and got[10] == -m and got[8] == 0.0
    assert float(sinv[0]) == float(torch.tensor(1.0) / torch.tensor(m))
    # eps: a tiny amax is clamped to eps
    N.fp8_cast(x.to(device), segs.to(device), torch.full((1,), 1e-30, device=device), dst, sinv, eps=1e-3)
    assert float(sinv[0]) == float(torch.tensor(1.0) / (torch.tensor(m) / torch.tensor(1e-3)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("out_dtype", FLOATS)
def test_fp8_dequantize(device, dtype, out_dtype):
    g = gen(21)
    total, nseg = 70_001, 30
    codes = torch.randint(0, 256, (total,), generator=g, dtype=torch.uint8).view(dtype)
    segs = random_segments(total, nseg, g)
    scale_inv = (torch.rand(nseg, generator=g) * 4 + 1e-3).float()
    dst = poison(torch.empty(total, dtype=out_dtype, device=device))
    N.fp8_dequantize(codes.to(device), segs.to(device), scale_inv.to(device), dst)
    ref = torch.zeros(total, dtype=out_dtype)
    for i, (s, e) in enumerate(segs.tolist()):
        ref[s:e] = (codes[s:e].float() * scale_inv[i]).to(out_dtype)
    assert_bits_equal(dst, ref, "fp8_dequantize")


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_roundtrip_error_bound(device):
    g = gen(22)
    x = rand_values(50_000, g, specials=False, spread=3)
    segs = torch.tensor([[0, 20_000], [20_000, 20_000], [20_000, 50_000]])
    amax = torch.empty(3, device=device)
    xd, sd = x.to(device), segs.to(device)
    N.segment_amax(xd, sd, amax)
    q = torch.empty(50_000, dtype=torch.float8_e4m3fn, device=device)
    sinv = torch.empty(3, device=device)
    N.fp8_cast(xd, sd, amax, q, sinv)
    back = torch.empty(50_000, device=device)
    N.fp8_dequantize(q, sd, sinv, back)
    # e4m3: relative error <= 2^-4 for normal values; absolute floor from the subnormal step
    err = (back.cpu() - x).abs()
    bound = x.abs() * (2.0**-4 + 2.0**-20) + amax.cpu().max() * 2.0**-9 / 448 * 2
    assert bool((err <= bound).all())
    assert float(sinv[1]) == 1.0


# ----------------------------------------------------------------------------------------------
# grad accumulate
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("red_dtype", FLOATS)
@pytest.mark.parametrize("scale", [1.0, 0.125, 1 / 3])
def test_grad_accumulate(device, red_dtype, scale):
    g = gen(31)
    n = 100_003
    red = rand_values(n, g, specials=False, spread=4).to(red_dtype)
    main0 = rand_values(n, g, specials=False, spread=4)
    s32 = torch.tensor(scale, dtype=torch.float32)
    # overwrite: a poisoned main_grad is fully replaced
    main = poison(torch.empty(n, device=device))
    N.grad_accumulate(main, red.to(device), scale, False)
    assert_bits_equal(main, red.float() * s32, "grad_accumulate overwrite")
    # accumulate: one rounding of main + scale * red (checked against float64)
    main = main0.clone().to(device)
    N.grad_accumulate(main, red.to(device), scale, True)
    exact = main0.double() + s32.double() * red.double()
    ref = exact.float()
    got = main.cpu()
    same = bits(got) == bits(ref)
    assert float(same.float().mean()) > 0.999  # float64 sum can differ from the exact fma in rare double roundings
    ulp = (bits(got).long() - bits(ref).long()).abs()
    assert int(ulp.max()) <= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts, offset, n", [(2, 0, 70_000), (4, 0, 70_000), (3, 1, 70_001), (2, 0, 70_001)])
def test_grad_accumulate_parts(device, main_dtype, parts, offset, n):
    """(parts, n) rows added in one launch equal one call per row, to the bit (main_grad stored between rows).
    n a multiple of 8, rows aligned: CUDA's one-pass kernel; offset 1 or n odd: the rows start off 16-byte
    alignment, each at a different misalignment (the chunk-by-chunk kernel)."""
    g = gen(33)
    flat = rand_values(parts * n + offset, g, specials=False, spread=4).to(torch.bfloat16)
    rows = flat[offset:].view(parts, n)
    main0 = rand_values(n, g, specials=False, spread=4).to(main_dtype)
    for accumulate in (False, True):
        want = main0.clone().to(device)
        for i in range(parts):
            N.grad_accumulate(want, rows[i].to(device), 1 / 3, accumulate or i > 0)
        got = main0.clone().to(device)
        N.grad_accumulate(got, flat.to(device)[offset:].view(parts, n), 1 / 3, accumulate)
        assert_bits_equal(got, want.cpu(), f"{parts} parts, accumulate={accumulate}")
    # two bf16 shards summed as the float32 reduce-scatter sums them: one rounding of s*a + s*b
    got = torch.empty(n, device=device)
    N.grad_accumulate(got, rows[:2].contiguous().to(device), 0.5, False)
    assert_bits_equal(got, rows[0].float() * 0.5 + rows[1].float() * 0.5, "2-rank sum")


@pytest.mark.parametrize("device", DEVICES)
def test_grad_accumulate_bf16_main(device):
    g = gen(32)
    red = rand_values(5003, g, specials=False, spread=3)
    main0 = rand_values(5003, g, specials=False, spread=3).to(torch.bfloat16)
    main = main0.clone().to(device)
    N.grad_accumulate(main, red.to(device), 0.5, True)
    ref = (main0.double() + 0.5 * red.double()).float()  # exact in float64 here, one rounding to fp32
    assert_bits_equal(main, ref.to(torch.bfloat16), "bf16 main")


# ----------------------------------------------------------------------------------------------
# input checks
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_clear_errors(device):
    d = device
    x = torch.randn(100, device=d)
    segs = torch.tensor([[0, 50], [50, 100]], device=d)
    amax, sinv = torch.empty(2, device=d), torch.empty(2, device=d)
    fp8 = torch.empty(100, dtype=torch.float8_e4m3fn, device=d)
    cases = [
        (TypeError, "src must be float32", lambda: N.cast(x.int(), torch.empty(100, device=d))),
        (TypeError, "use fp8_cast", lambda: N.cast(x, fp8)),
        (ValueError, "same number of elements", lambda: N.cast(x, torch.empty(99, device=d))),
        (ValueError, "contiguous", lambda: N.cast(x.view(10, 10).t(), torch.empty(10, 10, device=d))),
        (ValueError, "shape \\(n, 2\\)", lambda: N.segment_amax(x, torch.zeros(2, 3, dtype=torch.long, device=d),
                                                                amax)),
        (TypeError, "int64", lambda: N.segment_amax(x, segs.int(), amax)),
        (ValueError, "sorted and non-overlapping",
         lambda: N.segment_amax(x, torch.tensor([[50, 100], [0, 50]], device=d), amax)),
        (ValueError, "not a range inside",
         lambda: N.segment_amax(x, torch.tensor([[0, 50], [50, 101]], device=d), amax)),
        (ValueError, "one element per segment", lambda: N.segment_amax(x, segs, torch.empty(3, device=d))),
        (TypeError, "amax must be float32", lambda: N.segment_amax(x, segs, torch.empty(2, dtype=torch.float64,
                                                                                         device=d))),
        (TypeError, "float8_e4m3fn or float8_e5m2",
         lambda: N.fp8_cast(x, segs, amax, torch.empty(100, dtype=torch.bfloat16, device=d), sinv)),
        (ValueError, "must not overlap", lambda: N.fp8_cast(x, segs, amax, fp8, amax)),
        (ValueError, "does not fit in out", lambda: N.pack([x], [1], torch.empty(100, device=d))),
        (ValueError, "overlap in out", lambda: N.pack([x[:10], x[:10]], [0, 5], torch.empty(100, device=d))),
        (ValueError, "tensors but", lambda: N.pack([x], [0, 1], torch.empty(100, device=d))),
        (TypeError, "tensors\\[0\\] must be float32", lambda: N.pack([x.long()], [0], torch.empty(100, device=d))),
        (ValueError, "overlaps out", lambda: N.pack([x[:10]], [20], x)),
        (ValueError, "reads past the end", lambda: N.unpack(x, [95], [torch.empty(10, device=d)])),
        (ValueError, "outs\\[0\\] must be contiguous", lambda: N.unpack(x, [0], [torch.empty(4, 4, device=d).t()])),
        (ValueError, "main_grad's 100 elements", lambda: N.grad_accumulate(x, torch.empty(3, device=d), 1.0, True)),
        (ValueError, "be \\(parts, 100\\)", lambda: N.grad_accumulate(x, torch.empty(2, 50, device=d), 1.0, True)),
    ]
    for exc, msg, fn in cases:
        print(f"bad input case: {msg}", flush=True)  # names the case if a crash ends the process
        with pytest.raises(exc, match=msg):
            fn()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_device_mismatch_errors():
    x = torch.randn(10, device="cuda")
    with pytest.raises(ValueError, match="same device"):
        N.cast(x, torch.empty(10))
    with pytest.raises(ValueError, match="is on"):
        N.pack([torch.randn(3)], [0], torch.empty(10, device="cuda"))
    with pytest.raises(ValueError, match="same device"):
        N.segment_amax(x, torch.tensor([[0, 10]]), torch.empty(1, device="cuda"))
    # CUDA segment tables are validated too (once per table version)
    bad = torch.tensor([[5, 10], [0, 3]], device="cuda")
    with pytest.raises(ValueError, match="sorted and non-overlapping"):
        N.segment_amax(x, bad, torch.empty(2, device="cuda"))
    bad[1] = torch.tensor([10, 10], device="cuda")  # fixed in place: version changes, accepted now
    N.segment_amax(x, bad, torch.empty(2, device="cuda"))


def test_extension_has_no_private_libstdcxx():
    """_C must use the process's libstdc++. A private copy linked in (a toolchain that only has libstdc++.a)
    formats numbers with locale tables that were never set up: error messages with numbers segfaulted."""
    import shutil
    import subprocess

    from mfsdp_ext import _C

    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) not installed")
    defined = subprocess.run(["nm", "-D", "--defined-only", _C.__file__], capture_output=True, text=True,
                             check=True).stdout
    copied = [line.split()[-1] for line in defined.splitlines() if "_ZNSo9_M_insert" in line or "codecvt" in line]
    assert not copied, f"{_C.__file__} defines libstdc++ symbols {copied[:5]}: rebuild with setup.py (it links " \
                       "the process's libstdc++.so)"


def test_meta_tensors_are_accepted():
    m = torch.empty(10, device="meta")
    N.cast(m, torch.empty(10, device="meta", dtype=torch.bfloat16))
    N.pack([torch.empty(3, device="meta")], [2], m)
    N.grad_accumulate(m, torch.empty(10, device="meta"), 1.0, True)


# ----------------------------------------------------------------------------------------------
# GPU only: CPU == CUDA bit for bit, exhaustive conversions, one launch, streams, large sizes
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_cpu_and_cuda_identical_bits():
    g = gen(41)
    total, nseg = 1_000_003, 500
    x = rand_values(total, g)
    segs = random_segments(total, nseg, g)
    res = {}
    for dev in ("cpu", "cuda"):
        xs, ss = mk(x, dev, misalign=1), segs.to(dev)
        r = {}
        for dt in (torch.bfloat16, torch.float16):
            out = poison(torch.empty(total, dtype=dt, device=dev))
            N.cast(xs, out)
            r[f"cast{dt}"] = out
        amax = torch.empty(nseg, device=dev)
        N.segment_amax(xs, ss, amax)
        r["amax"] = amax
        for dt in F8:
            q, sinv = poison(torch.empty(total, dtype=dt, device=dev)), torch.empty(nseg, device=dev)
            N.fp8_cast(xs, ss, amax, q, sinv)
            back = poison(torch.empty(total, dtype=torch.bfloat16, device=dev))
            N.fp8_dequantize(q, ss, sinv, back)
            r[f"fp8{dt}"], r[f"sinv{dt}"], r[f"deq{dt}"] = q, sinv, back
        sizes = torch.randint(0, 5000, (800,), generator=gen(42)).tolist()
        offs, cur = [], 0
        for s in sizes:
            offs.append(cur + (s % 3))
            cur = offs[-1] + s
        ts = [x[i * 7 % 1000: i * 7 % 1000 + s].to(torch.bfloat16).to(dev) for i, s in enumerate(sizes)]
        flat = poison(torch.empty(cur + 5, device=dev))
        N.pack(ts, offs, flat, 1 / 3)
        r["pack"] = flat
        main = x.clone().to(dev)
        N.grad_accumulate(main, r["cast" + str(torch.bfloat16)], 0.3, True)
        r["acc"] = main
        res[dev] = r
    for k in res["cpu"]:
        assert_identical(res["cpu"][k], res["cuda"][k], k)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_exhaustive_fp32_patterns_vs_torch_cuda():
    """Every fp32 bit pattern: bf16 / fp16 cast and (clamped) fp8 cast equal torch's CUDA conversions."""
    chunk = 1 << 28
    one = torch.ones(1, device="cuda")
    segs = torch.tensor([[0, chunk]], device="cuda")
    bad = {}
    for c in range((1 << 32) // chunk):
        raw = torch.arange(c * chunk, (c + 1) * chunk, device="cuda", dtype=torch.int64)
        x = (raw - (raw >= 2**31).long() * 2**32).to(torch.int32).view(torch.float32)
        del raw
        nan = torch.isnan(x)
        for dt in (torch.bfloat16, torch.float16):
            y = torch.empty(chunk, dtype=dt, device="cuda")
            N.cast(x, y)
            ok = (bits(y) == bits(x.to(dt))) | (nan & torch.isnan(y))
            bad[dt] = bad.get(dt, 0) + int((~ok).sum())
        for dt in F8:
            m = N.FP8_MAX[dt]
            y, sinv = torch.empty(chunk, dtype=dt, device="cuda"), torch.empty(1, device="cuda")
            N.fp8_cast(x, segs, one * m, y, sinv)
            ref = torch.clamp(x, -m, m).to(dt)
            ok = (bits(y) == bits(ref)) | (nan & torch.isnan(y.float()))
            bad[dt] = bad.get(dt, 0) + int((~ok).sum())
        del x, nan
    assert all(v == 0 for v in bad.values()), bad


def _count_kernels(fn):
    names = [name for name, _, _ in run_profiled(fn)[1]]
    return [n for n in names if "memcpy" not in n.lower() and "memset" not in n.lower()]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_pack_is_one_launch():
    g = gen(51)
    sizes = torch.randint(1, 4096, (2000,), generator=g).tolist()
    tensors = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in sizes]
    offsets, total = make_pack_case(sizes, g, gap_max=8)
    out = torch.empty(total, device="cuda")
    N.pack(tensors, offsets, out, 0.5)  # warm-up
    kernels = _count_kernels(lambda: N.pack(tensors, offsets, out, 0.5))
    assert len(kernels) == 1 and "copy_table" in kernels[0], kernels
    outs = [torch.empty_like(t) for t in tensors]
    kernels = _count_kernels(lambda: N.unpack(out, offsets, outs))
    assert len(kernels) == 1, kernels
    seg = torch.tensor([[o, o + s] for o, s in zip(offsets, sizes)], device="cuda")
    q, sinv, amax = torch.empty(total, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(2000, device="cuda"), \
        torch.empty(2000, device="cuda")
    N.fp8_cast(out, seg, amax, q, sinv)
    assert len(_count_kernels(lambda: N.fp8_cast(out, seg, amax, q, sinv))) == 1
    assert len(_count_kernels(lambda: N.segment_amax(out, seg, amax))) == 1


INLINE = N.PACK_INLINE_TABLE_ENTRIES  # 160


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
@pytest.mark.parametrize("n", [1, 8, INLINE, INLINE + 1])
def test_pack_small_tables_travel_in_kernel_parameters(n):
    """Up to INLINE copy entries the table is a kernel parameter: no upload, one kernel, graph-capturable."""
    g = gen(53)
    sizes = torch.randint(1, 3000, (n,), generator=g).tolist()
    tensors = [rand_values(s, g, specials=False).cuda() for s in sizes]
    offsets, total = make_pack_case(sizes, g, gap_max=0)  # no gaps: n tensors = n entries
    out = poison(torch.empty(total, device="cuda"))
    N.pack(tensors, offsets, out)
    assert_bits_equal(out, ref_pack(tensors, offsets, total, torch.float32, 1.0), "pack")
    prof = _count_kernels(lambda: N.pack(tensors, offsets, out))
    assert len(prof) == 1 and ("copy_table_inline" in prof[0]) == (n <= INLINE), prof
    if n > INLINE:
        return
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        N.pack(tensors, offsets, out, 2.0)
    for t in tensors:
        t.mul_(-1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert_bits_equal(out, ref_pack(tensors, offsets, total, torch.float32, 2.0), "pack replayed from a CUDA graph")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_runs_on_current_stream():
    x = torch.randn(1 << 22, device="cuda")
    y = torch.empty(1 << 22, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    z = poison(torch.empty(1000, device="cuda"))
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # the kernels must queue behind this on s
        N.cast(x, y)
        N.pack([x[:100]], [0], z)
    s.synchronize()
    assert torch.equal(bits(y), bits(x.to(torch.bfloat16)))
    assert torch.equal(z[:100], x[:100]) and not z[100:].any()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_large_and_misaligned_cuda():
    g = torch.Generator(device="cuda").manual_seed(61)
    total = 50_000_017
    x = torch.randn(total + 3, device="cuda", generator=g)[3:]  # misaligned by 12 bytes
    segs = torch.tensor([[0, 1], [5, 20_000_003], [20_000_003, 20_000_003], [20_000_010, total - 2]],
                        device="cuda")
    amax = torch.empty(4, device="cuda")
    N.segment_amax(x, segs, amax)
    ref = torch.stack([x[s:e].abs().max() if e > s else torch.zeros((), device="cuda")
                       for s, e in segs.tolist()])
    assert torch.equal(amax, ref)
    q = poison(torch.empty(total, dtype=torch.float8_e5m2, device="cuda"))
    sinv = torch.empty(4, device="cuda")
    N.fp8_cast(x, segs, amax, q, sinv)
    qc = torch.empty(total, dtype=torch.float8_e5m2)
    sc = torch.empty(4)
    N.fp8_cast(x.cpu(), segs.cpu(), amax.cpu(), qc, sc)
    assert_identical(q, qc, "large fp8")
    y = poison(torch.empty(total + 1, dtype=torch.bfloat16, device="cuda"))[1:]
    N.cast(x, y)
    assert torch.equal(bits(y), bits(x.to(torch.bfloat16)))
